"""`kvbuffer tune` builds every buffer layout the engine runs: plain decoding (C + 1 entries) and
speculative decoding with T drafts (C + T + 1), verify included, and the short conv's kernels.

CPU: the plan, the mapping from the engine's kernel keys to templates and layouts, and each
template's inputs and reference against the CPU custom ops (stand-ins with the kernels' ABI).
With TileLang: a real build for an absent GPU whose verify and conv kernels load through the
runtime's lookup (kvbuffer.ops / kvbuffer.conv_ops), as they would on that GPU.
"""

import importlib.util
import shutil

import pytest
import torch

import kvbuffer.conv_ops  # noqa: F401  (registers torch.ops.kvbuffer.conv1d_*)
from kvbuffer import conv_ops, ops
from kvbuffer.autotune import tuner
from kvbuffer.autotune.models import conv_shape, make_shape
from kvbuffer.autotune.registry import templates
from kvbuffer.pools import LinearLayerShape
from kvbuffer.runtime.caches import CacheSpec
from kvbuffer.runtime.kernel_ops import needed_kernels

HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None and shutil.which("nvcc") is not None
SMALL = {"gdn": make_shape("gdn", 2, 4, 32, 32), "mamba2": make_shape("mamba2", 2, 4, 32, 16)}


def test_plan_builds_every_layout_once():
    items = tuner.plan(templates("gdn"), (8, 16), (0, 2, 4))
    got = {(t.name, c, d) for t, c, d in items}
    assert len(got) == len(items)
    assert ("gdn_recurrent", 0, 0) in got and not any(n == "gdn_recurrent" and d for n, _, d in got)
    assert {(c, d) for n, c, d in got if n == "gdn_verify"} == {(8, 2), (8, 4), (16, 2), (16, 4)}
    assert {(c, d) for n, c, d in got if n == "gdn_prefill_chunk8"} == {(8, 0), (8, 2), (8, 4), (16, 0), (16, 2), (16, 4)}
    conv = {(t.name, c, d) for t, c, d in tuner.plan(templates("conv1d"), (8, 16), (0, 4))}
    assert conv == {("conv1d_step", 0, 0), ("conv1d_step", 0, 4), ("conv1d_prefill", 0, 0), ("conv1d_prefill", 0, 4),
                    ("conv1d_verify", 0, 4), ("conv1d_accept", 0, 4)}


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
@pytest.mark.parametrize("drafts", [0, 4])
def test_every_kernel_the_engine_needs_is_in_the_plan(family, drafts):
    s = SMALL[family]
    shape = LinearLayerShape(s["Hk"], s["Hv"], s["K"], s["V"], delta_rule=family == "gdn")
    spec = CacheSpec(shape, 2, 8, 4, 1, 2, 16, 8, 8, 64, 16, max_drafts=drafts + 1)
    planned = {(t.name, c, d) for t, c, d in tuner.plan(templates(family), (16,), (0, drafts))}
    for mode in ("kvbuffer", "recurrent"):
        for key in needed_kernels(spec, torch.bfloat16, mode):
            name = ops._template(key)
            assert name is not None, key
            layouts = [(c or 0, d) for c, d in key.layouts()]
            assert any((name, c, d) in planned for c, d in layouts), (key, name, layouts)


@pytest.mark.parametrize("drafts", [0, 3])
def test_every_conv_kernel_the_engine_needs_maps_to_a_template(drafts):
    D, W = 8, 4
    state = torch.zeros(3, D, W + drafts)
    weight = torch.zeros(D, W)
    keys = [conv_ops.update_key("advance", torch.zeros(2, 1, D), state, weight, None, True),
            conv_ops.update_key("advance", torch.zeros(2, 7, D), state, weight, None, True)]
    if drafts:
        keys += [conv_ops.update_key("verify", torch.zeros(2, drafts + 1, D), state, weight, None, True),
                 conv_ops.accept_key(state, W)]
    names = [conv_ops._template(k) for k in keys]
    assert names == [(n, drafts) for n in ("conv1d_step", "conv1d_prefill", "conv1d_verify", "conv1d_accept")[:len(keys)]]
    short = conv_ops.update_key("verify", torch.zeros(2, 2, D), torch.zeros(3, D, W + 3), weight, None, True)
    assert conv_ops._template(short)[0] is None  # tune builds the verify of all T drafts + 1 only


# ----------------------------------------------------------------------------------------------
# each template's inputs and reference, against the CPU custom ops in the kernels' ABI


def _linear_standin(family: str, name: str, chunk: int):
    """The kernel's ABI on torch.ops.kvbuffer: (front..., state, ..., lengths, out)."""
    flush_at = 0 if name.endswith("verify") else chunk
    if name.endswith("flush"):
        return lambda *a: getattr(torch.ops.kvbuffer, f"{family}_flush")(*a)

    def run(*a):
        if family == "gdn":
            a[14].copy_(torch.ops.kvbuffer.gdn_verify(*a[:14], flush_at))
        else:  # x, dt, A_log, dt_bias, B, C, D, z (unused), pools..., y
            a[15].copy_(torch.ops.kvbuffer.mamba2_verify(*a[:7], *a[8:15], flush_at))
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
    for tpl, chunk, drafts in tuner.plan(templates(family), (8,), (0, 3)):
        if tpl.name.endswith("recurrent"):
            continue
        err = tuner.check(tpl, _linear_standin(family, tpl.name, chunk), shape, chunk, "cpu", drafts=drafts)
        assert err < 1e-5, (tpl.name, chunk, drafts, err)


@pytest.mark.parametrize("bias", [False, True])
def test_conv_templates_inputs_and_references_agree_with_the_ops(bias):
    shape = conv_shape(SMALL["mamba2"], bias=bias)
    for tpl, chunk, drafts in tuner.plan(templates("conv1d"), (8,), (0, 3)):
        err = tuner.check(tpl, _conv_standin(tpl.name, shape), shape, chunk, "cpu", drafts=drafts)
        assert err < 1e-6, (tpl.name, drafts, err)


def test_conv_shape_counts_the_convolved_channels():
    assert conv_shape(make_shape("gdn", 16, 32, 128, 128))["D"] == 8192  # Qwen3.5-9B's conv_dim
    nano = conv_shape(make_shape("mamba2", 8, 64, 128, 64))
    assert (nano["D"], nano["bias"]) == (64 * 64 + 2 * 8 * 128, True)  # Nemotron-Nano's, with bias


# ----------------------------------------------------------------------------------------------
# a real build, loaded through the runtime's lookup


@pytest.mark.tilelang
@pytest.mark.skipif(not HAVE_TILELANG, reason="needs TileLang and nvcc to compile")
def test_speculative_and_conv_artifacts_load_through_the_ops(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this test builds for a GPU that is not present")
    from click.testing import CliRunner

    from kvbuffer.autotune import gpus
    from kvbuffer.cli.main import main

    args = ["tune", "--gpu", "h100", "--heads", "2,4,32,32", "--kernels", "gdn_verify,conv1d_accept",
            "--chunk-sizes", "8", "--draft-tokens", "2", "--batch-buckets", "1", "--cache-dir", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "drafts [2]" in result.output and "conv1d D=256 W=4" in result.output

    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gpus, "detect_local_gpu", lambda device=0: gpus.get_gpu("h100"))
    monkeypatch.setattr(ops, "jit_allowed", lambda: False)
    ops.clear_kernels()
    conv_ops.clear_kernels()
    try:
        verify = ops.KernelKey("gdn", "buffered", 2, 4, 32, 32, "bfloat16", "bfloat16", cap=11, T=3, C=0)
        op = ops.kernel_for(verify, 5)
        assert (op.kind, op["cap"], op["T_new"], op["flush_at"]) == ("buffered", 11, 3, 0)
        accept = conv_ops.ConvKey("accept", 256, 4, 6, 0, "bfloat16")
        assert conv_ops.kernel_for(accept, 5).kind == "conv_accept"
        step = ops.KernelKey("gdn", "buffered", 2, 4, 32, 32, "bfloat16", "bfloat16", cap=11, T=1, C=8)
        with pytest.raises(ops.ArtifactError, match="--draft-tokens 2"):
            ops.kernel_for(step, 5)  # not built: --kernels left it out
    finally:
        ops.clear_kernels()
        conv_ops.clear_kernels()
