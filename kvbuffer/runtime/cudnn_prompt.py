"""A prompt's attention on cuDNN's fused attention (torch's binding of it): on Hopper at head dim 256 it
runs on the tensor cores' wgmma, which FlashAttention-2 does not. No score tensor, no mask tensor.

Layouts as kvbuffer.runtime.flash_prompt: q (B, T, H, D), keys and values (B, L, Hkv, D), last dim
contiguous; cuDNN reads them through (B, heads, tokens, D) views, the grouped KV heads as they are.
cuDNN's causal mask is aligned to the top left of the score block, so it serves square blocks only:
- a fresh prompt (L = T): one causal call;
- T new tokens after c cached positions: [q over the c cached positions, no mask] and [q over its own
  T positions, causal], each with its log-sum-exp, merged by `merge` (`split_attention`); one new
  token sees all of its L positions: one call, no mask.
cuDNN takes no call over a single key (`takes`); the caller runs FlashAttention-2 there.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)

# part(q (B, T, H, D), k, v (B, S, Hkv, D), scale, causal) -> (o (B, T, H, D), lse (B, H, T) fp32)
Part = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, bool], tuple]


# the probe's largest error, relative to the largest |o|, against the reference (a few bf16 roundings)
PROBE_TOLERANCE = 3e-2


def available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether torch's cuDNN attention takes q's dtype, heads and head dim on q's device: its own gate, then
    a small prompt of each form (fresh, and after cached positions) checked against
    kvbuffer.reference.prefill_attention; asked once per device, dtype and head shape. The choice is
    logged (a refused or differing probe as a warning, and FlashAttention-2 runs instead)."""
    if not q.is_cuda:
        return False
    return _available(q.device, q.dtype, q.shape[2], k_cache.shape[2], q.shape[3])


@functools.lru_cache(maxsize=None)
def _available(device: torch.device, dtype: torch.dtype, H: int, Hkv: int, D: int) -> bool:
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention

    probe_q = torch.empty(1, H, 2, D, device=device, dtype=dtype)
    probe_kv = torch.empty(1, Hkv, 2, D, device=device, dtype=dtype)
    ok = bool(can_use_cudnn_attention(SDPAParams(probe_q, probe_kv, probe_kv, None, 0.0, True, True)))
    if ok:
        try:  # the gate speaks for SDPA's own call; this module calls cuDNN's op directly, grouped heads as they are
            error = _probe_error(device, dtype, H, Hkv, D)
        except RuntimeError as e:
            log.warning("prompt attention: cuDNN refused a probe call on %s (%s); FlashAttention-2 instead",
                        device, str(e).splitlines()[0][:200])
            return False
        if not error <= PROBE_TOLERANCE:
            log.warning("prompt attention: cuDNN's result differs from the reference on %s (relative error %.2e); "
                        "FlashAttention-2 instead", device, error)
            return False
    log.info("prompt attention on %s, %s, %d/%d heads, head dim %d: %s", device, dtype, H, Hkv, D,
             "cuDNN" if ok else "FlashAttention-2 (torch's gate refuses cuDNN)")
    return ok


def _probe_error(device, dtype, H: int, Hkv: int, D: int, T: int = 5, cached: int = 7) -> float:
    """The largest error, relative to the largest |o|, of a fresh prompt of T tokens (one causal call) and of
    T tokens after `cached` positions (split_attention) against the reference, on random inputs."""
    from ..reference.prefill_attention import prefill_attention

    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, T, H, D, generator=g, device=device).to(dtype)
    k, v = (torch.randn(1, cached + T, Hkv, D, generator=g, device=device).to(dtype) for _ in range(2))
    scale = D ** -0.5
    worst = 0.0
    for start, got in ((0, cudnn_causal(q, k[:, :T], v[:, :T], scale)), (cached, split_attention(q, k, v, cached, scale))):
        index = torch.tensor([0, T], device=device)
        want = prefill_attention(q[0].float(), k[:, :start + T].float(), v[:, :start + T].float(), index,
                                 torch.zeros(1, dtype=torch.long, device=device),
                                 torch.tensor([start], device=device), scale)
        worst = max(worst, float((got[0].float() - want).abs().max() / want.abs().max()))
    return worst


def takes(T: int, cached: int) -> bool:
    """Whether every cuDNN call of T new tokens after `cached` positions spans two keys or more."""
    if T == 1:
        return cached >= 1
    return cached == 0 or cached >= 2


def cudnn_part(q, k, v, scale: float, causal: bool):
    """One cuDNN attention call: (o (B, T, H, D) in q's layout, lse (B, H, T) fp32, natural log)."""
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal, False, scale=scale)[:2]
    return o.transpose(1, 2), lse.reshape(lse.shape[0], lse.shape[1], lse.shape[2])


def cudnn_causal(q, k, v, scale: float) -> torch.Tensor:
    """A fresh prompt (keys and values are the T new tokens'): one causal call, o (B, T, H, D)."""
    o = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, False, 0.0, True, False, scale=scale)[0]
    return o.transpose(1, 2)


def split_attention(q, k, v, cached: int, scale: float, part: Part | None = None, out=None) -> torch.Tensor:
    """q (B, T, H, D) at positions cached .. cached + T - 1 over keys and values (B, cached + T, Hkv, D):
    the cached part unmasked and the new part causal, merged; one new token in one unmasked call.
    part: one attention call (default cudnn_part); out: where to write o (B, T, H, D), else a new tensor."""
    part = part or cudnn_part
    if q.shape[1] == 1 or not cached:  # one new token sees every key; with nothing cached, one causal call
        o = part(q, k, v, scale, not cached)[0]
        return o if out is None else out.copy_(o)
    o_a, lse_a = part(q, k[:, :cached], v[:, :cached], scale, False)
    o_b, lse_b = part(q, k[:, cached:], v[:, cached:], scale, True)
    return merge(o_a, lse_a, o_b, lse_b, out)


def merge(o_a, lse_a, o_b, lse_b, out=None) -> torch.Tensor:
    """Attention over two disjoint key sets from each one's output (B, T, H, D) and log-sum-exp (B, H, T):
    o = w o_a + (1 - w) o_b with w = exp(lse_a) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_a - lse_b), one
    lerp over the outputs; w is rounded to the outputs' dtype (for bf16 2^-9 of w relative)."""
    w = torch.sigmoid(lse_a - lse_b).transpose(1, 2).unsqueeze(-1).to(o_a.dtype)  # (B, T, H, 1)
    if out is None:
        out = torch.empty(o_a.shape, dtype=o_a.dtype, device=o_a.device)
    return torch.lerp(o_b, o_a, w, out=out)
