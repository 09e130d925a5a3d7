"""The chunked prefill of packed prompts (tiles/gdn_prefill.py): compile, validated launch, and its reference.

One op for both linear families, after their gating fronts: the plain recurrence of kvbuffer.reference.core
over each sequence of a packed batch. Sequence i (tokens cu_seqlens[i] .. cu_seqlens[i+1] - 1) starts from
state[state_slots[i]] (zero for slot -1), its outputs o (N, Hv, V) are written and its final state goes back
into its slot in place (nothing for slot -1). Value head h reads key head h // (Hv // Hk); each step's log
decay is clamped at LOG_DECAY_FLOOR.

- Gated DeltaNet (delta rule): q, k (N, Hk, K) L2-normalised, q scaled by K**-0.5; v (N, Hv, V); g, beta
  (N, Hv). Its KernelKey is ("gdn", "chunk_prefill").
- Mamba-2's SSD (decay-only: no beta, the values folded as they are): q = C, k = B (N, G, N_state),
  v = dt * x (N, H, P), g = dt * A; the D skip and the z gate stay outside. ("mamba2", "chunk_prefill").

On CUDA (`chunk_prefill`): q, k, v bf16, g, beta fp32, cu_seqlens and state_slots int32, state fp32, four
launches (three decay-only) of the templates of a CompiledOp of kind "chunk_prefill" whose `fn` maps part
names to compiled functions. `chunk_prefill_reference` is the same contract in torch for any float dtype.
"""

from __future__ import annotations

import torch

from ..checks import INDEX_DTYPES, check_slots, check_tensor, check_unique
from ..errors import ShapeError
from ..reference import chunked
from .compiled import CompiledOp, check_contiguous, check_on_cuda, expect_kind
from .keys import KernelKey, linear_dims
from .specs import spec_for

CHUNK = 64  # tiles.gdn_prefill.BT (that module imports TileLang's front end lazily, this one never)
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
    dev = state.device
    check_tensor("cu_seqlens", cu_seqlens, (None,), INDEX_DTYPES, dev)
    if cu_seqlens.shape[0] < 2:
        raise ShapeError(f"cu_seqlens must hold B + 1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}")
    check_tensor("state_slots", state_slots, (cu_seqlens.shape[0] - 1,), INDEX_DTYPES, dev)


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
    dev = q.device if isinstance(q, torch.Tensor) else None
    check_tensor("q", q, (None, p["Hk"], p["K"]), (torch.bfloat16,), dev)
    check_on_cuda("q", dev)
    N = q.shape[0]
    check_tensor("k", k, (N, p["Hk"], p["K"]), (torch.bfloat16,), dev)
    check_tensor("v", v, (N, p["Hv"], p["V"]), (torch.bfloat16,), dev)
    check_tensor("g", g, (N, p["Hv"]), (torch.float32,), dev)
    if p["delta_rule"]:
        check_tensor("beta", beta, (N, p["Hv"]), (torch.float32,), dev)
    elif beta is not None:
        raise TypeError("beta must be None for a decay-only kernel (built with delta_rule=False)")
    check_tensor("cu_seqlens", cu_seqlens, (None,), (torch.int32,), dev)
    check_tensor("state", state, (None, p["Hv"], p["K"], p["V"]), (torch.float32,), dev)
    check_shapes(q, k, v, g, beta, cu_seqlens, state, state_slots, delta_rule=p["delta_rule"])
    check_tensor("state_slots", state_slots, None, (torch.int32,))
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("cu_seqlens", cu_seqlens),
                    ("state", state), ("state_slots", state_slots)):
        if t is not None:
            check_contiguous(name, t)


# ----------------------------------------------------------------------------------------------
# the launch and the reference


def chunk_prefill(op: CompiledOp, q, k, v, g, beta, cu_seqlens, state, state_slots, out=None, *,
                  check_values: bool = True) -> torch.Tensor:
    """o (N, Hv, V) bf16 of every packed sequence; each sequence's final state written to its slot in place
    (beta None for a decay-only op).

    `check_values` = False skips the checks that read cu_seqlens and state_slots back (monotone offsets
    from 0 to N, slots in [-1, num_slots) and distinct), for engine-built rows and CUDA graph capture.
    """
    _check_kernel(op, q, k, v, g, beta, cu_seqlens, state, state_slots)
    N, B = q.shape[0], cu_seqlens.shape[0] - 1
    if check_values:
        check_rows(cu_seqlens, state, state_slots, N)
    p = op.params
    Hv, K, V = p["Hv"], p["K"], p["V"]
    if out is None:
        out = torch.empty((N, Hv, V), dtype=torch.bfloat16, device=q.device)
    else:
        check_tensor("out", out, (N, Hv, V), (torch.bfloat16,), q.device)
        check_contiguous("out", out)
    if N == 0:
        return out
    empty = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=q.device)  # noqa: E731
    NC = chunk_slots(N, B)
    chunks = empty((NC, 2), torch.int32)
    gcum = empty((N, Hv), torch.float32)
    h = empty((NC, Hv, K, V), torch.bfloat16)
    fn = op.fn
    fn["chunks"](cu_seqlens, chunks)
    if not p["delta_rule"]:  # decay-only: the states kernel forms the decays, the values are the deltas
        fn["states"](k, v, g, cu_seqlens, state, state_slots, h, gcum)
        fn["output"](q, k, h, v, gcum, chunks, out)
        return out
    w = empty((N, Hv, K), torch.bfloat16)
    u, delta = empty((N, Hv, V), torch.bfloat16), empty((N, Hv, V), torch.bfloat16)
    fn["prep"](k, v, g, beta, chunks, w, u, gcum)
    fn["states"](k, w, u, gcum, cu_seqlens, state, state_slots, h, delta)
    fn["output"](q, k, h, delta, gcum, chunks, out)
    return out


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
