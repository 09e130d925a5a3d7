"""The short conv1d (with draft rollback) on compiled TileLang kernels: compile (`build_*`) and validated launch.

Semantics are kvbuffer.reference.conv's row functions: `conv1d_update` in mode "advance" is
`step_rows` (T = 1) / `prefill_rows` (T > 1), in mode "verify" it is `verify_rows`; `conv1d_accept`
is `accept_rows`. A launcher checks every tensor before the kernel runs (a bad call raises a typed
error and writes nothing); the pool and the activations share one dtype.
"""

from __future__ import annotations

import torch

from ..checks import check_slots, check_tensor, check_unique
from ..errors import ShapeError
from .compiled import ACT_DTYPES, CompiledOp, check_contiguous, check_on_cuda, expect_kind
from .keys import CONV_UPDATE_KINDS, ConvDims, KernelKey, check_conv_mode
from .specs import spec_for


def build_conv1d_update(D: int, W: int, span: int, T: int = 1, mode: str = "advance", *, dtype: str = "bfloat16",
                        w_dtype: str | None = None, has_bias: bool = False, silu: bool = True,
                        threads: int = 128) -> CompiledOp:
    """Compile the T-token conv update (mode "advance": decode step / prefill chunk; "verify": drafts).

    T = 0 (mode "advance" only): one kernel for any number of tokens (prompts).
    """
    check_conv_mode(mode)
    key = KernelKey("conv1d", mode, ConvDims(D, W, span), dtype, w_dtype=w_dtype or dtype, T=T, has_bias=has_bias,
                    silu=silu)
    return spec_for(key).build(key, {"threads": threads})


def build_conv1d_accept(D: int, W: int, span: int, *, dtype: str = "bfloat16", threads: int = 128) -> CompiledOp:
    """Compile the accept (shift the first m pending drafts of each row into its history)."""
    key = KernelKey("conv1d", "accept", ConvDims(D, W, span), dtype, T=0)
    return spec_for(key).build(key, {"threads": threads})


def _check_pool(op: CompiledOp, conv_state, slots, B: int, dev, checked: bool) -> None:
    p = op.params
    check_tensor("conv_state", conv_state, (None, p["D"], p["span"]), (ACT_DTYPES[p["dtype"]],), dev)
    check_contiguous("conv_state", conv_state)
    check_tensor("slots", slots, (B,), (torch.int32,), dev)
    if checked:  # these read the device back
        check_slots("slots", slots, B, conv_state.shape[0], dev)
        check_unique("slots", slots)


def conv1d_update(op: CompiledOp, x, conv_state, slots, weight, bias=None, out=None, *, checked: bool = True):
    """x (B, T, D) after each row's history -> out (B, T, D); see build_conv1d_update for the modes.

    Slot -1 = padding row: output 0, nothing written. checked=False skips the checks that read the
    device back (slot range, duplicates): for engine-built slots and CUDA-graph capture.
    """
    if not isinstance(op, CompiledOp) or op.kind not in CONV_UPDATE_KINDS.values():
        expect_kind(op, "conv_advance")
    p = op.params
    dev = x.device if isinstance(x, torch.Tensor) else None
    act = ACT_DTYPES[p["dtype"]]
    check_tensor("x", x, (None, p["T"] or None, p["D"]), (act,), dev)  # T = 0: built for any token count
    check_on_cuda("x", dev)
    B = x.shape[0]
    _check_pool(op, conv_state, slots, B, dev, checked)
    wd = ACT_DTYPES[p["w_dtype"]]
    check_tensor("weight", weight, (p["D"], p["W"]), (wd,), dev)
    if p["has_bias"]:
        check_tensor("bias", bias, (p["D"],), (wd,), dev)
        check_contiguous("bias", bias)
    elif bias is not None:
        raise ShapeError("this conv kernel was built without a bias (has_bias=False); pass bias=None")
    for name, t in (("x", x), ("weight", weight)):
        check_contiguous(name, t)
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor("out", out, tuple(x.shape), (act,), dev)
        check_contiguous("out", out)
    if B:
        op.fn(x, conv_state, slots, weight, bias_arg(op, weight, bias), out)
    return out


def bias_arg(op: CompiledOp, weight: torch.Tensor, bias):
    """The kernel's bias argument: the bias, or (built without one) a 1-element view of weight, unread."""
    return bias if op.params["has_bias"] else weight.view(-1)[:1]


def conv1d_accept(op: CompiledOp, conv_state, slots, accepted, *, checked: bool = True) -> None:
    """Each real row keeps its first accepted[b] pending drafts: history = positions m .. m+W-2."""
    expect_kind(op, "conv_accept")
    if not isinstance(slots, torch.Tensor):
        raise TypeError(f"slots must be a torch.Tensor, got {type(slots).__name__}")
    B, dev = slots.shape[0], slots.device
    check_on_cuda("slots", dev)
    _check_pool(op, conv_state, slots, B, dev, checked)
    check_tensor("accepted", accepted, (B,), (torch.int32,), dev)
    check_contiguous("accepted", accepted)
    pending = op["span"] - (op["W"] - 1)
    if checked and B and bool(((accepted < 0) | (accepted > pending)).any()):
        raise ShapeError(f"accepted counts must be in [0, {pending}], got {accepted.tolist()}")
    if B:
        op.fn(conv_state, slots, accepted)
