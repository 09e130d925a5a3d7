"""The chunked prefill of packed prompts (tiles/gdn_prefill.py): compile, validated launch, and its reference.

One op per linear family: the plain recurrence of kvbuffer.reference.core over each sequence of a packed
batch. Sequence i (tokens cu_seqlens[i] .. cu_seqlens[i+1] - 1) starts from state[state_slots[i]] (zero for
slot -1), its outputs (N, Hv, V) are written and its final state goes back into its slot in place (nothing
for slot -1). Value head h reads key head h // (Hv // Hk); each step's log decay is clamped at
LOG_DECAY_FLOOR.

- Gated DeltaNet (delta rule, `chunk_prefill`), after its gating front: q, k (N, Hk, K) L2-normalised, q
  scaled by K**-0.5; v (N, Hv, V); g, beta (N, Hv). Its KernelKey is ("gdn", "chunk_prefill").
- Mamba-2's SSD (decay-only, `mamba2_chunk_prefill`), its front and D skip inside: the raw x (N, H, P),
  dt (N, H), B, C (N, G, N_state) and the layer's A_log, dt_bias, D (H,); dt = clamp(softplus(dt + dt_bias),
  dt_min, dt_max) (dt_max None: no upper limit), the recurrence's q = C, k = B, v = dt x, g = -exp(A_log) dt,
  and y = o + D x. A sequence on slot -1 is a padding row: zero outputs. The z gate stays outside.
  ("mamba2", "chunk_prefill").

On CUDA: q, k, v (x, B, C) bf16, g, beta (dt) and the parameters fp32, cu_seqlens and state_slots int32,
state fp32, four launches (three decay-only) of the templates of a CompiledOp of kind "chunk_prefill" whose
`fn` maps part names to compiled functions. `chunk_prefill_reference` / `mamba2_chunk_prefill_reference` are
the same contracts in torch for any float dtype.
"""

from __future__ import annotations

import torch

import math

from ..checks import FLOAT_DTYPES, INDEX_DTYPES, check_slots, check_tensor, check_unique
from ..errors import ShapeError
from ..reference import chunked
from ..reference.gating import mamba2_front
from .compiled import CompiledOp, check_contiguous, check_on_cuda, expect_kind
from .keys import KernelKey, linear_dims
from .specs import spec_for

CHUNK = 64  # tiles.gdn_prefill.BT (that module imports TileLang's front end lazily, this one never)
CHUNK_FIELDS = 3  # tiles.gdn_prefill.CHUNK_FIELDS: a chunk table row (first token, tokens, sequence)
HEAD_DIMS = (32, 64, 128)  # K and V the templates take (16: 4 warps cannot split a 16 x 16 tile; 256 untested)


def fits(K: int, V: int) -> bool:
    """Whether the templates take key and value head dims K, V (HEAD_DIMS)."""
    return K in HEAD_DIMS and V in HEAD_DIMS


def build_gdn_chunk_prefill(Hk: int, Hv: int, K: int = 128, V: int = 128, *, delta_rule: bool = True,
                            **tunables) -> CompiledOp:
    """Compile the chunked prefill for one head shape for the local GPU: the delta rule (GDN's key) or,
    with delta_rule=False, the decay-only form (Mamba-2's key with G = Hk, H = Hv, N = K, P = V).
    Tunables (the spec's defaults for those not given; value tiles capped at V): states_BV, states_stages,
    output_BV, threads."""
    key = KernelKey("gdn" if delta_rule else "mamba2", "chunk_prefill",
                    linear_dims("gdn" if delta_rule else "mamba2", Hk, Hv, K, V), "bfloat16")
    return spec_for(key).build(key, tunables)


def build_mamba2_chunk_prefill(G: int, H: int, N: int = 128, P: int = 64, **tunables) -> CompiledOp:
    """Compile Mamba-2's chunked prefill (the decay-only form) for G groups, H heads, state size N, head dim P."""
    return build_gdn_chunk_prefill(G, H, N, P, delta_rule=False, **tunables)


def chunk_slots(num_tokens: int, batch: int) -> int:
    """Rows of the per-chunk workspace: chunk c of sequence i owns row cu_seqlens[i] // CHUNK + i + c, below
    ceil(N / CHUNK) + B (tiles.gdn_prefill's module docstring)."""
    return -(-num_tokens // CHUNK) + batch


# ----------------------------------------------------------------------------------------------
# checks


def check_shapes(q, k, v, g, beta, cu_seqlens, state, state_slots, *, delta_rule: bool) -> None:
    """Shapes, dtype kinds and devices (what a fake can check): every tensor on state's device."""
    if not delta_rule and beta is not None:
        raise TypeError("beta must be None for the decay-only form (Mamba-2)")
    if delta_rule and beta is None:
        raise TypeError("beta (N, Hv) is required for the delta rule (GDN)")
    chunked.check_packed(q, k, v, g, beta, state)
    _check_offsets(cu_seqlens, state, state_slots)


def _check_offsets(cu_seqlens, state, state_slots) -> None:
    dev = state.device
    check_tensor("cu_seqlens", cu_seqlens, (None,), INDEX_DTYPES, dev)
    if cu_seqlens.shape[0] < 2:
        raise ShapeError(f"cu_seqlens must hold B + 1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}")
    check_tensor("state_slots", state_slots, (cu_seqlens.shape[0] - 1,), INDEX_DTYPES, dev)


def check_mamba2_shapes(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min: float = 0.0,
                        dt_max: float | None = None) -> None:
    """Mamba-2's op (what a fake can check): x (N, H, P), dt (N, H), B, C (N, G, N_state), A_log, dt_bias, D
    (H,) against state (slots, H, N_state, P), every tensor on state's device; dt_min <= dt_max, both finite
    and dt_min >= 0 (dt_max None: no upper limit)."""
    chunked.check_packed(C, B, x, dt, None, state)
    H = state.shape[1]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("D", D)):
        check_tensor(name, t, (H,), FLOAT_DTYPES, state.device)
    _check_offsets(cu_seqlens, state, state_slots)
    if not (math.isfinite(dt_min) and dt_min >= 0.0):
        raise ValueError(f"dt_min must be a finite float >= 0, got {dt_min!r}")
    if dt_max is not None and not (math.isfinite(dt_max) and dt_max >= dt_min):
        raise ValueError(f"dt_max must be None or a finite float >= dt_min = {dt_min!r}, got {dt_max!r}")


def check_rows(cu_seqlens, state, state_slots, N: int) -> None:
    """The checks that read cu_seqlens and state_slots back: offsets rising from 0 to N, slots in
    [-1, num_slots) and distinct."""
    c = cu_seqlens.tolist()
    if c[0] != 0 or c[-1] != N or any(b < a for a, b in zip(c, c[1:])):
        raise ShapeError(f"cu_seqlens must rise from 0 to the {N} packed tokens, got {c[:8]}"
                         + (" ..." if len(c) > 8 else ""))
    check_slots("state_slots", state_slots, len(c) - 1, state.shape[0], state.device)
    check_unique("state_slots", state_slots)


def _check_kernel(op: CompiledOp, q, k, v, g, beta, cu_seqlens, state, state_slots) -> None:
    """The compiled kernels' own demands: their head shape, bf16 activations, fp32 gates and state, int32
    offsets and slots, contiguous tensors on CUDA."""
    expect_kind(op, "chunk_prefill")
    p = op.params
    if not p["delta_rule"]:
        raise TypeError("a decay-only kernel (Mamba-2) runs through mamba2_chunk_prefill, not chunk_prefill")
    dev = q.device if isinstance(q, torch.Tensor) else None
    check_tensor("q", q, (None, p["Hk"], p["K"]), (torch.bfloat16,), dev)
    check_on_cuda("q", dev)
    N = q.shape[0]
    check_tensor("k", k, (N, p["Hk"], p["K"]), (torch.bfloat16,), dev)
    check_tensor("v", v, (N, p["Hv"], p["V"]), (torch.bfloat16,), dev)
    check_tensor("g", g, (N, p["Hv"]), (torch.float32,), dev)
    check_tensor("beta", beta, (N, p["Hv"]), (torch.float32,), dev)
    _check_kernel_rows(p, cu_seqlens, state, state_slots, dev)
    check_shapes(q, k, v, g, beta, cu_seqlens, state, state_slots, delta_rule=True)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_contiguous(name, t)


def _check_kernel_rows(p: dict, cu_seqlens, state, state_slots, dev) -> None:
    check_tensor("cu_seqlens", cu_seqlens, (None,), (torch.int32,), dev)
    check_tensor("state", state, (None, p["Hv"], p["K"], p["V"]), (torch.float32,), dev)
    check_tensor("state_slots", state_slots, None, (torch.int32,))
    for name, t in (("cu_seqlens", cu_seqlens), ("state", state), ("state_slots", state_slots)):
        check_contiguous(name, t)


def _check_mamba2_kernel(op: CompiledOp, x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min,
                         dt_max) -> None:
    """The decay-only kernels' own demands: their head shape, bf16 x, B, C, fp32 dt, parameters and state,
    int32 offsets and slots, contiguous tensors on CUDA."""
    expect_kind(op, "chunk_prefill")
    p = op.params
    if p["delta_rule"]:
        raise TypeError("a delta-rule kernel (GDN) runs through chunk_prefill, not mamba2_chunk_prefill")
    dev = x.device if isinstance(x, torch.Tensor) else None
    check_tensor("x", x, (None, p["Hv"], p["V"]), (torch.bfloat16,), dev)
    check_on_cuda("x", dev)
    N = x.shape[0]
    check_tensor("dt", dt, (N, p["Hv"]), (torch.float32,), dev)
    check_tensor("B", B, (N, p["Hk"], p["K"]), (torch.bfloat16,), dev)
    check_tensor("C", C, (N, p["Hk"], p["K"]), (torch.bfloat16,), dev)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("D", D)):
        check_tensor(name, t, (p["Hv"],), (torch.float32,), dev)
    _check_kernel_rows(p, cu_seqlens, state, state_slots, dev)
    check_mamba2_shapes(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min, dt_max)
    for name, t in (("x", x), ("dt", dt), ("A_log", A_log), ("dt_bias", dt_bias), ("B", B), ("C", C), ("D", D)):
        check_contiguous(name, t)


# ----------------------------------------------------------------------------------------------
# the launch and the reference


def chunk_prefill(op: CompiledOp, q, k, v, g, beta, cu_seqlens, state, state_slots, out=None, *,
                  check_values: bool = True) -> torch.Tensor:
    """GDN's o (N, Hv, V) bf16 of every packed sequence; each sequence's final state written to its slot in
    place.

    `check_values` = False skips the checks that read cu_seqlens and state_slots back (monotone offsets
    from 0 to N, slots in [-1, num_slots) and distinct), for engine-built rows and CUDA graph capture.
    """
    _check_kernel(op, q, k, v, g, beta, cu_seqlens, state, state_slots)
    N = q.shape[0]
    if check_values:
        check_rows(cu_seqlens, state, state_slots, N)
    out = _out(out, N, op.params["Hv"], op.params["V"], q.device)
    if N == 0:
        return out
    for part, args in gdn_launches(op, q, k, v, g, beta, cu_seqlens, state, state_slots, out):
        op.fn[part](*args)
    return out


def gdn_launches(op: CompiledOp, q, k, v, g, beta, cu_seqlens, state, state_slots, out) -> list[tuple[str, tuple]]:
    """GDN's launches in order, (part, its arguments), their workspace allocated (no checks: chunk_prefill's
    body, and what a per-launch timing replays)."""
    N, B, p = q.shape[0], cu_seqlens.shape[0] - 1, op.params
    chunks, gcum, h = _workspace(op, N, B, q.device)
    w = torch.empty((N, p["Hv"], p["K"]), dtype=torch.bfloat16, device=q.device)
    u, delta = (torch.empty((N, p["Hv"], p["V"]), dtype=torch.bfloat16, device=q.device) for _ in range(2))
    return [("chunks", (cu_seqlens, chunks)), ("prep", (k, v, g, beta, chunks, w, u, gcum)),
            ("states", (k, w, u, gcum, cu_seqlens, state, state_slots, h, delta)),
            ("output", (q, k, h, delta, gcum, chunks, out))]


def _workspace(op: CompiledOp, N: int, B: int, device) -> tuple:
    """The chunk table (chunk slots, CHUNK_FIELDS) int32, the cumulative decays (N, Hv) fp32 and the chunks'
    starting states (chunk slots, Hv, K, V) bf16."""
    p, NC = op.params, chunk_slots(N, B)
    return (torch.empty((NC, CHUNK_FIELDS), dtype=torch.int32, device=device),
            torch.empty((N, p["Hv"]), dtype=torch.float32, device=device),
            torch.empty((NC, p["Hv"], p["K"], p["V"]), dtype=torch.bfloat16, device=device))


def _out(out, N: int, Hv: int, V: int, device) -> torch.Tensor:
    if out is None:
        return torch.empty((N, Hv, V), dtype=torch.bfloat16, device=device)
    check_tensor("out", out, (N, Hv, V), (torch.bfloat16,), device)
    check_contiguous("out", out)
    return out


def mamba2_chunk_prefill(op: CompiledOp, x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots,
                         dt_min: float = 0.0, dt_max: float | None = None, out=None, *,
                         check_values: bool = True) -> torch.Tensor:
    """Mamba-2's y (N, H, P) bf16 of every packed sequence, its front and D skip inside (module docstring);
    each sequence's final state written to its slot in place. `check_values` as chunk_prefill's."""
    _check_mamba2_kernel(op, x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min, dt_max)
    N = x.shape[0]
    if check_values:
        check_rows(cu_seqlens, state, state_slots, N)
    out = _out(out, N, op.params["Hv"], op.params["V"], x.device)
    if N == 0:
        return out
    for part, args in mamba2_launches(op, x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min,
                                      dt_max, out):
        op.fn[part](*args)
    return out


def mamba2_launches(op: CompiledOp, x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min, dt_max,
                    out) -> list[tuple[str, tuple]]:
    """Mamba-2's launches in order, as gdn_launches'."""
    chunks, gcum, h = _workspace(op, x.shape[0], cu_seqlens.shape[0] - 1, x.device)
    dts = torch.empty_like(gcum)
    hi = math.inf if dt_max is None else float(dt_max)
    return [("chunks", (cu_seqlens, chunks)),
            ("states", (x, dt, A_log, dt_bias, B, cu_seqlens, state, state_slots, h, gcum, dts, float(dt_min), hi)),
            ("output", (C, B, h, x, D, gcum, dts, chunks, state_slots, out))]


def chunk_prefill_reference(q, k, v, g, beta, cu_seqlens, state, state_slots) -> torch.Tensor:
    """The op's contract in torch (any float dtypes; computed in the state's): o (N, Hv, V) in v's dtype.

    The chunkwise form of kvbuffer.reference.chunked with a flush point after every token, so every token
    folds, from each sequence's starting state gathered into a pool of its own.
    """
    check_shapes(q, k, v, g, beta, cu_seqlens, state, state_slots, delta_rule=beta is not None)
    N, B = q.shape[0], cu_seqlens.shape[0] - 1
    check_rows(cu_seqlens, state, state_slots, N)
    dev = state.device
    real = state_slots >= 0
    start = state[state_slots.clamp(min=0).long()]
    start[~real] = 0
    rows = torch.arange(B, dtype=torch.int64, device=dev)
    Hk, K, Hv, V = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    unused = [torch.zeros((B, 1) + rest, dtype=state.dtype, device=dev) for rest in ((Hk, K), (Hv, V), (Hv,))]
    o, _ = chunked.prefill(q, k, v, g, beta, cu_seqlens, start, rows, *unused, rows, torch.zeros_like(rows), 1)
    state[state_slots[real].long()] = start[real]
    return o


def mamba2_chunk_prefill_reference(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots,
                                   dt_min: float = 0.0, dt_max: float | None = None) -> torch.Tensor:
    """Mamba-2's op in torch (any float dtypes; computed in the state's): y (N, H, P) in x's dtype.

    The front of kvbuffer.reference.gating.mamba2_front (dt clamped to [dt_min, dt_max]), a padding row's
    (slot -1) dt zeroed, chunk_prefill_reference's recurrence, then y = o + D x (zero for a padding row)."""
    check_mamba2_shapes(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min, dt_max)
    N = x.shape[0]
    check_rows(cu_seqlens, state, state_slots, N)
    real = torch.repeat_interleave(state_slots >= 0, cu_seqlens.diff().long(), output_size=N).to(state.dtype)
    hi = math.inf if dt_max is None else dt_max
    value, g, _ = mamba2_front(x, dt, A_log, dt_bias, state.dtype, dt_limits=(dt_min, hi))
    value, g = value * real[:, None, None], g * real[:, None]
    o = chunk_prefill_reference(C, B, value, g, None, cu_seqlens, state, state_slots)
    return (o + D.to(state.dtype)[:, None] * x.to(state.dtype) * real[:, None, None]).to(x.dtype)
