"""The short conv1d as torch custom ops (`torch.ops.kvbuffer.conv1d_*`), for the engine and CUDA graphs.

    torch.ops.kvbuffer.conv1d_update(x, conv_state, slots, weight, bias=None, kind="advance", silu=True) -> out
    torch.ops.kvbuffer.conv1d_accept(conv_state, slots, accepted, width)

Semantics are kvbuffer.reference.conv's: x (B, T, D) after each row's history in conv_state
(NS, D, W - 1 + max_drafts); kind (the mode; torch reserves the name `mode`) "advance" makes the
last W - 1 inputs the history (T = 1: the decode step, T > 1: a prompt), "verify" stores the T
drafts as pending (history untouched); conv1d_accept keeps the first accepted[b] drafts of each row.
Slot -1 = padding row (output 0, nothing written). Both declare that they mutate conv_state.

CPU: the reference (with its checks). CUDA: a compiled kernel (tiles/conv1d.py) per (kind, D, W,
span, T, dtypes, bias, silu); advance with T > 1 uses one kernel for every prompt length. Kernels
come from the artifact cache (`kvbuffer tune --model ...` builds them, with SiLU, for spans W + T of
its `--draft-tokens` layouts), else from a JIT compile when allowed (`KVBUFFER_JIT=1` /
kvbuffer.ops.allow_jit()); otherwise a CUDA call raises ArtifactError (the engine then keeps the
reference conv, see kvbuffer.runtime.kernel_ops.conv_update). CUDA tensors: contiguous; x, conv_state
and out share one dtype (bf16, fp16 or fp32); weight and bias share one; slots and accepted int32.
Under kvbuffer.ops.unchecked() or CUDA-graph capture the launch skips the checks that read the
device back (slot range, duplicates, accepted range).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from . import ops
from .errors import ArtifactError, DTypeError, ShapeError
from .reference import conv as ref_conv

_KERNELS: dict = {}  # (ConvKey, batch) -> kvbuffer.kernels.CompiledOp (pool size is dynamic)
_JITTED: dict = {}   # ConvKey -> the JIT-compiled kernel (one for every batch)
_TEMPLATES = {("advance", 1): "conv1d_step", ("advance", 0): "conv1d_prefill"}  # kvbuffer.autotune.conv_templates


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


def kernel_for(key: ConvKey, batch: int = 1):
    """The compiled kernel for `key` at this batch: from the artifact cache, else compiled once with
    TileLang when JIT is allowed, else ArtifactError."""
    op = _KERNELS.get((key, batch))
    if op is None:
        op = _KERNELS[(key, batch)] = _load(key, max(int(batch), 1))
    return op


def _load(key: ConvKey, batch: int):
    return ops.artifact_or_jit(key, batch, _from_artifacts, jit, _JITTED, key)


def _template(key: ConvKey) -> tuple[str | None, int]:
    """(the `kvbuffer tune` template that builds this kernel or None, the drafts its span makes room for)."""
    drafts = key.span - key.W
    if drafts < 0 or not key.silu:
        return None, drafts
    if key.kind in ("verify", "accept"):
        fits = key.kind == "accept" or key.T == drafts + 1
        return (f"conv1d_{key.kind}" if drafts >= 1 and fits else None), drafts
    return _TEMPLATES.get((key.kind, key.T)), drafts


def _shapes(key: ConvKey) -> list[dict]:
    """The conv tuning records that can hold this kernel: the accept reads no weights, so it is found
    in a record of any weight dtype and bias."""
    from .autotune.models import make_conv_shape

    if key.kind != "accept":
        return [make_conv_shape(key.D, key.W, key.dtype, key.w_dtype, key.has_bias)]
    w_dtypes = dict.fromkeys((key.dtype, "bfloat16", "float16", "float32"))
    return [make_conv_shape(key.D, key.W, key.dtype, w, bias) for bias in (False, True) for w in w_dtypes]


def _from_artifacts(key: ConvKey, batch: int):
    from .kernels import CompiledOp
    from .kernels.conv import UPDATE_KINDS

    template, drafts = _template(key)
    if template is None:
        raise ArtifactError(f"`kvbuffer tune` builds no conv1d kernel for {key} (it builds the SiLU step, "
                            "prompt, verify of T + 1 tokens and accept for spans W + T)")
    command = "kvbuffer tune --gpu <gpu> --model <model>" + (f" --draft-tokens {drafts}" if drafts else "")
    if key.kind == "accept":
        kind, params = "conv_accept", dict(D=key.D, W=key.W, span=key.span, dtype=key.dtype)
    else:
        kind = UPDATE_KINDS[key.kind]
        params = dict(D=key.D, W=key.W, span=key.span, T_len=key.T, mode=key.kind, dtype=key.dtype,
                      w_dtype=key.w_dtype, has_bias=key.has_bias, silu=key.silu, T=key.T)
    errors = []
    for shape in _shapes(key):
        try:
            return ops.load_artifact(shape, template, batch, [(None, drafts)], command,
                                     lambda a: CompiledOp(a.fn, kind, dict(params, **a.key.tunables)))
        except ArtifactError as e:
            errors.append(e)
    # a record that exists but lacks this layout says more than the shapes that have none
    raise next((e for e in errors if "in this tuning record" in str(e)), errors[0])


def jit(key: ConvKey):
    from . import kernels

    if key.kind == "accept":
        return kernels.build_conv1d_accept(key.D, key.W, key.span, dtype=key.dtype)
    return kernels.build_conv1d_update(key.D, key.W, key.span, key.T, key.kind, dtype=key.dtype,
                                       w_dtype=key.w_dtype, has_bias=key.has_bias, silu=key.silu)


def clear_kernels() -> None:
    _KERNELS.clear()
    _JITTED.clear()


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
    op = kernel_for(update_key(kind, x, conv_state, weight, bias, silu), x.shape[0])
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

    op = kernel_for(accept_key(conv_state, width), slots.shape[0])
    launch = functools.partial(kernels.conv1d_accept, checked=not ops._launch_directly())
    ops._on_torch_stream(launch, op, conv_state, slots, accepted)


@conv1d_accept.register_fake
def _(conv_state, slots, accepted, width):
    return None


OPS = ("conv1d_update", "conv1d_accept")

__all__ = ["OPS", "ConvKey", "accept_key", "clear_kernels", "conv1d_accept", "conv1d_update", "jit", "kernel_for",
           "update_key"]
