"""Gated DeltaNet (Qwen3.5 / Qwen3-Next) ops: the fused gating front + the generic buffered core.

Inputs are what the layer has after its short conv: raw q, k (..., Hk, K) before L2 norm, v
(..., Hv, V), and the gate projections a, b (..., Hv) with the layer's A_log and dt_bias (Hv,).
State, buffer and slot arguments follow kvbuffer.reference.core.
"""

from __future__ import annotations

from ..checks import FLOAT_DTYPES, check_heads, check_param, check_tensor
from . import core
from .gating import gdn_front

flush = core.flush


def check_gates(state, v, a, b, A_log, dt_bias) -> None:
    """a, b shaped like v without its head dim, A_log and dt_bias (Hv,) with Hv the state pool's:
    a wrong size would broadcast (a (1,) A_log gives every head one decay) or fail inside the math."""
    lead, Hv, dev = check_heads(state, "v", v)
    check_tensor("a", a, lead + (Hv,), FLOAT_DTYPES, dev)
    check_tensor("b", b, lead + (Hv,), FLOAT_DTYPES, dev)
    check_param("A_log", A_log, Hv, dev)
    check_param("dt_bias", dt_bias, Hv, dev)


def _front(q, k, v, a, b, A_log, dt_bias, state):
    check_gates(state, v, a, b, A_log, dt_bias)
    return gdn_front(q, k, a, b, A_log, dt_bias, state.dtype)


def recurrent_step(q, k, v, a, b, A_log, dt_bias, state, state_slots):
    """Today's servers' decode step: read and write the whole state. Returns o (B, Hv, V)."""
    qn, kn, g, beta = _front(q, k, v, a, b, A_log, dt_bias, state)
    return core.recurrent_step(qn, kn, v, g, beta, state, state_slots)


def recurrent_drafts(q, k, v, a, b, A_log, dt_bias, state, state_slots, draft_states, draft_rows):
    """Today's servers' verify of T fed tokens (inputs (B, T, ...)), one state per token
    (core.recurrent_drafts); the baseline kvbuffer's `verify` replaces. Returns o (B, T, Hv, V)."""
    qn, kn, g, beta = _front(q, k, v, a, b, A_log, dt_bias, state)
    return core.recurrent_drafts(qn, kn, v, g, beta, state, state_slots, draft_states, draft_rows)


def buffered_step(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g,
                  buffer_slots, lengths, flush_at=0):
    """KVBuffer decode step (reads S0 + buffer, appends one entry; fused flush at `flush_at`)."""
    qn, kn, g, beta = _front(q, k, v, a, b, A_log, dt_bias, state)
    return core.buffered_step(qn, kn, v, g, beta, state, state_slots, buf_k, buf_v, buf_g,
                              buffer_slots, lengths, flush_at)


def verify(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths,
           flush_at=0):
    """T tokens per row (inputs (B, T, ...)): o (B, T, Hv, V). Speculative verify writes no state;
    a prompt chunk with flush_at folds the buffers it fills (core.verify)."""
    qn, kn, g, beta = _front(q, k, v, a, b, A_log, dt_bias, state)
    return core.verify(qn, kn, v, g, beta, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at)


def prefill(q, k, v, a, b, A_log, dt_bias, state, state_slot, buf_k, buf_v, buf_g, buffer_slot, length, flush_at):
    """Chunked prefill of one request (inputs (T, ...)); returns (o (T, Hv, V), new buffer length)."""
    qn, kn, g, beta = _front(q, k, v, a, b, A_log, dt_bias, state)
    return core.prefill(qn, kn, v, g, beta, state, state_slot, buf_k, buf_v, buf_g, buffer_slot, length, flush_at)
