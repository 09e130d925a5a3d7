"""One KernelSpec per kernel: every key has one, and the JIT, the `build_*` functions and the tuner build
the same TileLang function through it (compiling stubbed: the prim functions' scripts compare)."""

import importlib.util

import pytest
import torch

from kvbuffer.autotune import tuner
from kvbuffer.autotune.registry import templates
from kvbuffer.kernels import keys, specs
from kvbuffer.kernels.keys import ConvDims, GDNDims, GemvDims, KernelKey, Mamba2Dims

SHAPES = {
    "gdn": {"family": "gdn", "Hk": 2, "Hv": 4, "K": 32, "V": 32, "dtype": "bfloat16"},
    "mamba2": {"family": "mamba2", "Hk": 2, "Hv": 4, "K": 32, "V": 32, "dtype": "bfloat16"},
    "conv1d": {"family": "conv1d", "D": 64, "W": 4, "dtype": "bfloat16", "w_dtype": "float32", "bias": True},
    "gemv": {"family": "gemv", "N": 64, "K": 128, "dtype": "bfloat16"},
}
TILELANG = importlib.util.find_spec("tilelang") is not None


def test_every_key_has_one_spec_and_every_spec_a_key():
    pairs = {(family, op) for family, ops in keys._OPS.items() for op in ops}
    assert set(specs.SPECS) == pairs
    assert all(len(s.args) == len(set(s.args)) for s in specs.SPECS.values())


@pytest.mark.parametrize("family", ["gdn", "mamba2", "conv1d"])
def test_tuner_inputs_name_the_spec_arguments(family):
    """Each template's inputs are its spec's arguments, by name (Template.inputs checks the names)."""
    for tpl, chunk, drafts in tuner.plan(templates(family), SHAPES[family], (8,), (0, 2)):
        args = tpl.inputs(SHAPES[family], 3, chunk or 8, "cpu", torch.Generator().manual_seed(0), drafts)
        assert len(args) == len(tpl.args), tpl.name


@pytest.fixture
def prims(monkeypatch):
    """Compiling returns the prim function, for the local GPU an sm_90a target."""
    import kvbuffer.tiles as tiles
    from kvbuffer.kernels import specs as specs_module

    monkeypatch.setattr(tiles, "compile_template", lambda prim, target: prim)
    monkeypatch.setattr(specs_module, "local_target", lambda: {"kind": "cuda", "arch": "sm_90a"})


@pytest.mark.tilelang
@pytest.mark.skipif(not TILELANG, reason="needs TileLang")
@pytest.mark.parametrize("family", ["gdn", "mamba2", "conv1d", "gemv"])
def test_tuner_and_jit_build_the_same_function(prims, family):
    from kvbuffer.kernels import lookup

    shape = SHAPES[family]
    for tpl, chunk, drafts in tuner.plan(templates(family), SHAPES[family], (8,), (0, 2)):
        defaults = tpl.defaults_for(shape, drafts, "sm_90a")  # the arch the JIT's target names (fixture)
        tuned = tpl.compile(shape, chunk, drafts, target={}, **defaults)
        key = _key_of(tpl.name, shape, chunk, drafts)
        assert specs.tune_template(key) == tpl.name
        assert _scripts(tuned) == _scripts(lookup.jit(key).fn), tpl.name


def test_untuned_prefill_pipelines_its_state_pass_where_it_compiles():
    """The pipelined state passes (TMA loads) are the untuned default on sm_90a only, for value heads in
    whole boxes of 4, and so are Mamba-2's heads-inner output pass and both families' staged stores;
    elsewhere the defaults are the arch-free ones; the tuner's untuned build agrees."""
    gdn = KernelKey("gdn", "chunk_prefill", GDNDims(16, 32, 128, 128), "bfloat16")
    spec = specs.spec_for(gdn)
    assert spec.defaults(gdn)["states_stages"] == 0 == spec.defaults_on(gdn, "sm_80")["states_stages"]
    assert spec.defaults_on(gdn, "sm_90a") == dict(spec.defaults(gdn), states_stages=2, staged_stores=1)
    mamba2 = KernelKey("mamba2", "chunk_prefill", Mamba2Dims(8, 64, 128, 64), "bfloat16")
    m2 = specs.spec_for(mamba2)
    assert m2.defaults_on(mamba2, "sm_90a") == dict(m2.defaults(mamba2), states_stages=2, heads_inner=1,
                                                     staged_stores=1)
    assert m2.defaults_on(mamba2, "sm_86") == m2.defaults(mamba2)
    narrow = KernelKey("gdn", "chunk_prefill", GDNDims(1, 2, 128, 128), "bfloat16")  # Hv = 2: no whole decay box
    assert spec.defaults_on(narrow, "sm_90a")["states_stages"] == 0
    narrow_m2 = KernelKey("mamba2", "chunk_prefill", Mamba2Dims(1, 2, 128, 64), "bfloat16")
    assert m2.defaults_on(narrow_m2, "sm_90a") == dict(m2.defaults(narrow_m2), heads_inner=1, staged_stores=1)
    shape = {"family": "gdn", "Hk": 16, "Hv": 32, "K": 128, "V": 128, "dtype": "bfloat16"}
    tpl = next(t for t in templates("gdn") if t.name == "gdn_chunk_prefill")
    assert tpl.defaults_for(shape, 0, "sm_90a")["states_stages"] == 2
    assert tpl.defaults_for(shape, 0, "sm_86")["states_stages"] == 0


@pytest.mark.tilelang
@pytest.mark.skipif(not TILELANG, reason="needs TileLang")
def test_a_partial_build_takes_the_arch_defaults_under_what_it_names(prims):
    """build() on sm_90a (the fixture's target): given tunables over that arch's defaults, not the arch-free ones."""
    from kvbuffer.kernels import build_gdn_chunk_prefill

    assert build_gdn_chunk_prefill(2, 4, 32, 32).params["states_stages"] == 2
    assert build_gdn_chunk_prefill(2, 4, 32, 32, states_BV=16).params["states_stages"] == 2
    assert build_gdn_chunk_prefill(2, 4, 32, 32, states_stages=0).params["states_stages"] == 0
    decay_only = build_gdn_chunk_prefill(2, 4, 32, 32, delta_rule=False).params
    assert (decay_only["states_stages"], decay_only["heads_inner"]) == (2, 1)
    assert build_gdn_chunk_prefill(2, 4, 32, 32, delta_rule=False, heads_inner=0).params["heads_inner"] == 0


def _scripts(kernel):
    """A compiled (here: stubbed) kernel's script; a kernel of several launches: its parts' scripts."""
    from kvbuffer.kernels.compiled import CompiledOp

    fn = kernel.fn if isinstance(kernel, CompiledOp) else kernel
    return {part: f.script() for part, f in fn.items()} if isinstance(fn, dict) else fn.script()


@pytest.mark.tilelang
@pytest.mark.skipif(not TILELANG, reason="needs TileLang")
def test_build_functions_compile_their_spec(prims):
    from kvbuffer.kernels import build_gdn_buffered, build_mamba2_recurrent

    op = build_gdn_buffered(2, 4, 32, 32, cap=11, T_new=3, flush_at=8, BV=32, threads=64)
    key = KernelKey("gdn", "buffered", GDNDims(2, 4, 32, 32), "bfloat16", "bfloat16", cap=11, T=3, C=8)
    assert op.fn.script() == specs.spec_for(key).prim(key, {"BV": 32, "threads": 64}).script()
    assert op.params == specs.spec_for(key).launch_params(key, {"BV": 32, "threads": 64})
    op = build_mamba2_recurrent(2, 4, 32, 32, has_z=True)
    key = KernelKey("mamba2", "recurrent", Mamba2Dims(2, 4, 32, 32), "bfloat16", has_z=True)
    assert op.fn.script() == specs.spec_for(key).prim(key, {}).script() and op.params["has_z"]


def _key_of(name: str, shape, chunk: int, drafts: int):
    """The key the engine asks for that `name` builds at (chunk, drafts)."""
    family, dtype = shape["family"], shape["dtype"]
    if family == "conv1d":
        dims = ConvDims(shape["D"], shape["W"], shape["W"] + drafts)
        if name == "conv1d_accept":
            return KernelKey("conv1d", "accept", dims, dtype, T=0)
        mode, T = {"conv1d_step": ("advance", 1), "conv1d_prefill": ("advance", 0),
                   "conv1d_verify": ("verify", drafts + 1)}[name]
        return KernelKey("conv1d", mode, dims, dtype, w_dtype=shape["w_dtype"], T=T, has_bias=True)
    if family == "gemv":
        return KernelKey("gemv", "gemv", GemvDims(shape["N"], shape["K"]), dtype)
    dims = keys.linear_dims(family, shape["Hk"], shape["Hv"], shape["K"], shape["V"])
    cap = chunk + drafts + 1
    op = name.removeprefix(f"{family}_")
    if op == "chunk_prefill":
        return KernelKey(family, op, dims, "bfloat16")
    if op in ("recurrent", "recurrent_drafts"):
        return KernelKey(family, op, dims, dtype, T=drafts + 1 if op == "recurrent_drafts" else 1)
    if op == "flush":
        return KernelKey(family, "flush", dims, "", dtype, cap=cap)
    T, C = (1, chunk) if op == "buffered_step" else (drafts + 1, 0) if op == "verify" else (int(op[-1]), chunk)
    return KernelKey(family, "buffered", dims, dtype, dtype, cap=cap, T=T, C=C)


def test_prefill_artifact_tuned_before_a_tunable_existed_completes_without_the_templates(monkeypatch):
    """An artifact's tunables name both value tiles; one stored before `heads_inner` existed gets its
    default (0, the grid it was built with) and the run time imports no template for it."""
    from kvbuffer.kernels import prefill

    def no_templates(name):
        raise AssertionError(f"the run time imported {name}")

    monkeypatch.setattr(prefill.importlib, "import_module", no_templates)
    key = KernelKey("gdn", "chunk_prefill", GDNDims(16, 32, 128, 128), "bfloat16")
    stored = {"states_BV": 32, "states_stages": 2, "output_BV": 128, "threads": 128, "prep_solve": "substitution"}
    assert prefill.prefill_tunables(key, stored) == dict(stored, heads_inner=0, staged_stores=0)
