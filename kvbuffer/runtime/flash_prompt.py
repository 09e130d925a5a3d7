"""A prompt's attention on CUDA through torch's fused attention (cuDNN's, or the FlashAttention-2 build torch
ships): causal, grouped-query, over each row's cached prefix plus its new tokens, with no score tensor.

Layout as kvbuffer.reference.prefill_attention, per row: q (B, T, H, D) the new tokens, already written
into the cache (k_cache, v_cache (slots, positions, Hkv, D)) at cached[b] .. cached[b] + T - 1. Row b's
token t attends to positions 0 .. cached[b] + t (the causal mask aligned to the bottom right of the
(T, cached[b] + T) score block). Query head h reads KV head h // (H // Hkv). Padding rows (slot -1) give
zeros. `slots` and `cached` are host lists: the caller runs eagerly (a CUDA graph cannot slice per row).

When every row is a fresh prompt (cached 0, none padding), the new keys and values are the whole context
and the rows run as one batched call; otherwise each row reads its cache slot in place (a strided view,
nothing copied), one row's output returned as computed. The backend: cuDNN's fused attention where it
takes the dtype and head shape (kvbuffer.runtime.cudnn_prompt: chosen once per device, dtype and head
shape; torch.backends.cuda.enable_cudnn_sdp(False) before the first prompt turns it off), FlashAttention-2
otherwise and for the calls cuDNN does not take (a single key).
"""

from __future__ import annotations

import torch

from . import cudnn_prompt

BACKENDS = ("cudnn", "flash")
MAX_HEAD_DIM = 256  # FlashAttention-2's limit


def fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether FlashAttention-2 takes this call: a CUDA GPU of compute capability 8.0 or newer, half
    precision in q and cache alike, a head dim it supports, whole groups of query heads per KV head."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype
            and q.shape[-1] <= MAX_HEAD_DIM and q.shape[-1] % 8 == 0 and q.shape[2] % k_cache.shape[2] == 0
            and torch.cuda.get_device_capability(q.device)[0] >= 8)


def backend_for(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """"cudnn" where torch's cuDNN attention takes q's dtype and head shape on its device, else "flash"."""
    return "cudnn" if cudnn_prompt.available(q, k_cache) else "flash"


def flash_prompt_attention(q, k, v, k_cache, v_cache, slots: list[int], cached: list[int],
                           scale: float, backend: str | None = None) -> torch.Tensor:
    """o (B, T, H, D) in q's dtype; k, v (B, T, Hkv, D) are the new tokens (also in the cache).
    backend: "cudnn" or "flash" (None: backend_for's choice)."""
    if backend is None:
        backend = backend_for(q, k_cache)
    elif backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    B, T = q.shape[:2]
    if all(s >= 0 for s in slots) and not any(cached):
        if backend == "cudnn" and cudnn_prompt.takes(T, 0):
            return cudnn_prompt.cudnn_causal(q.contiguous(), k, v, scale)
        return _flash(q, k, v, scale)
    real = all(s >= 0 for s in slots)
    if B == 1 and real:
        return _row(q, k_cache, v_cache, slots[0], cached[0], scale, backend)
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if real else torch.zeros_like(q)
    for b, (slot, start) in enumerate(zip(slots, cached)):
        if slot >= 0:
            _row(q[b:b + 1], k_cache, v_cache, slot, start, scale, backend, out[b:b + 1])
    return out


def _row(q, k_cache, v_cache, slot: int, start: int, scale: float, backend: str, out=None) -> torch.Tensor:
    """One row's T new tokens over its slot's first start + T positions (read in place), into `out` if given."""
    T = q.shape[1]
    keys, vals = k_cache[slot:slot + 1, :start + T], v_cache[slot:slot + 1, :start + T]
    if backend == "cudnn" and cudnn_prompt.takes(T, start):
        return cudnn_prompt.split_attention(q, keys, vals, start, scale, out=out)
    o = _flash(q, keys, vals, scale)
    return o if out is None else out.copy_(o)


def _flash(q, k, v, scale: float) -> torch.Tensor:
    """FlashAttention-2 on (B, T, H, D) queries and (B, L, Hkv, D) keys and values (last dim contiguous),
    causal aligned to the bottom right when L > T, query head h reading KV head h // (H // Hkv): torch's
    own binding of it (what scaled_dot_product_attention's flash path calls), which takes this layout and
    the grouped heads as they are; the public function would need the (B, heads, tokens, D) transposes
    and offers the bottom-right mask only with equal head counts."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return torch.ops.aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, True, False,
                                                   scale=scale)[0]
