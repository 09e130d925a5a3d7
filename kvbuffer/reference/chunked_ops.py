"""Each family's gating front + the chunked prefill of packed prompts (kvbuffer.reference.chunked):
gdn.prefill and mamba2.prefill for many requests at once, in chunks of `chunk_size` tokens.

Inputs are the families' per-token inputs for the N tokens of B requests concatenated ((N, ...)
instead of (T, ...)) with `cu_seqlens` (B + 1,); pools, slots and fills as in
kvbuffer.reference.core. Each returns (output (N, Hv, V), new fills (B,)); padding rows' tokens
(buffer slot -1) give zeros.
"""

from __future__ import annotations

import torch

from . import chunked, gdn, mamba2
from .gating import gdn_front, mamba2_front, mamba2_output

__all__ = ["gdn_prefill", "mamba2_prefill"]


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu_seqlens, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                lengths, flush_at: int, chunk_size: int = chunked.CHUNK_SIZE):
    """Gated DeltaNet: raw q, k (N, Hk, K) after the short conv, v (N, Hv, V), a, b (N, Hv)."""
    gdn.check_gates(state, v, a, b, A_log, dt_bias)
    qn, kn, g, beta = gdn_front(q, k, a, b, A_log, dt_bias, state.dtype)
    return chunked.prefill(qn, kn, v, g, beta, cu_seqlens, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                           lengths, flush_at, chunk_size)


def mamba2_prefill(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, buf_k, buf_v, buf_g,
                   buffer_slots, lengths, flush_at: int, z=None, chunk_size: int = chunked.CHUNK_SIZE):
    """Mamba-2: x (N, H, P), dt (N, H) raw, B, C (N, G, N_state), optional gate z (N, H, P)."""
    mamba2.check_gates(state, x, dt, A_log, dt_bias, B, C, D, z)
    value, g, _ = mamba2_front(x, dt, A_log, dt_bias, state.dtype)
    o, fills = chunked.prefill(C, B, value, g, None, cu_seqlens, state, state_slots, buf_k, buf_v, buf_g,
                               buffer_slots, lengths, flush_at, chunk_size)
    real = torch.repeat_interleave(buffer_slots >= 0, cu_seqlens.diff().long(), output_size=x.shape[0])
    return mamba2_output(o, x, D, z, real=real).to(x.dtype), fills
