"""Nemotron-H / Nemotron-3 Mamba-2 decode templates: the decay-only members of tiles.linear_decode.

Mapping (KVBUFFER.md): key = B (per group: a group is a key head), value = dt * x, query = C,
g = dt * A with A = -exp(A_log), dt = softplus(dt + dt_bias) (no floor), no delta correction; the
output is y = o + D * x, optionally gated y * silu(z) (`selective_state_update` semantics). States are
(slots, H, N, P): key-major, K = N (state size) and V = P (head dim). Padding rows output exact zeros.

Args of every kernel: x, dt, A_log, dt_bias, B, C, D, z, state, state_slots, [buf_k, buf_v, buf_g,
buffer_slots, lengths,] y; z is read only by kernels built with has_z=True (pass x otherwise).
"""

from .linear_decode import (  # noqa: F401  (the tunables lists are part of this module's API)
    get_buffered_configs,
    get_flush_configs,
    get_recurrent_configs,
    linear_buffered,
    linear_flush,
    linear_recurrent,
)

NEMOTRON3 = {"nano": dict(G=8, H=64, N=128, P=64), "super": dict(G=8, H=128, N=128, P=64)}


def mamba2_recurrent(G: int, H: int, N: int = 128, P: int = 64, *, BV: int = 32, threads: int = 128,
                     in_dtype: str = "bfloat16", has_z: bool = False):
    """selective_state_update as one kernel: read, update and write state[state_slots] every token."""
    return linear_recurrent("mamba2", G, H, N, P, BV=BV, threads=threads, in_dtype=in_dtype, has_z=has_z)


def mamba2_buffered(G: int, H: int, N: int = 128, P: int = 64, *, cap: int = 16, T_new: int = 1,
                    flush_at: int = 0, BV: int = 64, threads: int = 128, in_dtype: str = "bfloat16",
                    buf_dtype: str = "bfloat16", has_z: bool = False):
    """T_new Mamba-2 tokens after each row's n buffered entries (step, verify, prefill chunk; fused flush at C)."""
    return linear_buffered("mamba2", G, H, N, P, cap=cap, T_new=T_new, flush_at=flush_at, BV=BV,
                           threads=threads, in_dtype=in_dtype, buf_dtype=buf_dtype, has_z=has_z)


def mamba2_flush(G: int, H: int, N: int = 128, P: int = 64, *, cap: int = 16, BV: int = 32,
                 threads: int = 128, buf_dtype: str = "bfloat16"):
    """Fold each row's n buffered entries into its state (the family's shared flush)."""
    return linear_flush(G, H, N, P, cap=cap, BV=BV, threads=threads, buf_dtype=buf_dtype)
