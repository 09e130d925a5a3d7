"""`kvbuffer tune` builds every buffer layout the engine runs: plain decoding (C + 1 entries) and
speculative decoding with T drafts (C + T + 1), verify included, and the short conv's kernels.

CPU: the plan, the mapping from the engine's kernel keys to templates and layouts, and each
template's inputs and reference against the CPU custom ops (stand-ins with the kernels' ABI).
With TileLang: a real build for an absent GPU whose verify and conv kernels load through the
runtime's lookup (kvbuffer.kernels.lookup), as they would on that GPU.
"""

import dataclasses
import importlib.util
import shutil

import pytest
import torch

from kvbuffer.autotune import tuner
from kvbuffer.autotune.models import conv_shape
from kvbuffer.autotune.registry import templates
from kvbuffer.errors import ArtifactError
from kvbuffer.kernels import launch, lookup, specs
from kvbuffer.kernels.keys import ConvDims, GDNDims, KernelKey
from kvbuffer.pools import LinearLayerShape
from kvbuffer.runtime.backend import needed_kernels, unbuffered_kernels
from kvbuffer.runtime.caches import CacheSpec
from kvbuffer.tuning import make_conv_shape, make_shape

HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None and shutil.which("nvcc") is not None
SMALL = {"gdn": make_shape("gdn", 2, 4, 32, 32), "mamba2": make_shape("mamba2", 2, 4, 32, 32)}


def test_plan_builds_every_layout_once():
    items = tuner.plan(templates("gdn"), SMALL["gdn"], (8, 16), (0, 2, 4))
    got = {(t.name, c, d) for t, c, d in items}
    assert len(got) == len(items)
    assert ("gdn_recurrent", 0, 0) in got and not any(n == "gdn_recurrent" and d for n, _, d in got)
    assert {(c, d) for n, c, d in got if n == "gdn_verify"} == {(8, 2), (8, 4), (16, 2), (16, 4)}
    assert {(c, d) for n, c, d in got if n == "gdn_prefill_chunk8"} == {(8, 0), (8, 2), (8, 4), (16, 0), (16, 2), (16, 4)}
    conv = {(t.name, c, d) for t, c, d in tuner.plan(templates("conv1d"), conv_shape(SMALL["gdn"]), (8, 16), (0, 4))}
    assert conv == {("conv1d_step", 0, 0), ("conv1d_step", 0, 4), ("conv1d_prefill", 0, 0), ("conv1d_prefill", 0, 4),
                    ("conv1d_verify", 0, 4), ("conv1d_accept", 0, 4)}


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
@pytest.mark.parametrize("drafts", [0, 4])
def test_every_kernel_the_engine_needs_is_in_the_plan(family, drafts):
    s = SMALL[family]
    shape = LinearLayerShape(s["Hk"], s["Hv"], s["K"], s["V"], delta_rule=family == "gdn")
    spec = CacheSpec(shape, 2, 8, 4, 1, 2, 16, 8, 8, 64, 16, max_drafts=drafts + 1)
    planned = {(t.name, c, d) for t, c, d in tuner.plan(templates(family), s, (16,), (0, drafts))}
    unbuffered = unbuffered_kernels(spec, torch.bfloat16)  # what a one-row kvbuffer step launches
    for mode in ("kvbuffer", "recurrent"):
        for key in needed_kernels(spec, torch.bfloat16, mode) + unbuffered:
            name = specs.tune_template(key)
            assert name is not None, key
            layouts = [(c or 0, d) for c, d in specs.layouts(key)]
            assert any((name, c, d) in planned for c, d in layouts), (key, name, layouts)


@pytest.mark.parametrize("drafts", [0, 3])
def test_every_conv_kernel_the_engine_needs_maps_to_a_template(drafts):
    D, W = 8, 4
    state = torch.zeros(3, D, W + drafts)
    weight = torch.zeros(D, W)
    keys = [launch.conv_update_key("advance", torch.zeros(2, 1, D), state, weight, None, True),
            launch.conv_update_key("advance", torch.zeros(2, 7, D), state, weight, None, True)]
    if drafts:
        keys += [launch.conv_update_key("verify", torch.zeros(2, drafts + 1, D), state, weight, None, True),
                 launch.conv_accept_key(state, W)]
    names = [(specs.tune_template(k), specs.layouts(k)[0][1]) for k in keys]
    assert names == [(n, drafts) for n in ("conv1d_step", "conv1d_prefill", "conv1d_verify", "conv1d_accept")[:len(keys)]]
    short = launch.conv_update_key("verify", torch.zeros(2, 2, D), torch.zeros(3, D, W + 3), weight, None, True)
    assert specs.tune_template(short) is None  # tune builds the verify of all T drafts + 1 only


# ----------------------------------------------------------------------------------------------
# each template's inputs and reference, against the CPU custom ops in the kernels' ABI


def _linear_standin(family: str, name: str, chunk: int):
    """The kernel's ABI on torch.ops.kvbuffer: (front..., state, ..., lengths, out)."""
    flush_at = 0 if name.endswith("verify") else chunk
    if name.endswith("flush"):
        return lambda *a: getattr(torch.ops.kvbuffer, f"{family}_flush")(*a)
    if name.endswith("recurrent_drafts"):
        return _drafts_standin(family)
    if name.endswith("chunk_prefill"):  # (tokens..., cu_seqlens, state, state_slots, out)
        return lambda *a: a[-1].copy_(getattr(torch.ops.kvbuffer, name)(*a[:-1]))

    def run(*a):
        if family == "gdn":
            a[14].copy_(torch.ops.kvbuffer.gdn_verify(*a[:14], flush_at))
        else:  # x, dt, A_log, dt_bias, B, C, D, z (unused), pools..., y
            a[15].copy_(torch.ops.kvbuffer.mamba2_verify(*a[:7], *a[8:15], flush_at))
    return run


def _drafts_standin(family: str):
    """(front..., state, state_slots, draft_states, draft_rows, out) on the recurrent verify's op."""
    def run(*a):
        if family == "gdn":
            a[11].copy_(torch.ops.kvbuffer.gdn_recurrent_drafts(*a[:11]))
        else:  # x, dt, A_log, dt_bias, B, C, D, z (unused), pools..., y
            a[12].copy_(torch.ops.kvbuffer.mamba2_recurrent_drafts(*a[:7], *a[8:12]))
    return run


def _conv_standin(name: str, shape):
    if name == "conv1d_accept":
        return lambda state, slots, accepted: torch.ops.kvbuffer.conv1d_accept(state, slots, accepted, shape["W"])
    kind = "verify" if name == "conv1d_verify" else "advance"

    def run(x, state, slots, weight, bias, out):
        out.copy_(torch.ops.kvbuffer.conv1d_update(x, state, slots, weight, bias if shape["bias"] else None, kind))
    return run


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_linear_templates_inputs_and_references_agree_with_the_ops(family):
    shape = SMALL[family]
    for tpl, chunk, drafts in tuner.plan(templates(family), shape, (8,), (0, 3)):
        if tpl.name.endswith("recurrent"):
            continue
        if tpl.launch is not None:  # the chunked prefill: its launcher needs CUDA, the stand-in takes the args
            tpl = dataclasses.replace(tpl, launch=None)
        err = tuner.check(tpl, _linear_standin(family, tpl.name, chunk), shape, chunk, "cpu", drafts=drafts)
        assert err < (1e-2 if tpl.name.endswith("chunk_prefill") else 1e-5), (tpl.name, chunk, drafts, err)  # bf16 o


@pytest.mark.parametrize("bias", [False, True])
def test_conv_templates_inputs_and_references_agree_with_the_ops(bias):
    shape = conv_shape(SMALL["mamba2"], bias=bias)
    for tpl, chunk, drafts in tuner.plan(templates("conv1d"), shape, (8,), (0, 3)):
        err = tuner.check(tpl, _conv_standin(tpl.name, shape), shape, chunk, "cpu", drafts=drafts)
        assert err < 1e-6, (tpl.name, drafts, err)


def test_conv_shape_counts_the_convolved_channels():
    assert conv_shape(make_shape("gdn", 16, 32, 128, 128))["D"] == 8192  # Qwen3.5-9B's conv_dim
    nano = conv_shape(make_shape("mamba2", 8, 64, 128, 64))
    assert (nano["D"], nano["bias"]) == (64 * 64 + 2 * 8 * 128, True)  # Nemotron-Nano's, with bias


# ----------------------------------------------------------------------------------------------
# a real build, loaded through the runtime's lookup


@pytest.mark.tilelang
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TILELANG, reason="needs TileLang and nvcc to compile")
def test_speculative_and_conv_artifacts_load_through_the_ops(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this test builds for a GPU that is not present")
    from click.testing import CliRunner

    from kvbuffer import gpus
    from kvbuffer.cli.main import main

    args = ["tune", "--gpu", "h100", "--heads", "2,4,32,32", "--kernels", "gdn_verify,conv1d_accept",
            "--chunk-sizes", "8", "--draft-tokens", "2", "--batch-buckets", "1", "--cache-dir", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "drafts [2]" in result.output and "conv1d D=256 W=4" in result.output

    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gpus, "detect_local_gpu", lambda device=0: gpus.get_gpu("h100"))
    monkeypatch.setattr(lookup, "jit_allowed", lambda: False)
    lookup.clear_kernels()
    try:
        verify = KernelKey("gdn", "buffered", GDNDims(2, 4, 32, 32), "bfloat16", "bfloat16", cap=11, T=3, C=0)
        op = lookup.kernel_for(verify, 5)
        assert (op.kind, op["cap"], op["T_new"], op["flush_at"]) == ("buffered", 11, 3, 0)
        accept = KernelKey("conv1d", "accept", ConvDims(256, 4, 6), "bfloat16", T=0)
        assert lookup.kernel_for(accept, 5).kind == "conv_accept"
        step = KernelKey("gdn", "buffered", GDNDims(2, 4, 32, 32), "bfloat16", "bfloat16", cap=11, T=1, C=8)
        with pytest.raises(ArtifactError, match="--draft-tokens 2"):
            lookup.kernel_for(step, 5)  # not built: --kernels left it out
    finally:
        lookup.clear_kernels()


# ----------------------------------------------------------------------------------------------
# records, keys and lookups by layout


def _record(winners, policy="untuned", buckets=(1, 64), chunks=(16,), drafts=(0,)):
    from kvbuffer.autotune.policy import Winner
    from kvbuffer.tuning import ChunkPolicy

    p = ChunkPolicy(tuple(buckets), (chunks[0],) * len(buckets), policy)
    rows = [Winner(k, b, c, f"{k}-c{c}-d{d}-{'m' if us else 'u'}", {}, us, d).to_json()
            for k, c, d, us in winners for b in buckets]
    return {"status": "untuned", "chunk_policy": p.to_json(), "batch_buckets": list(buckets),
            "chunk_sizes": list(chunks), "draft_tokens": sorted(set(drafts) | {0}), "winners": rows}


def test_select_picks_the_layout_and_names_the_missing_one():
    from kvbuffer.tuning import select

    record = _record([("gdn_buffered_step", 16, 0, None), ("gdn_buffered_step", 16, 4, None),
                      ("gdn_verify", 16, 4, None)], drafts=(4,))
    assert select(record, "gdn_buffered_step", 3, 16)[0] == "gdn_buffered_step-c16-d0-u"
    assert select(record, "gdn_buffered_step", 3, 16, 4)[0] == "gdn_buffered_step-c16-d4-u"
    with pytest.raises(KeyError, match=r"2 speculative drafts.*drafts built: \[4\]; add --draft-tokens 2"):
        select(record, "gdn_verify", 3, 16, 2)
    old = _record([("gdn_flush", 16, 0, None)])
    for w in old["winners"]:
        del w["drafts"]  # a record written before layouts existed still reads as plain decoding
    assert select(old, "gdn_flush", 70, 16)[0] == "gdn_flush-c16-d0-u"


def test_plain_layout_keys_keep_their_names():
    from kvbuffer.artifacts import ArtifactKey

    args = ("h200", "sm_90a", "gdn_flush", {"family": "gdn"}, 16, {"BV": 32}, {"kvbuffer": "x"}, "src")
    plain, spec = ArtifactKey(*args), ArtifactKey(*args, drafts=4)
    assert "drafts" not in plain.to_json() and spec.to_json()["drafts"] == 4
    assert "_d4_" in spec.name and "_d" not in plain.name.split("_c16")[1].split("-")[0]
    assert ArtifactKey.from_json(plain.to_json()) == plain and ArtifactKey.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("op, T, C, cap, want", [
    ("recurrent", 1, 0, 0, [(None, 0)]),
    ("buffered", 1, 16, 17, [(16, 0)]),       # decode step, plain decoding
    ("buffered", 1, 16, 21, [(16, 4)]),       # decode step, 4 drafts
    ("buffered", 8, 16, 21, [(16, 4)]),       # prefill chunk, 4 drafts
    ("buffered", 5, 0, 21, [(16, 4)]),        # verify of 4 drafts + the last token
    ("buffered", 1, 16, 16, []),              # no room for the step's own entry: tune builds no such kernel
    ("flush", 1, 0, 5, [(4, 0), (3, 1), (2, 2), (1, 3)]),
])
def test_kernel_keys_map_back_to_layouts(op, T, C, cap, want):
    key = KernelKey("gdn", op, GDNDims(2, 4, 32, 32), "bfloat16", "bfloat16", cap=cap, T=T, C=C)
    assert specs.layouts(key) == want
    assert (specs.tune_template(key) is None) == (not want)


def test_records_merge_run_by_run():
    from kvbuffer.autotune.policy import merge_records

    tuned = _record([("gdn_buffered_step", 16, 0, 5.0)], policy="tuned")
    spec = _record([("gdn_buffered_step", 16, 0, None), ("gdn_verify", 16, 4, None)], drafts=(4,))
    merged, notes = merge_records(tuned, spec)
    kinds = {(w["kernel"], w["drafts"], w["median_us"]) for w in merged["winners"]}
    assert kinds == {("gdn_buffered_step", 0, 5.0), ("gdn_verify", 4, None)}  # the measurement survives
    assert merged["chunk_policy"]["status"] == "tuned" and merged["draft_tokens"] == [0, 4]
    assert merged["status"] == "untuned" and "kept 2 measured" in notes[0]
    again, _ = merge_records(merged, _record([("gdn_verify", 16, 4, 7.0)], policy="tuned", drafts=(4,)))
    assert again["status"] == "tuned" and len(again["winners"]) == 4
    other, notes = merge_records(merged, _record([("gdn_flush", 16, 0, None)], buckets=(1, 256)))
    assert [w["kernel"] for w in other["winners"]] == ["gdn_flush"] * 2 and "replaced" in notes[0]


def test_a_build_with_nothing_to_build_is_a_usage_error(tmp_path):
    from click.testing import CliRunner

    from kvbuffer.cli.main import main

    result = CliRunner().invoke(main, ["tune", "--gpu", "h100", "--heads", "2,4,32,32", "--kernels", "gdn_verify",
                                       "--cache-dir", str(tmp_path)])
    assert result.exit_code != 0 and "needs --draft-tokens" in result.output
    assert not (tmp_path / "tunings").exists()  # and no empty record overwrote anything


def test_the_conv_accept_is_found_in_a_record_of_any_weight_dtype_and_bias():
    key = KernelKey("conv1d", "accept", ConvDims(256, 4, 8), "bfloat16", T=0)
    shapes = specs.record_shapes(key)
    assert {(s["w_dtype"], s["bias"]) for s in shapes} == {(w, b) for w in ("bfloat16", "float16", "float32")
                                                          for b in (False, True)}
    update = KernelKey("conv1d", "advance", ConvDims(256, 4, 8), "bfloat16", w_dtype="float32", has_bias=True)
    assert specs.record_shapes(update) == [make_conv_shape(256, 4, "bfloat16", "float32", True)]


def test_a_measured_record_without_a_policy_kernel_is_tuned():
    from kvbuffer.autotune.policy import merge_records

    conv, _ = merge_records(None, _record([("conv1d_step", 0, 0, 3.0), ("conv1d_verify", 0, 4, 4.0)], drafts=(4,)))
    assert conv["status"] == "tuned"  # no kernel of it decides C, so its untuned policy does not matter
    gdn, _ = merge_records(None, _record([("gdn_buffered_step", 16, 0, 3.0)]))
    assert gdn["status"] == "untuned"  # measured winners, but the chunk size was not chosen by measurement


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_untuned_defaults_fit_small_value_heads(family):
    """A tiny model's value heads (V = 16) are narrower than the templates' measured-best value tile:
    every template's untuned defaults (what `tune --build-only` and the first-use build compile) narrow
    BV to V, as the JIT's tunables do."""
    from kvbuffer.autotune.registry import gdn_templates, mamba2_templates

    shape = {"family": family, "Hk": 2, "Hv": 4, "K": 16, "V": 16, "dtype": "bfloat16"}
    for tpl in gdn_templates() if family == "gdn" else mamba2_templates():
        tiles = {n: v for n, v in tpl.defaults_for(shape).items() if n.endswith("BV")}
        assert tiles and max(tiles.values()) <= 16, tpl.name


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
@pytest.mark.parametrize("batch", [1, 4, 64])
def test_tuned_inputs_rotate_past_twice_the_l2(family, batch):
    """Every bucket is timed on inputs spanning more than twice the L2: at one row a state is ~2 MB, so a
    short rotation would time L2 hits and pick small-batch winners by them."""
    shape = make_shape("gdn", 16, 32, 128, 128) if family == "gdn" else make_shape("mamba2", 8, 64, 128, 64)
    tpl = next(t for t in templates(family) if t.name.endswith("_recurrent"))
    args = tpl.inputs(shape, batch, 16, "cpu", torch.Generator().manual_seed(0), 0)
    nbytes = sum(a.numel() * a.element_size() for a in args if hasattr(a, "element_size"))
    l2 = 60 * 2**20
    assert tuner.rotation(args, l2) * nbytes > 2 * l2


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_plan_leaves_out_a_chunked_prefill_the_head_dims_do_not_suit(family):
    """Head dims of 16 (the tiny presets') are below what the chunked prefill tiles: neither `tune` nor
    the first-use build tries to compile it (prompts run as verify chunks there)."""
    names = lambda shape: {t.name for t, _, _ in tuner.plan(templates(family), shape, (8,), (0,))}  # noqa: E731
    assert f"{family}_chunk_prefill" in names(make_shape(family, 2, 4, 32, 32))
    assert f"{family}_chunk_prefill" not in names(make_shape(family, 2, 4, 16, 16))
