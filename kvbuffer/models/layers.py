"""Building blocks shared by the model families: norms, MLPs, mixture of experts, rotary embedding.

Attribute names follow transformers' so that checkpoint tensor names map one to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; `zero_centered` scales by (1 + w) as Qwen3.5's decoder norms do."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).type_as(x)
        return self.weight * h.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """norm(x) * w * silu(gate): the gated norm on a linear-attention layer's output (not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
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


class Experts(nn.Module):
    """Routed experts stored as 3-D tensors: gate_up_proj (E, 2I, H), down_proj (E, H, I).

    Tokens are sorted by expert and each expert runs one matmul over its tokens: a grouped matmul
    (on the GPU the per-expert loop is over experts actually hit, not over tokens).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act=F.silu):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = act

    def forward(self, x, top_idx, top_w):
        """x (N, H); top_idx, top_w (N, k)."""
        out = torch.zeros_like(x)
        flat = top_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // top_idx.shape[1]
        weight_of = top_w.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            tok = token_of[start:start + n]
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[e])
            out.index_add_(0, tok, (y * weight_of[start:start + n, None]).to(out.dtype))
            start += n
        return out


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
