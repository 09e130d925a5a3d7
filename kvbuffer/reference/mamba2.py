"""Mamba-2 (Nemotron-H / Nemotron-3) ops: the decay-only case of the generic buffered core.

Mapping (KVBUFFER.md): key = B (per group), value = dt * x, query = C (per group), g = dt * A,
no delta correction. After the core, y = o + D * x and the optional gate y * silu(z), as in
`selective_state_update`. Inputs: x (..., H, P), dt (..., H) raw, B and C (..., G, N), the layer's
A_log, dt_bias, D (H,). States are (num_slots, H, N, P): key-major, the transpose of transformers'
(P, N) layout (see kvbuffer.pools.LinearLayerShape).
"""

from __future__ import annotations

from ..checks import FLOAT_DTYPES, check_heads, check_param, check_tensor
from . import core
from .gating import mamba2_front, mamba2_output

flush = core.flush


def check_gates(state, x, dt, A_log, dt_bias, B, C, D, z=None) -> None:
    """dt shaped like x without its head dim, A_log, dt_bias and D (H,) with H the state pool's, z
    like x: a wrong size would broadcast silently (a (1,) D or A_log) or fail inside the math.
    B and C (..., G, N) are checked here under their own names (the core calls them k and q)."""
    lead, H, dev = check_heads(state, "x", x)
    check_tensor("dt", dt, lead + (H,), FLOAT_DTYPES, dev)
    check_tensor("B", B, lead + (None, state.shape[2]), FLOAT_DTYPES, dev)
    check_tensor("C", C, tuple(B.shape), FLOAT_DTYPES, dev)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("D", D)):
        check_param(name, t, H, dev)
    if z is not None:
        check_tensor("z", z, lead + (H, state.shape[3]), FLOAT_DTYPES, dev)


def _front(x, dt, A_log, dt_bias, B, C, D, z, state):
    check_gates(state, x, dt, A_log, dt_bias, B, C, D, z)
    return mamba2_front(x, dt, A_log, dt_bias, state.dtype)


def recurrent_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, z=None):
    """Today's servers' step (selective_state_update with dt_softplus): returns y (Bt, H, P)."""
    value, g, _ = _front(x, dt, A_log, dt_bias, B, C, D, z, state)
    o = core.recurrent_step(C, B, value, g, None, state, state_slots)
    return mamba2_output(o, x, D, z, real=state_slots >= 0).to(x.dtype)


def recurrent_drafts(x, dt, A_log, dt_bias, B, C, D, state, state_slots, draft_states, draft_rows, z=None):
    """Today's servers' verify of T fed tokens (inputs (Bt, T, ...)), one state per token
    (core.recurrent_drafts). Returns y (Bt, T, H, P)."""
    value, g, _ = _front(x, dt, A_log, dt_bias, B, C, D, z, state)
    o = core.recurrent_drafts(C, B, value, g, None, state, state_slots, draft_states, draft_rows)
    return mamba2_output(o, x, D, z, real=draft_rows >= 0).to(x.dtype)


def buffered_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g,
                  buffer_slots, lengths, flush_at=0, z=None):
    """KVBuffer decode step: reads S0 + buffer, appends (B, dt*x, G); fused flush at `flush_at`."""
    value, g, _ = _front(x, dt, A_log, dt_bias, B, C, D, z, state)
    o = core.buffered_step(C, B, value, g, None, state, state_slots, buf_k, buf_v, buf_g,
                           buffer_slots, lengths, flush_at)
    return mamba2_output(o, x, D, z, real=buffer_slots >= 0).to(x.dtype)


def verify(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, z=None,
           flush_at=0):
    """T tokens per row (inputs (Bt, T, ...)): y (Bt, T, H, P). Speculative verify writes no state;
    a prompt chunk with flush_at folds the buffers it fills (core.verify)."""
    value, g, _ = _front(x, dt, A_log, dt_bias, B, C, D, z, state)
    o = core.verify(C, B, value, g, None, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at)
    return mamba2_output(o, x, D, z, real=buffer_slots >= 0).to(x.dtype)


def prefill(x, dt, A_log, dt_bias, B, C, D, state, state_slot, buf_k, buf_v, buf_g, buffer_slot, length,
            flush_at, z=None):
    """Chunked prefill of one request (inputs (T, ...)): (y (T, H, P), new buffer length)."""
    value, g, _ = _front(x, dt, A_log, dt_bias, B, C, D, z, state)
    o, n = core.prefill(C, B, value, g, None, state, state_slot, buf_k, buf_v, buf_g, buffer_slot, length, flush_at)
    return mamba2_output(o, x, D, z).to(x.dtype), n
