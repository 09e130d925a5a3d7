"""The chunked prefill templates (tiles/gdn_prefill.py) and their kernel specs compile for sm_90a with nvcc (CPU only).

Skips cleanly when TileLang or nvcc is missing; tests/gpu/test_gdn_prefill.py covers the numerics.
"""

import importlib.util
import os
import shutil

import pytest

pytestmark = [pytest.mark.tilelang, pytest.mark.slow]

_NVCC = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
if importlib.util.find_spec("tilelang") is None or not _NVCC:
    pytest.skip("needs TileLang and nvcc", allow_module_level=True)

from kvbuffer.gpus import get_gpu  # noqa: E402
from kvbuffer.tiles import compile_template, gdn_prefill  # noqa: E402

CASES = {
    "chunks": (gdn_prefill.gdn_prefill_chunks, {}),
    "prep_qwen35_9b": (gdn_prefill.gdn_prefill_prep, dict(Hk=16, Hv=32)),
    # Tinv blockwise: 16 x 16 diagonal blocks by substitution, merged by four tensor-core products
    "prep_blockwise_qwen35_9b": (gdn_prefill.gdn_prefill_prep, dict(Hk=16, Hv=32, solve="blockwise")),
    # w, then u, each written from shared memory by rows
    "prep_staged_qwen35_9b": (gdn_prefill.gdn_prefill_prep, dict(Hk=16, Hv=32, staged=1)),
    "output_staged_qwen35_9b": (gdn_prefill.gdn_prefill_output, dict(Hk=16, Hv=32, staged=1)),
    "output_staged_nano": (gdn_prefill.gdn_prefill_output,
                           dict(Hk=8, Hv=64, K=128, V=64, BV=64, delta_rule=False, staged=1)),
    "states_qwen35_9b": (gdn_prefill.gdn_prefill_states, dict(Hk=16, Hv=32)),
    "output_qwen35_9b": (gdn_prefill.gdn_prefill_output, dict(Hk=16, Hv=32)),
    # the state pass with its chunk loads pipelined (TMA loads from a producer warpgroup)
    "states_pipelined_qwen35_9b": (gdn_prefill.gdn_prefill_states, dict(Hk=16, Hv=32, stages=2)),
    # the decay-only form at Nemotron-3 Nano's shape (8 groups, 64 heads, state 128, head dim 64)
    "states_decay_only_nano": (gdn_prefill.gdn_prefill_states, dict(Hk=8, Hv=64, K=128, V=64, delta_rule=False)),
    "output_nano": (gdn_prefill.gdn_prefill_output, dict(Hk=8, Hv=64, K=128, V=64, BV=64, delta_rule=False)),
    "states_decay_only_pipelined_nano": (gdn_prefill.gdn_prefill_states,
                                         dict(Hk=8, Hv=64, K=128, V=64, BV=16, stages=2, delta_rule=False)),
    # the value heads of one chunk on consecutive blocks
    "prep_heads_inner_qwen35_9b": (gdn_prefill.gdn_prefill_prep, dict(Hk=16, Hv=32, heads_inner=1)),
    "output_heads_inner_nano": (gdn_prefill.gdn_prefill_output,
                                dict(Hk=8, Hv=64, K=128, V=64, BV=64, delta_rule=False, heads_inner=1)),
}


@pytest.mark.parametrize("case", CASES)
def test_prefill_template_compiles_for_sm90a(case):
    template, params = CASES[case]
    src = compile_template(template(**params), get_gpu("h200").target).get_kernel_source()
    assert "__global__" in src
    if case != "chunks":  # the products run on tensor cores
        assert "wgmma" in src
    if params.get("stages"):
        assert "tma_load" in src


def test_configs_fit_the_templates():
    """Every tunable configuration is accepted by the templates it names (no compile)."""
    for cfg in gdn_prefill.configs():
        for delta_rule in (True, False):
            gdn_prefill.gdn_prefill_states(16, 32, BV=cfg["states_BV"], stages=cfg.get("states_stages", 0),
                                           delta_rule=delta_rule)
            gdn_prefill.gdn_prefill_output(16, 32, BV=cfg["output_BV"], delta_rule=delta_rule,
                                           heads_inner=cfg.get("heads_inner", 0), staged=cfg.get("staged_stores", 0))
        gdn_prefill.gdn_prefill_prep(16, 32, solve=cfg.get("prep_solve", "substitution"),
                                     heads_inner=cfg.get("heads_inner", 0), staged=cfg.get("staged_stores", 0))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="BV"):
        gdn_prefill.gdn_prefill_states(16, 32, BV=48)
    with pytest.raises(ValueError, match="multiple"):
        gdn_prefill.gdn_prefill_prep(16, 24)
    with pytest.raises(ValueError, match="stages"):
        gdn_prefill.gdn_prefill_states(8, 64, 128, 64, stages=-1, delta_rule=False)
    for delta_rule in (True, False):  # the pipelined pass loads the decays of GW heads at once
        with pytest.raises(ValueError, match="multiple of 4"):
            gdn_prefill.gdn_prefill_states(1, 2, 32, 32, stages=2, delta_rule=delta_rule)
    with pytest.raises(ValueError, match="solve"):
        gdn_prefill.gdn_prefill_prep(16, 32, solve="cholesky")
    with pytest.raises(ValueError, match="heads_inner"):
        gdn_prefill.gdn_prefill_output(16, 32, heads_inner=2)


# ----------------------------------------------------------------------------------------------
# the kernel specs (kvbuffer.kernels.specs: GDN_CHUNK_PREFILL, MAMBA2_CHUNK_PREFILL)

from kvbuffer.kernels import build_gdn_chunk_prefill, build_mamba2_chunk_prefill, lookup, prefill, specs  # noqa: E402
from kvbuffer.kernels.keys import GDNDims, KernelKey, Mamba2Dims  # noqa: E402

DECAY_ONLY_PARTS = ["chunks", "states", "output"]
SPEC_SHAPES = {
    "gdn_qwen35_9b": (KernelKey("gdn", "chunk_prefill", GDNDims(16, 32, 128, 128), "bfloat16"),
                      ["chunks", "prep", "states", "output"]),
    "mamba2_nano": (KernelKey("mamba2", "chunk_prefill", Mamba2Dims(8, 64, 128, 64), "bfloat16"), DECAY_ONLY_PARTS),
    "mamba2_small": (KernelKey("mamba2", "chunk_prefill", Mamba2Dims(2, 4, 64, 32), "bfloat16"), DECAY_ONLY_PARTS),
}


@pytest.fixture
def h200(monkeypatch):
    """The local GPU's target, for a machine without one: an H200's (sm_90a)."""
    monkeypatch.setattr(specs, "local_target", lambda: get_gpu("h200").target)


@pytest.mark.parametrize("case", SPEC_SHAPES)
def test_spec_compiles_every_part_for_sm90a(case, h200):
    """The JIT builds a chunked prefill through its spec: one compiled function per launch, on tensor cores;
    Mamba-2's decay-only form has no prep launch."""
    key, parts = SPEC_SHAPES[case]
    op = lookup.jit(key)
    assert op.kind == "chunk_prefill" and sorted(op.fn) == sorted(parts)
    assert op.params["delta_rule"] == (key.family == "gdn")
    for part in parts:
        src = op.fn[part].get_kernel_source()
        assert "__global__" in src and (part == "chunks" or "wgmma" in src), part


def test_build_functions_compile_their_spec(monkeypatch):
    """build_gdn_chunk_prefill / build_mamba2_chunk_prefill and the JIT make the same prim functions: the
    tunables given over the target arch's defaults (sm_90a: GDN's state pass pipelined)."""
    import kvbuffer.tiles as tiles

    monkeypatch.setattr(tiles, "compile_template", lambda prim, target: prim)
    monkeypatch.setattr(specs, "local_target", lambda: {"kind": "cuda", "arch": "sm_90a"})
    for op, (key, _) in ((build_gdn_chunk_prefill(16, 32, states_BV=64), SPEC_SHAPES["gdn_qwen35_9b"]),
                         (build_mamba2_chunk_prefill(8, 64, 128, 64), SPEC_SHAPES["mamba2_nano"])):
        arch_defaults = specs.spec_for(key).target_defaults(key, "sm_90a")
        tunables = prefill.prefill_tunables(key, {**arch_defaults, "states_BV": op.params["states_BV"]})
        want = specs.spec_for(key).prim(key, tunables)
        assert {p: f.script() for p, f in op.fn.items()} == {p: f.script() for p, f in want.items()}
        assert op.params == specs.spec_for(key).launch_params(key, tunables)


def test_prefill_tunables():
    """Defaults are the templates' first config; value tiles fit the head's V; unknown names are refused."""
    gdn, nano = SPEC_SHAPES["gdn_qwen35_9b"][0], SPEC_SHAPES["mamba2_nano"][0]
    first = gdn_prefill.configs()[0]
    assert prefill.prefill_tunables(gdn) == dict(first, states_stages=0, threads=128, prep_solve="substitution",
                                                 staged_stores=0, heads_inner=0)
    assert prefill.prefill_tunables(nano)["output_BV"] == 64
    odd = KernelKey("mamba2", "chunk_prefill", Mamba2Dims(2, 4, 64, 48), "bfloat16")
    assert prefill.prefill_tunables(odd) == dict(first, states_stages=0, threads=128, prep_solve="substitution",
                                                 staged_stores=0, heads_inner=0,
                                               states_BV=16, output_BV=48)
    with pytest.raises(TypeError, match="BV"):
        prefill.prefill_tunables(gdn, {"BV": 32})
    assert any(c.get("states_stages") for c in specs.MAMBA2_CHUNK_PREFILL.configs())
    assert {c["prep_solve"] for c in specs.MAMBA2_CHUNK_PREFILL.configs()} == {"substitution"}  # no prep
    assert {c["prep_solve"] for c in specs.GDN_CHUNK_PREFILL.configs()} == {"substitution", "blockwise"}
    assert {c["staged_stores"] for c in specs.MAMBA2_CHUNK_PREFILL.configs()} == {0, 1}
    assert {c["staged_stores"] for c in specs.GDN_CHUNK_PREFILL.configs()} == {0, 1}
    assert any(c.get("states_stages") for c in specs.GDN_CHUNK_PREFILL.configs())


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_tune_stores_one_artifact_per_launch_and_the_lookup_joins_them(family, tmp_path, monkeypatch):
    """`kvbuffer tune --build-only` stores the chunked prefill as one artifact per launch (built for an absent
    GPU, with that GPU's untuned defaults); the run-time lookup loads them into one op of kind chunk_prefill,
    JIT off."""
    import torch
    from click.testing import CliRunner

    from kvbuffer import gpus
    from kvbuffer.cli.main import main

    if torch.cuda.is_available():
        pytest.skip("this test builds for a GPU that is not present")
    args = ["tune", "--gpu", "h100", "--heads", "2,4,32,32", "--family", family, "--kernels",
            f"{family}_chunk_prefill", "--chunk-sizes", "8", "--batch-buckets", "1", "--cache-dir", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gpus, "detect_local_gpu", lambda device=0: gpus.get_gpu("h100"))
    monkeypatch.setattr(lookup, "jit_allowed", lambda: False)
    lookup.clear_kernels()
    try:
        key = KernelKey(family, "chunk_prefill", (GDNDims if family == "gdn" else Mamba2Dims)(2, 4, 32, 32), "bfloat16")
        op = lookup.kernel_for(key, 3)
        assert op.kind == "chunk_prefill" and sorted(op.fn) == sorted(specs.spec_for(key).parts(key))
        spec = specs.spec_for(key)  # the untuned build for the H100's arch (GDN: its state pass pipelined)
        assert op.params == spec.launch_params(key, spec.defaults_on(key, "sm_90a"))
    finally:
        lookup.clear_kernels()


def test_every_config_is_complete():
    """A tuned artifact records its config's tunables: each names every one, so loading one needs no defaults."""
    for spec in (specs.GDN_CHUNK_PREFILL, specs.MAMBA2_CHUNK_PREFILL):
        assert all(set(c) == set(prefill.PREFILL_TUNABLES) for c in spec.configs())


def test_pipelined_decay_only_pass_sums_its_decays_without_tilelangs_scan():
    """T.cumsum's scan runs on the block's first threads; in a pipelined pass those are the producer
    warpgroup's, so the consumers' decays went unsummed (every Mamba-2 state wrong on the GPU). The
    pipelined pass sums them itself; the plain pass keeps T.cumsum."""
    def source(stages):
        prim = gdn_prefill.gdn_prefill_states(8, 64, K=128, V=64, BV=16, stages=stages, delta_rule=False)
        return compile_template(prim, get_gpu("h200").target).get_kernel_source()

    assert "CumSum" not in source(2)
    assert "CumSum1D" in source(0)
