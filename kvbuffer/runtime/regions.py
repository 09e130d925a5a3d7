"""Compiled regions: a stretch of a prompt's elementwise torch work run as one torch.compile'd function.

A prompt's forward runs eagerly (its chunk plan depends on each buffer's fill), so the work between its
GEMMs and kernels would be a chain of torch launches, each writing its intermediate to memory. `region`
runs such a stretch compiled by Inductor (one or two fused kernels; the token dim dynamic, so one
compilation serves every prompt length). The layers' regions are in kvbuffer.models.fused; the Gated
DeltaNet prompt's front, which the kernel Backend runs before its chunked prefill, is here.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ..reference.gating import L2NORM_EPS, adjacent_heads

log = logging.getLogger("kvbuffer")
_COMPILED: dict = {}  # function -> its torch.compile'd form (made at first use), or None: it failed to compile


def region(fn, *args):
    """fn(*args) compiled, the leading (token) dim of every tensor argument dynamic. A region that fails
    to compile (no Triton, say) runs eagerly from then on, with one warning: the functions have no side
    effects, so running one again is safe. Other errors (out of memory) are raised as they are."""
    compiled = _COMPILED.get(fn, False)
    if compiled is False:
        compiled = _COMPILED[fn] = torch.compile(fn, fullgraph=True, dynamic=False)
    if compiled is None:
        return fn(*args)
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 1:
            torch._dynamo.maybe_mark_dynamic(a, 0)
    try:
        return compiled(*args)
    except torch._dynamo.exc.TorchDynamoException as e:  # a failed compilation (Inductor's errors are wrapped)
        _COMPILED[fn] = None
        log.warning("kvbuffer: a prompt's fused %s failed to compile, running it eagerly from now on: %s",
                    fn.__name__.strip("_"), str(e).splitlines()[0] if str(e) else type(e).__name__)
        return fn(*args)


def _gdn_front(pair, v, a, b, A_log, dt_bias, keep, q_scale: float, eps: float, act: torch.dtype,
               dtype: torch.dtype):
    """kvbuffer.reference.gating.gdn_prompt_front's values from pair (N, 2, Hk, K) = [q, k] per token,
    v (N, Hv, V), a, b (N, Hv), keep (N, 1): 1 for a real row's token, 0 for padding. Returns q, k in
    `act`, v copied to `act`, g, beta in `dtype`, each its own dense tensor."""
    h = pair.to(dtype)
    r = torch.rsqrt(h.square().sum(-1, keepdim=True) + eps)
    q = (h[:, 0] * (r[:, 0] * (keep[:, :, None] * q_scale))).to(act)
    k = (h[:, 1] * r[:, 1]).to(act)
    beta = torch.sigmoid(b.to(dtype))
    g = -torch.exp(A_log.to(dtype)) * F.softplus(a.to(dtype) + dt_bias.to(dtype))
    return q, k, v.to(act, copy=True), g, beta


def gdn_front_region(q, k, v, a, b, A_log, dt_bias, act: torch.dtype, dtype: torch.dtype, real):
    """kvbuffer.reference.gating.gdn_prompt_front as one region, v packed with it: for q, k (B, T, Hk, K)
    side by side in memory (adjacent_heads: the models' projection layout), v (B, T, Hv, V), a, b
    (B, T, Hv), real (B,) bool, the N = B * T tokens' (q, k, v, g, beta), dense, q, k, v in `act` and
    g, beta in `dtype`. None (the caller runs the eager front) where q and k are not side by side, or
    where the rows' tokens do not flatten without a copy (several rows cut short of their projection's
    length: a layout the region would compile anew for)."""
    pair = adjacent_heads(q, k)
    if pair is None or not all(_flattens(t) for t in (pair, v, a, b)):
        return None
    B, T, Hk, K = q.shape
    flat = lambda t: t.reshape(B * T, *t.shape[2:])  # noqa: E731  (views: _flattens)
    keep = real.to(dtype).repeat_interleave(T).view(B * T, 1)
    return region(_gdn_front, pair.reshape(B * T, 2, Hk, K), flat(v), flat(a), flat(b), A_log, dt_bias, keep,
                  K ** -0.5, L2NORM_EPS, act, dtype)


def _flattens(t: torch.Tensor) -> bool:
    """Whether t's (B, T) dims merge into one as a view."""
    return t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)
