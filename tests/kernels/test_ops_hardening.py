"""Bad arguments to every `torch.ops.kvbuffer.*` op (and the reference functions they expose) are a
typed error naming the argument, written before anything is: mixed devices (a `meta` slots or
lengths tensor must not reach the shape-only fake), parameters of the wrong size (a (1,) A_log or
bias used to broadcast silently), T = 0, an empty conv batch, a conv width its state cannot hold,
and pool tensors that alias themselves (stride 0) or each other."""

import random

import pytest
import torch

from kvbuffer.errors import BufferOverflowError, DeviceError, ShapeError
from tests.support.op_calls import OPS, call_op, call_reference, cloned, snapshot, unchanged, valid_call


def make(name: str, seed: int = 0, **want) -> dict:
    """A valid call of `name` whose arguments include `want` (e.g. kind="verify")."""
    for s in range(seed, seed + 500):
        call = valid_call(name, random.Random(s), torch.Generator().manual_seed(s))
        if all(call.get(k) == v for k, v in want.items()):
            return call
    raise AssertionError(f"no valid {name} call with {want}")


def rejected(name, call, error, match):
    before = snapshot(call)
    with pytest.raises(error, match=match):
        call_op(name, call)
    assert unchanged(before, call), "a rejected call wrote into a pool"


def to_meta(t):
    return t.to("meta")


def expanded(t):
    return t[:1].expand_as(t)


# (op, argument, how it is spoilt, error, message): each was silently accepted or a raw torch error
CASES = [
    *[(op, "state_slots", to_meta, DeviceError, "state_slots is on meta") for op in OPS if "conv" not in op],
    *[(op, "lengths", to_meta, DeviceError, "lengths is on meta") for op in OPS if "conv" not in op
      and "recurrent" not in op],
    ("conv1d_update", "slots", to_meta, DeviceError, "slots is on meta"),
    ("conv1d_accept", "slots", to_meta, DeviceError, "slots is on meta"),
    ("conv1d_accept", "accepted", to_meta, DeviceError, "accepted is on meta"),
    *[(op, "A_log", lambda t: t[:1], ShapeError, "A_log must have shape") for op in OPS
      if "flush" not in op and "conv" not in op],
    *[(op, "dt_bias", lambda t: torch.cat([t, t]), ShapeError, "dt_bias must have shape") for op in OPS
      if "flush" not in op and "conv" not in op],
    *[(op, "a", lambda t: t[..., :1], ShapeError, "a must have shape") for op in OPS if op.startswith("gdn")
      and "flush" not in op],
    *[(op, "D", lambda t: t[:1], ShapeError, "D must have shape") for op in OPS if op.startswith("mamba2")
      and "flush" not in op],
    *[(op, "z", lambda t: t[..., :1], ShapeError, "z must have shape") for op in OPS if op.startswith("mamba2")
      and "flush" not in op],
    ("conv1d_update", "bias", lambda t: t[:1], ShapeError, "bias must have shape"),
    *[(op, pool, expanded, ShapeError, f"{pool} has overlapping memory") for op in OPS if "conv" not in op
      for pool in ("state", "buf_k", "buf_v", "buf_g") if "recurrent" not in op or pool == "state"],
    ("conv1d_update", "conv_state", expanded, ShapeError, "conv_state has overlapping memory"),
    ("conv1d_accept", "conv_state", expanded, ShapeError, "conv_state has overlapping memory"),
]


@pytest.mark.parametrize("name,arg,spoil,error,match", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[4].split()[-1]}" for c in CASES])
def test_a_bad_argument_is_a_typed_error_and_writes_nothing(name, arg, spoil, error, match):
    for seed in range(500):
        call = valid_call(name, random.Random(seed), torch.Generator().manual_seed(seed))
        t = call.get(arg)
        pools_big = all(call[p].shape[0] > 1 for p in ("state", "buf_k", "conv_state") if p in call)
        if isinstance(t, torch.Tensor) and (spoil is not expanded or pools_big) and t.numel() \
                and (spoil(t).shape != t.shape or spoil in (to_meta, expanded)):
            break
    call[arg] = spoil(call[arg])
    rejected(name, call, error, match)


@pytest.mark.parametrize("gap", [-1, 0], ids=["overlapping", "adjacent"])
def test_two_pools_sharing_memory_are_refused(gap):
    call = make("gdn_verify")
    nk, nv = call["buf_k"].numel(), call["buf_v"].numel()
    memory = torch.randn(nk + nv)
    call["buf_k"] = memory[:nk].view(call["buf_k"].shape)
    call["buf_v"] = memory[nk + gap: nk + gap + nv].view(call["buf_v"].shape) if gap else memory[nk:].view(
        call["buf_v"].shape)
    if gap:
        rejected("gdn_verify", call, ShapeError, "buf_v and buf_k share memory")
    else:  # two halves of one allocation are fine
        call_op("gdn_verify", call)


@pytest.mark.parametrize("name", ["gdn_verify", "mamba2_verify", "gdn_recurrent_drafts", "mamba2_recurrent_drafts"])
def test_a_verify_of_zero_tokens_is_a_shape_error(name):
    call = make(name)
    for k in ("q", "k", "v", "a", "b", "x", "dt", "B", "C", "z"):
        if isinstance(call.get(k), torch.Tensor):
            call[k] = call[k][:, :0]
    rejected(name, call, ShapeError, "at least one token")


@pytest.mark.parametrize("kind", ["advance", "verify"])
def test_a_conv_of_an_empty_batch_returns_an_empty_output(kind):
    for seed in range(500):
        call = make("conv1d_update", seed)
        if call["kind"] == kind:
            break
    call["x"], call["slots"] = call["x"][:0], call["slots"][:0]
    before = snapshot(call)
    out = call_op("conv1d_update", call)
    assert out.shape == call["x"].shape and unchanged(before, call)


@pytest.mark.parametrize("W", [9, 0])
def test_a_conv_width_its_state_cannot_hold_is_refused(W):
    call = make("conv1d_update")
    call["weight"] = torch.randn(call["weight"].shape[0], W)
    rejected("conv1d_update", call, ShapeError, "width" if W == 0 else "W=9")


@pytest.mark.parametrize("width,error,match", [(0, ShapeError, ">= 1"), (99, ShapeError, "W=99"),
                                               (2.0, TypeError, "width must be an int")])
def test_conv_accept_width_out_of_range(width, error, match):
    call = make("conv1d_accept")
    call["width"] = width
    before = snapshot(call)
    with pytest.raises((error, RuntimeError), match=match):
        call_op("conv1d_accept", call) if not isinstance(width, float) else call_reference("conv1d_accept", call)
    assert unchanged(before, call)


def test_too_many_conv_drafts_stay_a_buffer_overflow():
    call = make("conv1d_update", kind="verify")
    span = call["conv_state"].shape[2]
    call["x"] = torch.randn(call["x"].shape[0], span + 1, call["x"].shape[2])
    rejected("conv1d_update", call, BufferOverflowError, "do not fit")


@pytest.mark.parametrize("name", OPS)
def test_every_tensor_on_meta_gives_the_output_shape(name):
    call = make(name)
    out = call_op(name, call)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    out_meta = call_op(name, meta)
    if out is None:
        assert out_meta is None
    else:
        assert out_meta.device.type == "meta" and out_meta.shape == out.shape and out_meta.dtype == out.dtype


@pytest.mark.parametrize("name", OPS)
def test_the_ops_equal_the_reference_they_expose(name):
    call = make(name, seed=3)
    ref_call = cloned(call)
    out, ref = call_op(name, call), call_reference(name, ref_call)
    if out is not None:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert unchanged(snapshot(ref_call), call)
