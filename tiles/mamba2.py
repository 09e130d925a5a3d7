"""Nemotron-H / Nemotron-3 Mamba-2 decode templates: the decay-only members of tiles.linear_decode.

Mapping (KVBUFFER.md): key = B (per group: a group is a key head), value = dt * x, query = C,
g = dt * A with A = -exp(A_log), dt = softplus(dt + dt_bias) (no floor), no delta correction; the
output is y = o + D * x, optionally gated y * silu(z) (`selective_state_update` semantics). States are
(slots, H, N, P): key-major, K = N (state size) and V = P (head dim). Padding rows output exact zeros.

Args of every kernel: x, dt, A_log, dt_bias, B, C, D, z, state, state_slots, [buf_k, buf_v, buf_g,
buffer_slots, lengths,] y; z is read only by kernels built with has_z=True (pass x otherwise).

The buffered template has two variants with that one ABI (tunable `variant`): "reduce", the generic
in-block-reduction template (tiles/linear_decode.py, TF32 GEMMs; the default), and "simt", the
thread-level template of tiles/mamba2_simt.py (fp32 FMA; the GDN design of tiles/gdn.py). "simt" is
not the default until it has been measured on a GPU; `kvbuffer tune` times both.
"""

from .linear_decode import get_buffered_configs as _reduce_configs
from .linear_decode import (  # noqa: F401  (the tunables lists are part of this module's API)
    get_flush_configs,
    get_recurrent_configs,
    linear_buffered,
    linear_flush,
    linear_recurrent,
)
from .mamba2_simt import get_simt_configs, mamba2_buffered_simt

VARIANTS = ("reduce", "simt")

NEMOTRON3 = {"nano": dict(G=8, H=64, N=128, P=64), "super": dict(G=8, H=128, N=128, P=64)}


def mamba2_recurrent(G: int, H: int, N: int = 128, P: int = 64, *, BV: int = 32, threads: int = 128,
                     in_dtype: str = "bfloat16", has_z: bool = False):
    """selective_state_update as one kernel: read, update and write state[state_slots] every token."""
    return linear_recurrent("mamba2", G, H, N, P, BV=BV, threads=threads, in_dtype=in_dtype, has_z=has_z)


def get_buffered_configs() -> list[dict]:
    """Tunables of `mamba2_buffered`, both variants interleaved (`kvbuffer tune --max-configs N` tries the
    first N): the generic default first, then the thread-level template's best guess, so N >= 2 always
    times both. The first "reduce" entry is the template's default (no `variant` key: "reduce")."""
    reduce = _reduce_configs()
    default = {"BV": 64, "threads": 128}
    reduce = [default] + [c for c in reduce if c != default]
    simt = get_simt_configs()
    out = []
    for i in range(max(len(reduce), len(simt))):
        out += reduce[i:i + 1] + simt[i:i + 1]
    return out


def mamba2_buffered(G: int, H: int, N: int = 128, P: int = 64, *, cap: int = 16, T_new: int = 1,
                    flush_at: int = 0, BV: int = 64, threads: int = 128, in_dtype: str = "bfloat16",
                    buf_dtype: str = "bfloat16", has_z: bool = False, variant: str = "reduce", blocks: int = 0):
    """T_new Mamba-2 tokens after each row's n buffered entries (step, verify, prefill chunk; fused flush at C).

    variant "reduce" (default): tiles/linear_decode.py; "simt": tiles/mamba2_simt.py (`blocks` caps its
    registers). One ABI for both.
    """
    if variant == "simt":
        return mamba2_buffered_simt(G, H, N, P, cap=cap, T_new=T_new, flush_at=flush_at, BV=BV, threads=threads,
                                    blocks=blocks, in_dtype=in_dtype, buf_dtype=buf_dtype, has_z=has_z)
    if variant != "reduce":
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if blocks:
        raise ValueError("blocks is a tunable of the 'simt' variant only")
    return linear_buffered("mamba2", G, H, N, P, cap=cap, T_new=T_new, flush_at=flush_at, BV=BV,
                           threads=threads, in_dtype=in_dtype, buf_dtype=buf_dtype, has_z=has_z)


def mamba2_flush(G: int, H: int, N: int = 128, P: int = 64, *, cap: int = 16, BV: int = 32,
                 threads: int = 128, buf_dtype: str = "bfloat16"):
    """Fold each row's n buffered entries into its state (the family's shared flush)."""
    return linear_flush(G, H, N, P, cap=cap, BV=BV, threads=threads, buf_dtype=buf_dtype)
