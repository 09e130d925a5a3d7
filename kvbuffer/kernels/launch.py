"""CUDA launches of the ops: look the kernel up for the arguments' shapes, then run it on torch's stream.

Each function here takes the custom op's arguments (kvbuffer.kernels.torch_ops registers them as
the ops' CUDA implementations) plus `checked`: True runs the validating launcher of
kvbuffer.kernels.gdn / .mamba2 / .conv / .attention / .gemv first; False launches directly, skipping the checks that
read the device back (slot ranges, duplicate slots, buffer room, the fill rules), which stall the
launch queue. Callers that built the slots and lengths themselves (the engine's kernel Backend)
pass False; shapes, dtypes and contiguity are still checked by the compiled kernels' entry. A
launch during CUDA-graph capture is always direct (a capture forbids reading the device back).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import ArtifactError, DTypeError
from . import gdn, mamba2, prefill
from .attention import ATTENTION_DECODE, attention_key
from .attention import kernel as _attention_kernel
from .attention import launch_decode as attention_decode
from .conv import CONV_ACCEPT, CONV_UPDATE
from .conv import accept_key as conv_accept_key
from .conv import launch_accept as conv1d_accept
from .conv import launch_update as conv1d_update
from .conv import update_key as conv_update_key
from .fp8_ops import FP8_GEMV_OP as FP8_GEMV
from .fp8_ops import fp8_gemv_key
from .fp8_ops import launch_fp8_gemv as fp8_gemv
from .gemv import GEMV_EXPERTS_OP as GEMV_EXPERTS
from .gemv import GEMV_OP as GEMV
from .gemv import GROUPED_EXPERTS_OP as GROUPED_EXPERTS
from .gemv import gemv_experts_key, gemv_key, grouped_experts_key
from .gemv import launch_gemv as gemv
from .gemv import launch_gemv_experts as gemv_experts
from .gemv import launch_grouped_experts as grouped_experts
from . import specs
from .calls import EngineOp, capturing, engine_rows, on_torch_stream, token_axis  # noqa: F401  (re-exported)
from .keys import KernelKey, dtype_name, linear_dims
from .lookup import kernel_for
from .specs import KernelSpec


_on_torch_stream, _token_axis = on_torch_stream, token_axis


def _linear_key(spec: KernelSpec, key_t, val_t, buf_k=None, T=1, C=0, z=None) -> KernelKey:
    """The key of a linear op from its key-side tensor (k / B) and value-side tensor (v / x)."""
    dims = linear_dims(spec.family, key_t.shape[-2], val_t.shape[-2], key_t.shape[-1], val_t.shape[-1])
    cap = buf_k.shape[1] if buf_k is not None else 0
    return KernelKey(spec.family, spec.op, dims, dtype_name(val_t), dtype_name(buf_k) if buf_k is not None else "",
                     cap=cap, T=T, C=C, has_z=z is not None)


def _flush_key(spec: KernelSpec, state, buf_k) -> KernelKey:
    dims = linear_dims(spec.family, buf_k.shape[2], state.shape[1], state.shape[2], state.shape[3])
    return KernelKey(spec.family, spec.op, dims, "", dtype_name(buf_k), cap=buf_k.shape[1])


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet


def gdn_recurrent_step(q, k, v, a, b, A_log, dt_bias, state, state_slots, *, checked=True):
    op = kernel_for(_linear_key(specs.GDN_RECURRENT, k, v), q.shape[0])
    if checked and not capturing():
        return _on_torch_stream(gdn.gdn_recurrent_step, op, q, k, v, a, b, A_log, dt_bias, state, state_slots)
    o = torch.empty_like(v)
    u = _token_axis
    _on_torch_stream(op.fn, u(q), u(k), u(v), u(a), u(b), A_log, dt_bias, state, state_slots, u(o))
    return o


def gdn_buffered_step(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                      lengths, flush_at, *, checked=True):
    op = kernel_for(_linear_key(specs.GDN_BUFFERED, k, v, buf_k, 1, flush_at), q.shape[0])
    pools = (state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if checked and not capturing():
        return _on_torch_stream(gdn.gdn_buffered_step, op, q, k, v, a, b, A_log, dt_bias, *pools)
    u = _token_axis
    o = torch.empty_like(v)
    _on_torch_stream(op.fn, u(q), u(k), u(v), u(a), u(b), A_log, dt_bias, *pools, u(o))
    return o


def gdn_verify(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths,
               flush_at=0, *, checked=True):
    op = kernel_for(_linear_key(specs.GDN_BUFFERED, k, v, buf_k, q.shape[1], flush_at), q.shape[0])
    args = (q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if checked and not capturing():
        return _on_torch_stream(gdn.gdn_verify, op, *args)
    o = torch.empty_like(v)
    _on_torch_stream(op.fn, *args, o)
    return o


def gdn_recurrent_drafts(q, k, v, a, b, A_log, dt_bias, state, state_slots, draft_states, draft_rows, *, checked=True):
    op = kernel_for(_linear_key(specs.GDN_RECURRENT_DRAFTS, k, v, T=q.shape[1]), q.shape[0])
    args = (q, k, v, a, b, A_log, dt_bias, state, state_slots, draft_states, draft_rows)
    if checked and not capturing():
        return _on_torch_stream(gdn.gdn_recurrent_drafts, op, *args)
    o = torch.empty_like(v)
    _on_torch_stream(op.fn, *args, o)
    return o


# ----------------------------------------------------------------------------------------------
# Mamba-2 (the kernels take z = x when the layer has no gate)


def mamba2_recurrent_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, z=None, *, checked=True):
    op = kernel_for(_linear_key(specs.MAMBA2_RECURRENT, B, x, z=z), x.shape[0])
    if checked and not capturing():
        return _on_torch_stream(mamba2.mamba2_recurrent_step, op, x, dt, A_log, dt_bias, B, C, D, state,
                                state_slots, z)
    u = _token_axis
    y = torch.empty_like(x)
    _on_torch_stream(op.fn, u(x), u(dt), A_log, dt_bias, u(B), u(C), D, u(x if z is None else z), state,
                     state_slots, u(y))
    return y


def mamba2_recurrent_drafts(x, dt, A_log, dt_bias, B, C, D, state, state_slots, draft_states, draft_rows, z=None, *,
                            checked=True):
    op = kernel_for(_linear_key(specs.MAMBA2_RECURRENT_DRAFTS, B, x, T=x.shape[1], z=z), x.shape[0])
    if checked and not capturing():
        return _on_torch_stream(mamba2.mamba2_recurrent_drafts, op, x, dt, A_log, dt_bias, B, C, D, state,
                                state_slots, draft_states, draft_rows, z)
    y = torch.empty_like(x)
    _on_torch_stream(op.fn, x, dt, A_log, dt_bias, B, C, D, x if z is None else z, state, state_slots, draft_states,
                     draft_rows, y)
    return y


def mamba2_buffered_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                         lengths, flush_at, z=None, *, checked=True):
    op = kernel_for(_linear_key(specs.MAMBA2_BUFFERED, B, x, buf_k, 1, flush_at, z), x.shape[0])
    pools = (state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if checked and not capturing():
        return _on_torch_stream(mamba2.mamba2_buffered_step, op, x, dt, A_log, dt_bias, B, C, D, *pools, z)
    u = _token_axis
    y = torch.empty_like(x)
    _on_torch_stream(op.fn, u(x), u(dt), A_log, dt_bias, u(B), u(C), D, u(x if z is None else z), *pools, u(y))
    return y


def mamba2_verify(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths,
                  flush_at=0, z=None, *, checked=True):
    op = kernel_for(_linear_key(specs.MAMBA2_BUFFERED, B, x, buf_k, x.shape[1], flush_at, z), x.shape[0])
    pools = (state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if checked and not capturing():
        return _on_torch_stream(mamba2.mamba2_verify, op, x, dt, A_log, dt_bias, B, C, D, *pools, z)
    y = torch.empty_like(x)
    _on_torch_stream(op.fn, x, dt, A_log, dt_bias, B, C, D, x if z is None else z, *pools, y)
    return y


# ----------------------------------------------------------------------------------------------
# the chunked prefill of packed prompts (both families, after their fronts)


def chunk_prefill_key(family: str, key_t, val_t) -> KernelKey:
    """The chunked prefill kernel for packed key-side (k / B: (N, Hk, K)) and value-side ((N, Hv, V)) tensors."""
    spec = specs.GDN_CHUNK_PREFILL if family == "gdn" else specs.MAMBA2_CHUNK_PREFILL
    dims = linear_dims(family, key_t.shape[-2], val_t.shape[-2], key_t.shape[-1], val_t.shape[-1])
    return KernelKey(spec.family, spec.op, dims, "bfloat16")


def _chunk_prefill(family: str, q, k, v, g, beta, cu_seqlens, state, state_slots, checked: bool):
    op = kernel_for(chunk_prefill_key(family, k, v), cu_seqlens.shape[0] - 1)
    return _on_torch_stream(prefill.chunk_prefill, op, q, k, v, g, beta, cu_seqlens, state, state_slots,
                            check_values=checked and not capturing())


def gdn_chunk_prefill(q, k, v, g, beta, cu_seqlens, state, state_slots, *, checked=True):
    return _chunk_prefill("gdn", q, k, v, g, beta, cu_seqlens, state, state_slots, checked)


def mamba2_chunk_prefill(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min: float = 0.0,
                         dt_max: float | None = None, *, checked=True):
    """Mamba-2's takes the layer's raw x and dt: its front and D skip run inside the kernels."""
    op = kernel_for(chunk_prefill_key("mamba2", B, x), cu_seqlens.shape[0] - 1)
    return _on_torch_stream(prefill.mamba2_chunk_prefill, op, x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state,
                            state_slots, dt_min, dt_max, check_values=checked and not capturing())


# ----------------------------------------------------------------------------------------------
# the flush (one kernel shape for both families)



def _flush(spec: KernelSpec, launcher, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, *,
           checked=True) -> None:
    """Fold each row's lengths[b] buffer entries into its state with `spec`'s kernel."""
    op = kernel_for(_flush_key(spec, state, buf_k), buffer_slots.shape[0])
    args = (state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if checked and not capturing():
        _on_torch_stream(launcher, op, *args)
    else:
        _on_torch_stream(op.fn, *args)


gdn_flush = functools.partial(_flush, specs.GDN_FLUSH, gdn.gdn_flush)
mamba2_flush = functools.partial(_flush, specs.MAMBA2_FLUSH, mamba2.mamba2_flush)


def flush(family: str, *args, checked=True) -> None:
    """gdn_flush or mamba2_flush by family name (kept for callers that hold a family's name)."""
    {"gdn": gdn_flush, "mamba2": mamba2_flush}[family](*args, checked=checked)


CUDA_LAUNCHES = specs.CUDA_LAUNCHES  # op name -> the CUDA implementation of torch.ops.kvbuffer.<name>
CUDA_LAUNCHES.update({
    "gdn_recurrent_step": gdn_recurrent_step, "gdn_buffered_step": gdn_buffered_step, "gdn_verify": gdn_verify,
    "gdn_flush": gdn_flush, "gdn_recurrent_drafts": gdn_recurrent_drafts,
    "mamba2_recurrent_step": mamba2_recurrent_step, "mamba2_buffered_step": mamba2_buffered_step,
    "mamba2_verify": mamba2_verify, "mamba2_flush": mamba2_flush,
    "mamba2_recurrent_drafts": mamba2_recurrent_drafts,
    "gdn_chunk_prefill": gdn_chunk_prefill, "mamba2_chunk_prefill": mamba2_chunk_prefill,
})  # the families not in modules of their own yet


@dataclass(frozen=True)
class LinearOps:
    """A linear family's ops as the engine calls them."""

    recurrent_step: EngineOp
    buffered_step: EngineOp
    verify: EngineOp
    recurrent_drafts: EngineOp
    flush: EngineOp
    chunk_prefill: EngineOp


GDN_OPS = LinearOps(
    EngineOp(gdn_recurrent_step, lambda: torch.ops.kvbuffer.gdn_recurrent_step),
    EngineOp(gdn_buffered_step, lambda: torch.ops.kvbuffer.gdn_buffered_step),
    EngineOp(gdn_verify, lambda: torch.ops.kvbuffer.gdn_verify),
    EngineOp(gdn_recurrent_drafts, lambda: torch.ops.kvbuffer.gdn_recurrent_drafts),
    EngineOp(gdn_flush, lambda: torch.ops.kvbuffer.gdn_flush),
    EngineOp(gdn_chunk_prefill, lambda: torch.ops.kvbuffer.gdn_chunk_prefill))
MAMBA2_OPS = LinearOps(
    EngineOp(mamba2_recurrent_step, lambda: torch.ops.kvbuffer.mamba2_recurrent_step),
    EngineOp(mamba2_buffered_step, lambda: torch.ops.kvbuffer.mamba2_buffered_step),
    EngineOp(mamba2_verify, lambda: torch.ops.kvbuffer.mamba2_verify),
    EngineOp(mamba2_recurrent_drafts, lambda: torch.ops.kvbuffer.mamba2_recurrent_drafts),
    EngineOp(mamba2_flush, lambda: torch.ops.kvbuffer.mamba2_flush),
    EngineOp(mamba2_chunk_prefill, lambda: torch.ops.kvbuffer.mamba2_chunk_prefill))
