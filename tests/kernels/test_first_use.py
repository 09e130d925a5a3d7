"""First use on a GPU (kvbuffer.kernels.autobuild), on a CPU with a faked GPU: an engine whose
kernels are missing asks for them to be built once, then loads them; without TileLang (or with
the build switched off) it stays on the reference ops and says in one line which command builds
them. The real build runs in tests/gpu/test_first_use.py."""

import importlib.util
import io
import os
import subprocess
import sys

import pytest
import torch

import kvbuffer
from kvbuffer import gpus
from kvbuffer.autotune import registry
from kvbuffer.autotune.cache import ArtifactCache
from kvbuffer.errors import ArtifactError
from kvbuffer.kernels import autobuild, lookup, specs
from kvbuffer.runtime import backend
from tests.kernels.test_tune_cli import fake_template

CUDA = torch.device("cuda")  # resolve_backend only reads its type; nothing runs on it here
COMMAND = "kvbuffer tune --gpu h200 --heads 2,4,32,32 --chunk-sizes 16"


@pytest.fixture(scope="module")
def demo():
    """The demo model's cache spec and dtype (CPU-built; the backend choice depends on nothing else)."""
    llm = kvbuffer.LLM(kvbuffer.demo_checkpoint(), device="cpu", max_batch=2, max_len=64)
    return llm.runner.spec, llm.dtype


@pytest.fixture
def gpu_here(monkeypatch, tmp_path):
    """An H200 'here', an empty artifact cache, JIT off, and a kernel lookup that succeeds once
    something was built (the fake build below records what it was asked for)."""
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(autobuild.SWITCH, raising=False)
    monkeypatch.setattr(gpus, "detect_local_gpu", lambda device=0: gpus.get_gpu("h200"))
    monkeypatch.setattr(gpus, "local_target", lambda device=0: gpus.get_gpu("h200").target)
    lookup.allow_jit(False)
    builds = []

    def kernel_for(key, batch=1):
        if not builds:
            raise ArtifactError(f"no compiled kernel for {key}; build it with `{specs.tune_command(key)}`")
        return object()

    monkeypatch.setattr(lookup, "kernel_for", kernel_for)
    monkeypatch.setattr(autobuild, "build", lambda key, conv_dtype, gpu, command: builds.append((key, conv_dtype,
                                                                                                  gpu.name, command)))
    yield builds
    lookup.allow_jit(None)


def no_tilelang(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "tilelang" else find_spec(name, *a, **k))


def test_missing_kernels_are_built_once_then_loaded(demo, gpu_here):
    spec, dtype = demo
    chosen, why = backend.resolve_backend("auto", CUDA, spec, dtype, "kvbuffer")
    assert chosen.kernels and why == "compiled kernels"
    (key, conv_dtype, gpu, command), = gpu_here
    assert (key.C, key.cap, specs.layouts(key), gpu, command) == (16, 17, [(16, 0)], "h200", COMMAND)
    assert specs.record_shapes(key)[0] == {"family": "gdn", "Hk": 2, "Hv": 4, "K": 32, "V": 32, "dtype": "bfloat16"}
    assert conv_dtype == "float32"  # the demo runs in fp32; its linear kernels in bf16, its conv in fp32
    again, _ = backend.resolve_backend("auto", CUDA, spec, dtype, "kvbuffer")  # a second engine
    assert again.kernels and len(gpu_here) == 1


def test_without_tilelang_one_line_names_the_command(demo, gpu_here, monkeypatch):
    no_tilelang(monkeypatch)
    chosen, why = backend.resolve_backend("auto", CUDA, spec := demo[0], demo[1], "kvbuffer")
    assert not chosen.kernels and not gpu_here
    assert "\n" not in why and why.startswith("no compiled kernels") and f"`{COMMAND}`" in why
    assert autobuild.INSTALL in why
    with pytest.raises(ValueError, match="kernels=True, but no compiled kernels"):
        backend.resolve_backend(True, CUDA, spec, demo[1], "kvbuffer")


def test_switched_off_builds_nothing(demo, gpu_here, monkeypatch):
    monkeypatch.setenv(autobuild.SWITCH, "0")
    chosen, why = backend.resolve_backend("auto", CUDA, *demo, "kvbuffer")
    assert not chosen.kernels and not gpu_here and autobuild.SWITCH in why and COMMAND in why


def test_speculative_layout_names_its_drafts(demo, gpu_here):
    spec = demo[0].__class__(**{**vars(demo[0]), "chunk_size": 8, "max_drafts": 5})
    backend.resolve_backend("auto", CUDA, spec, torch.bfloat16, "kvbuffer")
    (key, conv_dtype, _, command), = gpu_here
    assert specs.layouts(key) == [(8, 4)] and conv_dtype == "bfloat16"
    assert command.endswith("--chunk-sizes 8 --draft-tokens 4")


def test_build_compiles_the_tune_build_only_set_with_one_line_and_progress(monkeypatch, tmp_path):
    """The real build function with fake templates: the linear shape and its conv, one layout,
    untuned records in the cache; one line saying so, then one progress line per kernel."""
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(registry, "templates", lambda family: [fake_template(f"{family}_toy")])
    key = backend.decode_step_key(kvbuffer.LLM(kvbuffer.demo_checkpoint(), device="cpu", max_batch=1,
                                               max_len=32).runner.spec, torch.bfloat16)
    out = io.StringIO()
    autobuild.build(key, "bfloat16", gpus.get_gpu("h200"), COMMAND, stream=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("kvbuffer: building the 2 kernels this model needs for the h200 once")
    assert f"`{COMMAND}` measures" in lines[0] and str(tmp_path) in lines[0]
    assert [line.split(":")[0] for line in lines[1:]] == ["[1/2] gdn_toy C=16", "[2/2] conv1d_toy C=16"]
    tunings = ArtifactCache(tmp_path).manifest()["tunings"]
    assert sorted(e["shape"]["family"] for e in tunings.values()) == ["conv1d", "gdn"]
    assert {e["status"] for e in tunings.values()} == {"untuned"}


def test_nvcc_is_found_where_tilelang_looks(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert autobuild.nvcc_path() is None and "$CUDA_HOME" in autobuild.nvcc_problem()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    assert autobuild.nvcc_path() == str(tmp_path / "bin" / "nvcc") and autobuild.nvcc_problem() is None
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(autobuild, "DEFAULT_CUDA_HOME", tmp_path / "none")
    monkeypatch.setattr(autobuild.importlib.metadata, "files", lambda dist: [])
    problem = autobuild.nvcc_problem()
    assert "CUDA_HOME" in problem and "PATH" in problem and "\n" not in problem


LOAD_WITHOUT_TILELANG = """
import sys
sys.modules["tilelang"] = None
import torch, kvbuffer
from kvbuffer import gpus
gpus.detect_local_gpu = lambda device=0: gpus.get_gpu("h200")
from kvbuffer.kernels import launch, lookup
from kvbuffer.runtime import backend
spec = kvbuffer.LLM(kvbuffer.demo_checkpoint(), device="cpu", max_batch=1, max_len=32).runner.spec
chosen, why = backend.resolve_backend("auto", torch.device("cuda"), spec, torch.float32, "kvbuffer")
D, W = spec.conv_dim, spec.conv_width
x, pool, w = torch.zeros(1, 1, D), torch.zeros(1, D, W), torch.zeros(D, W)  # the pool spans W - 1 + 1 tokens
lookup.kernel_for(launch.conv_update_key("advance", x, pool, w, None, True), 1)
print(chosen.name, len(lookup.loaded_keys()), "kvbuffer.tiles.gdn_prefill" in sys.modules)
"""


@pytest.mark.tilelang
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None or autobuild.nvcc_path() is None,
                    reason="needs TileLang and nvcc to compile")
def test_real_build_for_an_absent_gpu_loads_in_a_process_without_tilelang(demo, monkeypatch, tmp_path):
    """The real build (TileLang compiles for sm_90a on this CPU) of what the fp32 demo launches on an
    H200; then a process with TileLang blocked picks the kernels for it and finds its conv's."""
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    key = backend.decode_step_key(demo[0], demo[1])
    gpu = gpus.get_gpu("h200")
    out = io.StringIO()
    autobuild.build(key, "float32", gpu, autobuild.tune_command(key, gpu.name), stream=out)
    assert out.getvalue().count("\n") == 10 and "[9/9] conv1d_prefill: built" in out.getvalue()
    res = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_TILELANG], capture_output=True, text=True,
                         env=dict(os.environ, KVBUFFER_CACHE_DIR=str(tmp_path)))
    assert res.returncode == 0, res.stderr[-2000:]
    # prefill chunks 8, 4, 2, the decode step, the chunked prefill (its artifacts' tunables read, no template
    # imported), the conv step
    assert res.stdout.split() == ["kernels", "6", "False"]


def test_a_cache_without_the_chunked_prefill_builds_it_once(demo, gpu_here, monkeypatch):
    """Artifacts from before the chunked prefill: every needed kernel loads but it; the first engine builds
    the shape's set once (the rest reused), a second one finds it."""
    spec, dtype = demo
    built = gpu_here

    def kernel_for(key, batch=1):
        if key.op == "chunk_prefill" and not built:
            raise ArtifactError("no compiled chunk_prefill kernel")
        return object()

    monkeypatch.setattr(lookup, "kernel_for", kernel_for)
    chosen, _ = backend.resolve_backend("auto", CUDA, spec, dtype, "kvbuffer")
    assert chosen.kernels and len(built) == 1
    backend.resolve_backend("auto", CUDA, spec, dtype, "kvbuffer")
    assert len(built) == 1
    assert backend.prefill_kernel(spec, dtype).op == "chunk_prefill"


def test_without_tilelang_a_missing_chunked_prefill_keeps_the_kernels(demo, gpu_here, monkeypatch, caplog):
    no_tilelang(monkeypatch)
    monkeypatch.setattr(lookup, "kernel_for", lambda key, batch=1: (_ for _ in ()).throw(ArtifactError("none"))
                        if key.op == "chunk_prefill" else object())
    with caplog.at_level("INFO", logger="kvbuffer"):
        chosen, why = backend.resolve_backend("auto", CUDA, *demo, "kvbuffer")
    assert chosen.kernels and why == "compiled kernels" and not gpu_here
    assert any("prompts run as verify chunks" in r.getMessage() for r in caplog.records)
