"""Decode attention over the KV cache, read in place: compile (`build_*`), the reference, validated launch.

The kernels (tiles/attention.py) compute, for T new tokens per row, causal GQA attention over the
row's cache positions 0 .. cached[b] + t, the new keys and values already written there. Long
contexts at small batches are split across blocks (flash-decoding): `attention_decode` then writes
per-split partials and `attention_combine` merges them; `splits_for` picks the split count on the
host from the batch and the longest context, so nothing is read back from the device.

`attention_reference` is the same math in torch, in any dtype (the tests run it in fp64).
"""

from __future__ import annotations

import math

import torch

from ..checks import check_slots, check_tensor
from ..errors import ShapeError
from .compiled import ACT_DTYPES, CompiledOp, check_contiguous, check_on_cuda, expect_kind
from .keys import ATTENTION_MAX_TOKENS, AttnDims, KernelKey, attention_row_blocks
from .specs import spec_for

MIN_SPLIT_POSITIONS = 32  # a split reads at least this many positions (a warp step of 4 warps x 4 positions x 2)
BLOCKS_PER_SM = 1         # splits are added until the grid has about this many blocks per SM (docs/kernels.md)


def build_attention_decode(H: int, Hkv: int, D: int, T: int = 1, *, dtype: str = "bfloat16",
                           kv_dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile the per-split pass of T new tokens per row over the cache (tunables: threads, unroll)."""
    key = KernelKey("attention", "decode", AttnDims(H, Hkv, D), dtype, kv_dtype, T=T)
    return spec_for(key).build(key, {**spec_for(key).defaults(key), **tunables})


def build_attention_combine(H: int, D: int, T: int = 1, *, dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile the merge of the splits' partials (tunables: threads)."""
    key = KernelKey("attention", "combine", AttnDims(H, H, D), dtype, T=T)
    return spec_for(key).build(key, {**spec_for(key).defaults(key), **tunables})


def decode_blocks(op: CompiledOp, batch: int) -> int:
    """Blocks of the decode kernel per split: batch x Hkv x the blocks a KV head's rows take (the
    form keys.attention_on_tensor_cores picks for the op's shape and dtypes)."""
    G = op["H"] // op["Hkv"]
    return batch * op["Hkv"] * attention_row_blocks(G, op["T"], op["D"], op["dtype"], op["kv_dtype"])


def splits_for(blocks: int, context: int, sm_count: int) -> int:
    """How many splits each row's positions get: 1 once `blocks` (B x Hkv x query blocks) fill the GPU,
    else enough for about BLOCKS_PER_SM blocks per SM, each reading at least MIN_SPLIT_POSITIONS of
    the `context` positions (the longest row's, an upper bound known on the host)."""
    want = math.ceil(BLOCKS_PER_SM * sm_count / max(blocks, 1))
    return max(1, min(want, math.ceil(context / MIN_SPLIT_POSITIONS)))


def attention_reference(q, k_cache, v_cache, slots, cached, scale: float) -> torch.Tensor:
    """The kernels' math in torch, in q's dtype (fp64 for the tests): out (B, T, H, D), zeros for padding rows."""
    B, T, H, D = q.shape
    Hkv = k_cache.shape[2]
    out = torch.zeros_like(q)
    for b in range(B):
        slot = int(slots[b])
        if slot < 0:
            continue
        n = int(cached[b]) + T
        keys = k_cache[slot, :n].to(q.dtype).repeat_interleave(H // Hkv, dim=1)  # (n, H, D)
        vals = v_cache[slot, :n].to(q.dtype).repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("thd,nhd->thn", q[b], keys) * scale
        ahead = torch.arange(n, device=q.device)[None, :] > (n - T + torch.arange(T, device=q.device))[:, None]
        scores = scores.masked_fill(ahead[:, None, :], float("-inf"))
        out[b] = torch.einsum("thn,nhd->thd", torch.softmax(scores, dim=-1), vals)
    return out


def _check_inputs(op: CompiledOp, q, k_cache, v_cache, slots, cached, checked: bool):
    p = op.params
    dev = q.device if isinstance(q, torch.Tensor) else None
    check_tensor("q", q, (None, p["T"], p["H"], p["D"]), (ACT_DTYPES[p["dtype"]],), dev)
    check_on_cuda("q", dev)
    B = q.shape[0]
    kv = (ACT_DTYPES[p["kv_dtype"]],)
    check_tensor("k_cache", k_cache, (None, None, p["Hkv"], p["D"]), kv, dev)
    check_tensor("v_cache", v_cache, tuple(k_cache.shape), kv, dev)
    check_tensor("slots", slots, (B,), (torch.int32,), dev)
    check_tensor("cached", cached, (B,), (torch.int32,), dev)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots), ("cached", cached)):
        check_contiguous(name, t)
    if checked and B:  # these read the device back
        check_slots("slots", slots, B, k_cache.shape[0], dev)
        check_cached_range(slots, cached, p["T"], k_cache.shape[1])
    return B


def check_cached_range(slots, cached, T: int, max_len: int) -> None:
    """Every real row's T new tokens must lie in its cache: 0 <= cached, cached + T <= max_len (reads
    the device back). Summed in int64: an int32 `cached` near 2**31 - 1 must not wrap into range."""
    end = cached.long() + T
    bad = (slots >= 0) & ((end < T) | (end > max_len))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ShapeError(f"cached + T must lie in [T, max_len={max_len}] for every real row (T={T}), "
                         f"got cached {int(cached[row])} in row {row}")


def attention_decode(op: CompiledOp, combine: CompiledOp | None, q, k_cache, v_cache, slots, cached, scale: float,
                     out=None, *, splits: int = 1, checked: bool = True) -> torch.Tensor:
    """out (B, T, H, D) = softmax(q k^T * scale) v over each row's cache positions 0 .. cached[b] + t.

    q (B, T, H, D); k_cache, v_cache (NS, max_len, Hkv, D), the T new tokens already at cached[b] ..;
    slots, cached (B,) int32, slot -1 a padding row (zero output, nothing read). splits > 1 needs the
    `combine` kernel built for the same H, D, T and dtype. checked=False skips the checks that read
    the device back (slot range, cached in range): for engine-built rows and CUDA-graph capture.
    """
    expect_kind(op, "attention_decode")
    B = _check_inputs(op, q, k_cache, v_cache, slots, cached, checked)
    p = op.params
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive int, got {splits!r}")
    if splits > 1:
        expect_kind(combine, "attention_combine")
        mismatch = {k: (combine[k], p[k]) for k in ("H", "D", "T", "dtype") if combine[k] != p[k]}
        if mismatch:
            raise ShapeError(f"the combine kernel was built for other parameters (combine, decode): {mismatch}")
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor("out", out, tuple(q.shape), (q.dtype,), q.device)
        check_contiguous("out", out)
    if not B:
        return out
    rows = B if splits > 1 else 1  # with one split the workspace is not read: a 1-row stand-in
    part = torch.empty(rows, splits, p["T"] * p["H"], p["D"], dtype=torch.float32, device=q.device)
    stats = torch.empty(rows, splits, p["T"] * p["H"], 2, dtype=torch.float32, device=q.device)
    op.fn(q, k_cache, v_cache, slots, cached, part, stats, out, float(scale))
    if splits > 1:
        combine.fn(part, stats, slots, out)
    return out


def attention_batch_checks(q, k_cache, v_cache, slots, cached) -> None:
    """What every call must satisfy whatever the kernel: GQA heads, one head dim, T within the kernels'."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots), ("cached", cached)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ShapeError(f"q must be (B, T, H, D) and k_cache (NS, max_len, Hkv, D), got {tuple(q.shape)} and "
                         f"{tuple(k_cache.shape)}")
    B, T, H, D = q.shape
    if k_cache.shape[3] != D or H % k_cache.shape[2]:
        raise ShapeError(f"q's heads ({H}) must be a multiple of the cache's ({k_cache.shape[2]}) and both head "
                         f"dims equal, got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ShapeError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if not 1 <= T <= ATTENTION_MAX_TOKENS:
        raise ShapeError(f"the attention kernels take 1 .. {ATTENTION_MAX_TOKENS} new tokens per row, got T={T}")
    if slots.shape != (B,) or cached.shape != (B,):
        raise ShapeError(f"slots and cached must have shape ({B},), got {tuple(slots.shape)} and "
                         f"{tuple(cached.shape)}")
