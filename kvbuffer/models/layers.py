"""Building blocks shared by the model families: norms, MLPs, mixture of experts, rotary embedding.

Attribute names follow transformers' so that checkpoint tensor names map one to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x / rms(x) over the last dim in fp32, times an optional fp32 weight.

    On CUDA one fused kernel (F.rms_norm) instead of six elementwise launches: a decode step runs
    ~65 norms, and at serving batches such small launches, not the math, are what a step pays for.
    Elsewhere transformers' formula, op for op (the CPU tests match transformers to 1e-4)."""
    h = x.float()
    if h.is_cuda:
        return F.rms_norm(h, (h.shape[-1],), weight, eps)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h if weight is None else h * weight


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; `zero_centered` scales by (1 + w) as Qwen3.5's decoder norms do."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x):
        if self.zero_centered:
            return rms_normalize(x, self.eps, 1.0 + self.weight.float()).type_as(x)
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """norm(x) * w * silu(gate): the gated norm on a linear-attention layer's output (not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        h = self.weight * rms_normalize(x, self.eps).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, act=F.silu):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = act

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _grouped_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's grouped matmul serves bf16 on CUDA and fp32/bf16 on CPU, with every row 16-byte
    aligned; anything else loops over the experts."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    if x.dtype not in ((torch.bfloat16,) if x.is_cuda else (torch.float32, torch.bfloat16)):
        return False
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], w.shape[1], w.shape[2]))


def _per_expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert (counts[e] consecutive rows each) times w[e]^T: (M, O) for w (E, O, H).

    The grouped matmul reads the offsets on the device; only the fallback loop needs the counts on
    the host (a sync, so that path cannot be captured in a CUDA graph).
    """
    if _grouped_ok(x, w):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    parts, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            parts.append(F.linear(x[start:start + n], w[e]))
        start += n
    return torch.cat(parts) if parts else x.new_zeros((0, w.shape[1]))


def route_to_experts(x, top_idx, top_w, first, down, act, accumulate_dtype=None):
    """Mixture-of-experts dispatch: each token through its top-k experts, weighted and summed.

    first (E, O, H) and down (E, H, I) are the experts' stacked weights; `act` maps the first
    matmul's output (M, O) to the down matmul's input (M, I) (gated: silu(gate) * up). Tokens are
    sorted by expert so each matmul is one grouped matmul over all experts (torch._grouped_mm where
    it serves the dtype, else a loop over the experts that got tokens). Contributions are summed in
    `accumulate_dtype` (default x's).
    """
    E = first.shape[0]
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # not torch.bincount: on CUDA it reads the largest id back to the host to size its output
    counts = torch.zeros(E, dtype=torch.long, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    token_of = order // top_idx.shape[1]
    xs = x[token_of]
    y = _per_expert_matmul(act(_per_expert_matmul(xs, first, counts, offs)), down, counts, offs)
    y = y * top_w.reshape(-1)[order, None]
    out = torch.zeros(x.shape, dtype=accumulate_dtype or x.dtype, device=x.device)
    if x.is_cuda:  # atomic adds, no sort and no host sync
        out.index_add_(0, token_of, y.to(out.dtype))
    else:  # index_put_ with accumulate: index_add_'s CPU kernel is slow on a busy machine
        out.index_put_((token_of,), y.to(out.dtype), accumulate=True)
    return out.to(x.dtype)


class Experts(nn.Module):
    """Gated routed experts as 3-D tensors: gate_up_proj (E, 2I, H), down_proj (E, H, I)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act=F.silu):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = act

    def _gated(self, y):
        gate, up = y.chunk(2, dim=-1)
        return self.act(gate) * up

    def forward(self, x, top_idx, top_w):
        """x (N, H); top_idx, top_w (N, k)."""
        return route_to_experts(x, top_idx, top_w.to(x.dtype), self.gate_up_proj, self.down_proj, self._gated)


class SoftmaxTopKMoE(nn.Module):
    """Qwen3.5-MoE / Qwen3-Next sparse block: softmax router, top-k, shared expert behind a sigmoid gate."""

    def __init__(self, hidden, num_experts, top_k, intermediate, shared_intermediate, norm_topk_prob=True):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.shared_expert = GatedMLP(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        y = self.experts(h, top_idx, top_w.to(h.dtype))
        y = y + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return y.reshape(shape)


def rotary_cos_sin(positions, rotary_dim: int, theta: float, dtype):
    """cos, sin of shape (B, T, rotary_dim) for the half-split (rotate_half) convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=positions.device) / rotary_dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x, cos, sin):
    """Rotate the first rotary_dim channels of x (B, T, H, D); the rest pass through (partial rotary)."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    rot = rot * cos[:, :, None] + rotated * sin[:, :, None]
    return torch.cat([rot, rest], dim=-1)


def cache_layout(layer_types) -> list[tuple[str, int] | None]:
    """Per transformers layer: ("linear", pool layer index), ("attention", KV layer index) or None.

    Linear-attention layers index the state/buffer/conv pools in order of appearance, attention
    layers the KV cache; MLP-only layers hold no cache.
    """
    out, counts = [], {"linear": 0, "attention": 0}
    for kind in layer_types:
        where = {"linear_attention": "linear", "full_attention": "attention"}.get(kind)
        out.append(None if where is None else (where, counts[where]))
        if where is not None:
            counts[where] += 1
    return out
