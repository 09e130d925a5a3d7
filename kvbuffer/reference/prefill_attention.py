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
q's dtype, zero for padding rows' tokens. Tiles are block_q rows x block_k positions; besides
them a request's context is copied once into the layouts the tile products read.
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
    acc_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    for i, (slot, L) in enumerate(zip(rows, lens)):
        s, e = cu[i], cu[i + 1]
        if slot < 0 or e == s:
            continue
        keys, vals = k_cache[slot, :L + e - s], v_cache[slot, :L + e - s]
        if k is not None:  # the new tokens' from k, v, as the cache would hold them
            keys = torch.cat([keys[:L], k[s:e].to(k_cache.dtype)])
            vals = torch.cat([vals[:L], v[s:e].to(v_cache.dtype)])
        # the request's context once in the layouts the tile products read: (Hkv, D, n) and (Hkv, n, D)
        keys_t = keys.to(acc_dt).permute(1, 2, 0).contiguous()
        vals_t = vals.to(acc_dt).transpose(0, 1).contiguous()
        for a in range(0, e - s, block_q):
            b = min(a + block_q, e - s)
            out[s + a:s + b] = _query_block(q[s + a:s + b].to(acc_dt) * scale, keys_t, vals_t, L + a, block_k)
    return out


def _query_block(q, keys_t, vals_t, first: int, block_k: int) -> torch.Tensor:
    """Scaled query rows (Tq, H, D) at positions first .. first + Tq - 1 over positions
    0 .. first + Tq - 1, one key tile at a time: a running max m, sum l and accumulator per row."""
    Tq, H, D = q.shape
    Hkv = keys_t.shape[0]
    G = H // Hkv
    qg = q.view(Tq, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * Tq, D)  # rows (g, t)
    m = torch.full((Hkv, G * Tq), float("-inf"), dtype=q.dtype, device=q.device)
    l = torch.zeros((Hkv, G * Tq), dtype=q.dtype, device=q.device)  # noqa: E741
    acc = torch.zeros((Hkv, G * Tq, D), dtype=q.dtype, device=q.device)
    end = first + Tq  # exclusive: the last row sees position end - 1
    rows_at = first + torch.arange(Tq, device=q.device)
    for p0 in range(0, end, block_k):
        p1 = min(p0 + block_k, end)
        s = torch.bmm(qg, keys_t[:, :, p0:p1])  # (Hkv, G*Tq, Tk)
        if p1 - 1 > first:  # the tile reaches past the first row: mask what each row may not see
            ahead = torch.arange(p0, p1, device=q.device)[None, :] > rows_at[:, None]  # (Tq, Tk)
            s.view(Hkv, G, Tq, p1 - p0).masked_fill_(ahead, float("-inf"))
        # position 0 is in the first tile and visible to every row, so m is finite from then on
        m_new = torch.maximum(m, s.amax(dim=-1))
        p = s.sub_(m_new[..., None]).exp_()
        keep = (m - m_new).exp_()
        l.mul_(keep).add_(p.sum(dim=-1))
        acc.mul_(keep[..., None]).baddbmm_(p, vals_t[:, p0:p1])
        m = m_new
    o = acc / l[..., None]  # (Hkv, G*Tq, D)
    return o.view(Hkv, G, Tq, D).permute(2, 0, 1, 3).reshape(Tq, H, D)
