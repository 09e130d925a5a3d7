"""Gated DeltaNet (Qwen3.5 / Qwen3-Next) ops: the fused gating front + the generic buffered core.

Inputs are what the layer has after its short conv: raw q, k (..., Hk, K) before L2 norm, v
(..., Hv, V), and the gate projections a, b (..., Hv) with the layer's A_log and dt_bias (Hv,).
State, buffer and slot arguments follow kvbuffer.reference.core.
"""

from __future__ import annotations

from . import core
from .gating import gdn_front

flush = core.flush


def recurrent_step(q, k, v, a, b, A_log, dt_bias, state, state_slots):
    """Today's servers' decode step: read and write the whole state. Returns o (B, Hv, V)."""
    qn, kn, g, beta = gdn_front(q, k, a, b, A_log, dt_bias, state.dtype)
    return core.recurrent_step(qn, kn, v, g, beta, state, state_slots)


def buffered_step(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g,
                  buffer_slots, lengths, flush_at=0):
    """KVBuffer decode step (reads S0 + buffer, appends one entry; fused flush at `flush_at`)."""
    qn, kn, g, beta = gdn_front(q, k, a, b, A_log, dt_bias, state.dtype)
    return core.buffered_step(qn, kn, v, g, beta, state, state_slots, buf_k, buf_v, buf_g,
                              buffer_slots, lengths, flush_at)


def verify(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths,
           flush_at=0):
    """T tokens per row (inputs (B, T, ...)): o (B, T, Hv, V). Speculative verify writes no state;
    a prompt chunk with flush_at folds the buffers it fills (core.verify)."""
    qn, kn, g, beta = gdn_front(q, k, a, b, A_log, dt_bias, state.dtype)
    return core.verify(qn, kn, v, g, beta, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at)


def prefill(q, k, v, a, b, A_log, dt_bias, state, state_slot, buf_k, buf_v, buf_g, buffer_slot, length, flush_at):
    """Chunked prefill of one request (inputs (T, ...)); returns (o (T, Hv, V), new buffer length)."""
    qn, kn, g, beta = gdn_front(q, k, a, b, A_log, dt_bias, state.dtype)
    return core.prefill(qn, kn, v, g, beta, state, state_slot, buf_k, buf_v, buf_g, buffer_slot, length, flush_at)
