"""Causal grouped-query attention of packed prompt tokens over each request's KV cache, in tiles
with an online softmax (flash-style): no (T x context) score tensor, memory linear in the context.

Layout (one layer of kvbuffer.runtime.caches.KVCache, what runtime.mixing.attention reads):

    q                   (N, H, D)               the new tokens of B requests, concatenated
    cu_seqlens          (B + 1,) int            request i owns tokens cu[i] .. cu[i+1]-1 (T_i of them)
    k_cache, v_cache    (slots, positions, Hkv, D)   KVCache.k[layer], KVCache.v[layer]
    slots, cached       (B,) int                request i's cache slot (-1: padding) and its L_i cached positions
    k, v (optional)     (N, Hkv, D)             the new tokens' keys and values

Request i's token t sits at position L_i + t and attends to positions 0 .. L_i + t. The prefix
0 .. L_i - 1 is read from the cache; the new tokens' keys and values are read from the cache too,
at L_i .. L_i + T_i - 1, where runtime.mixing.attention writes them first (put_slot_rows,
put_kv_rows), or, when `k` and `v` are given, from those, rounded to the cache's dtype as a read
after the write gives them. Nothing is written. Query head h reads KV head h // (H // Hkv).
Scores, softmax and sums accumulate in fp32 (fp64 for fp64 queries); o (N, H, D) comes back in
q's dtype, zero for padding rows' tokens.
"""

from __future__ import annotations

import torch

from ..checks import FLOAT_DTYPES, INDEX_DTYPES, check_slots, check_tensor
from ..errors import ShapeError

__all__ = ["prefill_attention", "BLOCK_Q", "BLOCK_K"]

BLOCK_Q = 128  # query rows of a tile
BLOCK_K = 256  # cache positions of a tile


def _check(q, k_cache, v_cache, cu_seqlens, slots, cached, scale, k, v, block_q, block_k):
    """Every check before anything is computed; returns the offsets, slots and lengths on the host."""
    check_tensor("q", q, (None, None, None), FLOAT_DTYPES)
    N, H, D = q.shape
    dev = q.device
    check_tensor("k_cache", k_cache, (None, None, None, D), FLOAT_DTYPES, dev)
    check_tensor("v_cache", v_cache, tuple(k_cache.shape), (k_cache.dtype,), dev)
    n_slots, positions, Hkv = k_cache.shape[:3]
    if Hkv == 0 or H % Hkv:
        raise ShapeError(f"query heads ({H}) must be a multiple of KV heads ({Hkv})")
    if (k is None) != (v is None):
        raise ShapeError("pass the new tokens' k and v together, or neither (then they are read from the cache)")
    if k is not None:
        check_tensor("k", k, (N, Hkv, D), FLOAT_DTYPES, dev)
        check_tensor("v", v, (N, Hkv, D), FLOAT_DTYPES, dev)
    check_tensor("cu_seqlens", cu_seqlens, (None,), INDEX_DTYPES, dev)
    if cu_seqlens.shape[0] < 1:
        raise ShapeError("cu_seqlens must hold B + 1 offsets (at least [0]), got an empty tensor")
    B = cu_seqlens.shape[0] - 1
    check_slots("slots", slots, B, n_slots, dev)
    check_tensor("cached", cached, (B,), INDEX_DTYPES, dev)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ShapeError(f"{name} must be an int >= 1, got {size!r}")
    cu, rows, lens = cu_seqlens.tolist(), slots.tolist(), cached.tolist()
    if cu[0] != 0 or cu[-1] != N or any(b < a for a, b in zip(cu, cu[1:])):
        raise ShapeError(f"cu_seqlens must rise from 0 to the {N} tokens of q without falling, got {cu[:8]}"
                         + (" ..." if len(cu) > 8 else ""))
    for i, (slot, L) in enumerate(zip(rows, lens)):
        T = cu[i + 1] - cu[i]
        if slot >= 0 and not 0 <= L <= positions - T:
            raise ShapeError(f"row {i}: {L} cached positions + {T} new tokens do not fit the cache's {positions} "
                             "positions (cached must be >= 0)")
    return cu, rows, lens


def prefill_attention(q, k_cache, v_cache, cu_seqlens, slots, cached, scale: float, k=None, v=None, *,
                      block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> torch.Tensor:
    """o (N, H, D): causal GQA of each request's new tokens over its cache (module docstring)."""
    cu, rows, lens = _check(q, k_cache, v_cache, cu_seqlens, slots, cached, scale, k, v, block_q, block_k)
    out = torch.zeros_like(q)
    for i, (slot, L) in enumerate(zip(rows, lens)):
        s, e = cu[i], cu[i + 1]
        if slot < 0 or e == s:
            continue
        new = None if k is None else (k[s:e].to(k_cache.dtype), v[s:e].to(v_cache.dtype))
        keys = _KeyReader(k_cache[slot], v_cache[slot], L, new)
        for a in range(0, e - s, block_q):
            b = min(a + block_q, e - s)
            out[s + a:s + b] = _query_block(q[s + a:s + b], keys, L + a, scale, block_k).to(q.dtype)
    return out


class _KeyReader:
    """Positions [p0, p1) of one request's keys and values: the cache's up to L, the new tokens'
    from L on when they are given apart (else the cache's there too)."""

    def __init__(self, k_slot, v_slot, L: int, new):
        self.k_slot, self.v_slot, self.L, self.new = k_slot, v_slot, L, new

    def __call__(self, p0: int, p1: int):
        if self.new is None or p1 <= self.L:
            return self.k_slot[p0:p1], self.v_slot[p0:p1]
        k_new, v_new = self.new
        lo = max(p0, self.L)
        ks, vs = k_new[lo - self.L:p1 - self.L], v_new[lo - self.L:p1 - self.L]
        if p0 < self.L:
            ks, vs = torch.cat([self.k_slot[p0:self.L], ks]), torch.cat([self.v_slot[p0:self.L], vs])
        return ks, vs


def _query_block(q, keys: _KeyReader, first: int, scale: float, block_k: int) -> torch.Tensor:
    """Tq query rows at positions first .. first + Tq - 1 over positions 0 .. first + Tq - 1, one key
    tile at a time: running max m, sum l and accumulator per row (Tq, H, D), in the accumulation dtype."""
    Tq, H, D = q.shape
    acc_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    Hkv = keys.k_slot.shape[1]
    G = H // Hkv
    qg = q.to(acc_dt).view(Tq, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * Tq, D)  # rows (g, t)
    m = torch.full((Hkv, G * Tq), float("-inf"), dtype=acc_dt, device=q.device)
    l = torch.zeros((Hkv, G * Tq), dtype=acc_dt, device=q.device)  # noqa: E741
    acc = torch.zeros((Hkv, G * Tq, D), dtype=acc_dt, device=q.device)
    end = first + Tq  # exclusive: the last row sees position end - 1
    rows_at = first + torch.arange(Tq, device=q.device)
    for p0 in range(0, end, block_k):
        p1 = min(p0 + block_k, end)
        kb, vb = keys(p0, p1)
        s = torch.matmul(qg, kb.to(acc_dt).permute(1, 2, 0)) * scale  # (Hkv, G*Tq, Tk)
        if p1 - 1 > first:  # the tile reaches past the first row: mask what each row may not see
            ahead = torch.arange(p0, p1, device=q.device)[None, :] > rows_at[:, None]  # (Tq, Tk)
            s.view(Hkv, G, Tq, p1 - p0).masked_fill_(ahead, float("-inf"))
        # position 0 is in the first tile and visible to every row, so m is finite from then on
        m_new = torch.maximum(m, s.amax(dim=-1))
        p = torch.exp(s - m_new[..., None])
        keep = torch.exp(m - m_new)
        l = l * keep + p.sum(dim=-1)  # noqa: E741
        acc = torch.baddbmm(acc * keep[..., None], p, vb.to(acc_dt).transpose(0, 1))
        m = m_new
    o = acc / l[..., None]  # (Hkv, G*Tq, D)
    return o.view(Hkv, G, Tq, D).permute(2, 0, 1, 3).reshape(Tq, H, D)
