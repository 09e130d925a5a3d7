"""The short conv1d as torch custom ops (`torch.ops.kvbuffer.conv1d_*`), for the engine and CUDA graphs.

    torch.ops.kvbuffer.conv1d_update(x, conv_state, slots, weight, bias=None, kind="advance", silu=True) -> out
    torch.ops.kvbuffer.conv1d_accept(conv_state, slots, accepted, width)

Semantics are kvbuffer.reference.conv's: x (B, T, D) after each row's history in conv_state
(NS, D, W - 1 + max_drafts); kind (the mode; torch reserves the name `mode`) "advance" makes the
last W - 1 inputs the history (T = 1: the decode step, T > 1: a prompt), "verify" stores the T
drafts as pending (history untouched); conv1d_accept keeps the first accepted[b] drafts of each row.
Slot -1 = padding row (output 0, nothing written). Both declare that they mutate conv_state.

CPU: the reference (with its checks). CUDA: a compiled kernel (tiles/conv1d.py) per (kind, D, W,
span, T, dtypes, bias, silu); advance with T > 1 uses one kernel for every prompt length. `kvbuffer
tune` builds no conv artifacts yet, so the kernels come from a JIT compile (`KVBUFFER_JIT=1` /
kvbuffer.ops.allow_jit()); without it a CUDA call raises ArtifactError (the engine then keeps the
reference conv, see kvbuffer.runtime.kernel_ops.conv_update). CUDA tensors: contiguous; x, conv_state
and out share one dtype (bf16, fp16 or fp32); weight and bias share one; slots and accepted int32.
Under kvbuffer.ops.unchecked() or CUDA-graph capture the launch skips the checks that read the
device back (slot range, duplicates, accepted range).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from . import ops
from .errors import ArtifactError, DTypeError, ShapeError
from .reference import conv as ref_conv

log = logging.getLogger(__name__)

_KERNELS: dict = {}  # ConvKey -> kvbuffer.kernels.CompiledOp (batch and pool size are dynamic)


@dataclass(frozen=True)
class ConvKey:
    """What one compiled conv kernel is specialised for."""

    kind: str          # "advance" | "verify" | "accept"
    D: int             # channels
    W: int             # kernel width
    span: int          # pool positions per channel, W - 1 + max_drafts
    T: int = 1         # tokens per row (0: any count, advance only; accept: unused, 0)
    dtype: str = "bfloat16"   # activations and pool
    w_dtype: str = ""         # weight and bias ("" for accept)
    has_bias: bool = False
    silu: bool = True


def update_key(mode: str, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias, silu: bool) -> ConvKey:
    """The kernel a conv1d_update call needs: advance with T > 1 is the any-length kernel (T = 0)."""
    T = x.shape[1]
    if mode == "advance" and T > 1:
        T = 0
    return ConvKey(mode, conv_state.shape[1], weight.shape[1], conv_state.shape[2], T, ops._dtype(x),
                   ops._dtype(weight), bias is not None, bool(silu))


def accept_key(conv_state: torch.Tensor, width: int) -> ConvKey:
    return ConvKey("accept", conv_state.shape[1], int(width), conv_state.shape[2], 0, ops._dtype(conv_state))


def kernel_for(key: ConvKey):
    """The compiled kernel for `key`: compiled once with TileLang when JIT is allowed, else ArtifactError."""
    op = _KERNELS.get(key)
    if op is None:
        if not ops.jit_allowed():
            raise ArtifactError(f"no compiled conv1d kernel for {key}: `kvbuffer tune` builds no conv kernels "
                                "yet; set KVBUFFER_JIT=1 / call kvbuffer.ops.allow_jit() to compile it with TileLang")
        log.info("kvbuffer.conv_ops: compiling %s with TileLang", key)
        op = _KERNELS[key] = jit(key)
    return op


def jit(key: ConvKey):
    from . import kernels

    if key.kind == "accept":
        return kernels.build_conv1d_accept(key.D, key.W, key.span, dtype=key.dtype)
    return kernels.build_conv1d_update(key.D, key.W, key.span, key.T, key.kind, dtype=key.dtype,
                                       w_dtype=key.w_dtype, has_bias=key.has_bias, silu=key.silu)


def clear_kernels() -> None:
    _KERNELS.clear()


def _check_mode(mode: str) -> None:
    if mode not in ("advance", "verify"):
        raise ValueError(f"mode must be 'advance' or 'verify', got {mode!r}")


@torch.library.custom_op("kvbuffer::conv1d_update", mutates_args=("conv_state",), device_types="cpu")
def conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor] = None, kind: str = "advance", silu: bool = True) -> torch.Tensor:
    """reference.conv verify_rows / step_rows / prefill_rows (with the reference's checks): x (B, T, D) -> (B, T, D).

    kind: "advance" or "verify" (the mode; torch's auto-functionalization reserves the name `mode`).
    """
    mode = kind
    _check_mode(mode)
    _, _, W, span = ref_conv._check(x, conv_state, slots, weight, with_time=True)
    act = "silu" if silu else None
    if mode == "verify":
        if W - 1 + x.shape[1] > span:
            raise ShapeError(f"{x.shape[1]} drafts do not fit the conv state's {span - (W - 1)} pending positions")
        out = ref_conv.verify_rows(x, conv_state, slots, weight, bias, act)
    elif x.shape[1] == 1:
        out = ref_conv.step_rows(x[:, 0], conv_state, slots, weight, bias, act)[:, None]
    else:
        out = ref_conv.prefill_rows(x, conv_state, slots, weight, bias, act)
    return out.contiguous()  # the fake's layout


@conv1d_update.register_kernel("cuda")
def _(x, conv_state, slots, weight, bias=None, kind="advance", silu=True):
    from . import kernels

    _check_mode(kind)
    if x.dtype != conv_state.dtype:  # before the lookup: no kernel is compiled for a call that cannot run
        raise DTypeError(f"x ({x.dtype}) and conv_state ({conv_state.dtype}) must share one dtype on CUDA")
    op = kernel_for(update_key(kind, x, conv_state, weight, bias, silu))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch = functools.partial(kernels.conv1d_update, checked=not ops._launch_directly())
    ops._on_torch_stream(launch, op, x, conv_state, slots, weight, bias, out)
    return out


@conv1d_update.register_fake
def _(x, conv_state, slots, weight, bias=None, kind="advance", silu=True):
    return torch.empty_like(x)


@torch.library.custom_op("kvbuffer::conv1d_accept", mutates_args=("conv_state",), device_types="cpu")
def conv1d_accept(conv_state: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor, width: int) -> None:
    """reference.conv.conv_accept: each real row keeps its first accepted[b] pending drafts."""
    ref_conv.conv_accept(conv_state, slots, accepted, width)


@conv1d_accept.register_kernel("cuda")
def _(conv_state, slots, accepted, width):
    from . import kernels

    op = kernel_for(accept_key(conv_state, width))
    launch = functools.partial(kernels.conv1d_accept, checked=not ops._launch_directly())
    ops._on_torch_stream(launch, op, conv_state, slots, accepted)


@conv1d_accept.register_fake
def _(conv_state, slots, accepted, width):
    return None


OPS = ("conv1d_update", "conv1d_accept")

__all__ = ["OPS", "ConvKey", "accept_key", "clear_kernels", "conv1d_accept", "conv1d_update", "jit", "kernel_for",
           "update_key"]
