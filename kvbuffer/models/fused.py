"""A prompt's elementwise work between its GEMMs and kernels, each stretch as one Inductor region.

A prompt's forward runs eagerly (its chunk plan depends on each buffer's fill; kvbuffer.engine.compiled
compiles only the decode and verify forwards), so the work between its GEMMs and kernels is a chain of
torch launches, each writing its intermediate to memory: Qwen3.5's decoder norms in fp32 with a cast on
each side, the residual adds, the MLP's SiLU and product, attention's q/k norms and rotary embedding,
the gated norms (Nemotron-H's too), the routed experts' activation and weighted sum. At thousands of
tokens these chains are a large share of a prompt's time (docs/results.md). Each function here is one
such stretch compiled by torch.compile (kvbuffer.runtime.regions.region: one or two fused kernels, the
token count dynamic, so one compilation serves every prompt length), used where ForwardBatch.fuse is set
(a prompt chunk too long to be graphed, on CUDA with the engine's compile on); elsewhere the layers run
their eager code. The same math, rounded the same way, except that a region may keep in fp32 an
intermediate that the eager code rounds to bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..runtime.regions import region as _region


def _rms_norm(x, scale, eps: float):
    """x / rms(x) * scale in fp32, rounded to x's dtype (Qwen3.5's decoder norms, scale = 1 + w)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * scale).to(x.dtype)


def _add_rms_norm(x, y, scale, eps: float):
    """(s, norm(s)) with s = x + y rounded to x's dtype: a residual add and the next norm in one pass."""
    s = x + y
    return s, _rms_norm(s, scale, eps)


def _silu_mul(gate, up):
    return F.silu(gate) * up


def _gated_norm(o, z, weight, eps: float, dtype: torch.dtype):
    """norm(o) * w rounded to `dtype`, times silu(z) in fp32, rounded again (GatedRMSNorm's rounding)."""
    h = o.to(dtype).float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    h = (weight * h).float()
    return (h * F.silu(z.float())).to(dtype)


def _norm_rope(x, scale, eps: float, cos, sin):
    """Per head (x (N, H, D)): the zero-centred RMSNorm, then rotary embedding of the first r channels
    (cos, sin (N, r) in apply_rotary's form: rotate_half's sign in sin)."""
    h = _rms_norm(x, scale, eps)
    r = cos.shape[-1]
    rot = h[..., :r]
    swapped = torch.cat([rot[..., r // 2:], rot[..., :r // 2]], dim=-1)
    turned = (rot * cos[:, None] + swapped * sin[:, None]).to(x.dtype)
    return torch.cat([turned, h[..., r:]], dim=-1) if r < x.shape[-1] else turned


def _sigmoid_mul(o, gate):
    return o * torch.sigmoid(gate)


def _grouped_gated_norm(y, gate, weight, eps: float):
    """Nemotron-H's gated norm (y (N, G, S), gate (N, G * S)): y * silu(gate) in fp32, RMS-normalised per
    group of S channels, rounded to y's dtype, times the weight."""
    N, G, S = y.shape
    h = F.silu(gate.float()).view(N, G, S) * y
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(y.dtype)
    return weight * h.reshape(N, G * S)


def _moe_combine(y, inverse, top_w, acc: torch.dtype):
    """sum_j top_w[t, j] * y[inverse[t, j]] in `acc`, rounded to y's dtype: each token's k expert rows
    gathered from the expert-sorted output, weighted and summed in one pass (no unsorted copy of y and
    no (N, k, H) product in memory)."""
    return (y[inverse].to(acc) * top_w[..., None].to(acc)).sum(1).to(y.dtype)


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """t (..., D) as (N, D): one dynamic dim for the region, whatever the batch and token dims."""
    return t.reshape(-1, t.shape[-1])


def rms_norm(x, scale, eps: float):
    """x (..., H) -> RMSNorm(x) * scale (fp32 scale: 1 + w), in x's dtype."""
    return _region(_rms_norm, _tokens(x), scale, eps).view(x.shape)


def add_rms_norm(x, y, scale, eps: float):
    """(x + y, RMSNorm(x + y) * scale), both in x's dtype and shape."""
    s, h = _region(_add_rms_norm, _tokens(x), _tokens(y), scale, eps)
    return s.view(x.shape), h.view(x.shape)


def silu_mul(gate, up):
    """silu(gate) * up (same shapes; strided views of one packed GEMM output are read in place)."""
    return _region(_silu_mul, _tokens(gate), _tokens(up)).view(gate.shape)


def norm_rope(x, scale, eps: float, cos, sin):
    """Attention's q or k (B, T, H, D, may be a strided view): per-head zero-centred RMSNorm then rotary
    embedding (cos, sin (B, T, r) from rotary_cos_sin), in x's dtype."""
    B, T, H, D = x.shape
    flat = lambda t: t.reshape(B * T, t.shape[-1])  # noqa: E731
    return _region(_norm_rope, x.reshape(B * T, H, D), scale, eps, flat(cos), flat(sin)).view(x.shape)


def sigmoid_mul(o, gate):
    """o * sigmoid(gate), o and gate (B, T, H, D) (the gate may be a strided view)."""
    B, T, H, D = o.shape
    return _region(_sigmoid_mul, o.reshape(B * T, H, D), gate.reshape(B * T, H, D)).view(o.shape)


def gated_norm(o, z, weight, eps: float, dtype: torch.dtype):
    """GatedRMSNorm(o.to(dtype), z), per head: o, z (B, T, Hv, V) (z may be a strided view), weight (V,)."""
    B, T, Hv, V = z.shape
    return _region(_gated_norm, o.reshape(B * T, Hv, V), z.reshape(B * T, Hv, V), weight, eps, dtype).view(z.shape)


def activation(fn, x):
    """fn(x) for an elementwise activation `fn` (a plain function: relu², SiLU...), x (..., D) of any
    strides; one compilation per function."""
    return _region(fn, _tokens(x)).view(x.shape)


def moe_combine(y, order, top_w, acc: torch.dtype):
    """The routed experts' output: y (N * k, H) holds the rows of the token-expert pairs sorted by expert
    (pair i of the sort is pair order[i] = token * k + j), top_w (N, k) their weights. Returns (N, H) in
    y's dtype, summed in `acc` (kvbuffer.models.layers.route_to_experts)."""
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
    return _region(_moe_combine, y, inverse.view(top_w.shape), top_w, acc)


def grouped_gated_norm(y, gate, weight, eps: float):
    """Nemotron-H's GroupedGatedRMSNorm: y (B, T, G, S), gate (B, T, G * S) (may be a strided view),
    weight (G * S,) -> (B, T, G * S)."""
    B, T, G, S = y.shape
    return _region(_grouped_gated_norm, y.reshape(B * T, G, S), gate.reshape(B * T, G * S), weight,
                   eps).view(B, T, G * S)
