"""First use on a GPU, as a new user meets it: `kvbuffer generate` on the bundled demo with an
empty artifact cache builds the demo's kernels once (one line saying so, one progress line per
kernel) and runs on them; a second run loads them from the cache and compiles nothing (TileLang is
blocked in that process, so a compile could not happen) and runs on them too. The CPU side of the
same flow, with a faked GPU and build, is tests/kernels/test_first_use.py."""

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]

GENERATE = ["generate", "--prompt", "The built-in function ", "--max-new-tokens", "32"]
BLOCKED = """
import sys
for name in ("tilelang", "tvm"):
    sys.modules[name] = None  # any compile in this process would fail
from kvbuffer.cli.main import main
main(sys.argv[1:])
"""


def generate(tmp_path, blocked: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVBUFFER_CACHE_DIR=str(tmp_path))
    for name in ("KVBUFFER_JIT", "KVBUFFER_BUILD_KERNELS"):
        env.pop(name, None)
    head = [sys.executable, "-c", BLOCKED] if blocked else [sys.executable, "-m", "kvbuffer.cli.main"]
    res = subprocess.run(head + GENERATE, env=env, capture_output=True, text=True, timeout=550)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def test_generate_builds_the_demo_kernels_once_then_loads_them(tmp_path):
    first = generate(tmp_path, blocked=False)
    building = [line for line in first.stderr.splitlines() if line.startswith("kvbuffer: building the")]
    assert len(building) == 1 and "untuned defaults" in building[0] and "kvbuffer tune" in building[0], first.stderr
    assert "] gdn_buffered_step C=16: built" in first.stderr and "] conv1d_step: built" in first.stderr
    assert "linear layers on kernels" in first.stderr, first.stderr
    assert "note:" not in first.stderr and "INFO" not in first.stderr, first.stderr
    assert (tmp_path / "manifest.json").exists()

    second = generate(tmp_path, blocked=True)
    assert "building" not in second.stderr and "note:" not in second.stderr, second.stderr
    assert "linear layers on kernels" in second.stderr, second.stderr
    assert second.stdout == first.stdout  # greedy, same kernels: the same text


def test_compiled_verify_builds_its_missing_attention_kernels(tmp_path, monkeypatch):
    """An artifact cache with the decode step's attention kernels but no verify's (a plain run filled
    it): a compiled speculative engine's first verify builds the verify pair (outside the CUDA-graph
    capture; the Backend's eager check is skipped under torch.compile) and keeps its compiled forward,
    instead of dropping it for every later step."""
    import torch

    from kvbuffer import LLM, ops
    from kvbuffer.kernels import lookup
    from tests.gpu.test_engine_perf import PROMPTS, _run
    from tests.support.tiny_models import tiny_model

    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    for name in ("KVBUFFER_JIT", "KVBUFFER_BUILD_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    ops.allow_jit(False)
    lookup.clear_kernels()
    torch._dynamo.reset()
    kw = dict(device="cuda", dtype=torch.bfloat16, chunk_size=8, max_batch=4, max_len=96, kernels=True)
    try:
        plain = LLM(tiny_model("qwen3_5", head_dim=64), **kw)
        refs = [(p, o.token_ids) for p, o in zip(PROMPTS, _run(plain))]
        tokens = {k.T for k in lookup.loaded_keys() if k.family == "attention"}
        assert 1 in tokens and 4 not in tokens, tokens  # the decode pair (and a prompt's), no verify's
        lookup.clear_kernels()
        spec = LLM(tiny_model("qwen3_5", head_dim=64), compile=True,
                   speculative={"method": "ngram", "num_draft_tokens": 3}, **kw)
        _run(spec, refs)
        assert spec.runner.compiled is not None, "the compiled forward was dropped"
        assert any(k.family == "attention" and k.T == 4 for k in lookup.loaded_keys())
    finally:
        ops.allow_jit(None)
        lookup.clear_kernels()
