"""Building blocks shared by the model families: norms, MLPs, mixture of experts, rotary embedding.

Attribute names follow transformers' so that checkpoint tensor names map one to one, except
where projections of one input are packed into one GEMM (PackedLinear: the loader packs the
checkpoint's tensors, kvbuffer.models.loader.checkpoint_tensors names them back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import launch
from ..reference.experts import grouped_matmul
from . import fused


def rms_normalize(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x / rms(x) over the last dim, times an optional weight, computed in fp32 and returned in x's dtype.

    On CUDA one fused kernel (F.rms_norm) instead of six elementwise launches: a decode step runs
    ~65 norms, and at serving batches such small launches, not the math, are what a step pays for.
    The kernel accumulates in fp32 and rounds once at the end, so where x and the weight share a
    dtype it reads x as it is (bf16 too): bit for bit what the fp32 detour gives, without the two
    casts. (A weight of another dtype cannot go to the fused kernel with x: then x goes in fp32.)
    Elsewhere transformers' formula, op for op (the CPU tests match transformers to 1e-4).
    """
    if x.is_cuda:
        if weight is None or weight.dtype == x.dtype:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h if weight is None else h * weight).to(x.dtype)  # a bf16 weight multiplies in fp32


def derived(module: nn.Module, name: str, source: torch.Tensor, make) -> torch.Tensor:
    """make(source), kept on `module` until `source` changes (an in-place write, a cast or a move):
    parameters a step needs in another form (fp32, 1 + w) then cost no launch per step. The kept
    entry holds `source`'s storage, so a new tensor at the same address is another storage only
    if its version differs. Not kept where autograd records (a kept tensor would cut the graph), nor
    under torch.compile."""
    if (torch.is_grad_enabled() and source.requires_grad) or torch.compiler.is_compiling():
        return make(source)  # compiled: fused into its consumer, no launch of its own (and no data_ptr guard)
    hit = module.__dict__.get(name)
    if hit is None or hit[0].data_ptr() != source.data_ptr() or hit[1] != source._version \
            or hit[0].dtype != source.dtype or hit[0].shape != source.shape:
        src = source.detach()
        hit = module.__dict__[name] = (src, source._version, make(src))
    return hit[2]


def fp32(module: nn.Module, name: str) -> torch.Tensor:
    """Parameter `name` of `module` in fp32 (itself when it is), kept across steps."""
    return derived(module, "_fp32_" + name, getattr(module, name), lambda p: p.float())


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; `zero_centered` scales by (1 + w) as Qwen3.5's decoder norms do."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x):
        if self.zero_centered:
            return rms_normalize(x, self.eps, self.scale())
        return self.weight * rms_normalize(x, self.eps)

    def scale(self) -> torch.Tensor:
        """A zero-centred norm's scale: 1 + w in fp32, as transformers computes it (bf16 would round it)."""
        return derived(self, "_scale", self.weight, lambda w: 1.0 + w.float())


class GatedRMSNorm(nn.Module):
    """norm(x) * w * silu(gate): the gated norm on a linear-attention layer's output (not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        h = self.weight * rms_normalize(x, self.eps)  # in x's dtype, as transformers rounds it
        # the fp32 product rounded to x's dtype as it is stored into h: what .to(x.dtype) of it gives,
        # without writing and reading the fp32 product
        return h.mul_(F.silu(gate.float()))


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, one_row: bool) -> torch.Tensor:
    """F.linear(x, weight, bias); with `one_row` (set by the engine where the kernel is built), a
    forward of one token without bias runs on the one-row kernel (torch.ops.kvbuffer.gemv), which
    streams the weight faster than torch's GEMM does at one row: a B = 1 decode step is four fifths
    projections. The same product to the output's rounding (fp32 accumulation in another order)."""
    if one_row and bias is None and x.numel() == x.shape[-1] and x.dtype == weight.dtype:
        y = launch.engine_rows("gemv", x.reshape(1, -1).contiguous(), weight)
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose one-token forward may run on the one-row kernel (`project`); the engine sets
    `one_row` where that kernel loads (kvbuffer.engine.one_row)."""

    one_row = False

    def forward(self, x):
        return project(x, self.weight, self.bias, self.one_row)


def one_row_linears(model: nn.Module) -> list[nn.Module]:
    """The projections that can run on the one-row kernel: every Linear and PackedLinear without bias."""
    return [m for m in model.modules() if isinstance(m, (Linear, PackedLinear)) and m.bias is None]


class PackedLinear(nn.Module):
    """Projections of one input packed into one GEMM, its output split on the last dim (views).

    Checkpoints keep the projections apart, as sibling tensors named by `parts` (q_proj, k_proj,
    v_proj); the loader concatenates them (kvbuffer.models.loader). One GEMM instead of several saves
    launches and lets the GEMM use wider tiles; in a Gated DeltaNet layer it takes the 32-wide b
    and a projections, each a split-K GEMM with its own reduce, into the big one. Serving stacks pack
    the same way (vLLM's QKVParallelLinear, MergedColumnParallelLinear). `one_row`: as Linear's."""

    one_row = False

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.parts, self.sizes = tuple(parts), tuple(parts.values())
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(self.sizes))) if bias else None
        bound = in_features ** -0.5  # nn.Linear's default init, part by part alike
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x) -> tuple[torch.Tensor, ...]:
        return torch.split(project(x, self.weight, self.bias, self.one_row), self.sizes, dim=-1)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, hidden: int, intermediate: int, act=F.silu):
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.act = act

    def forward(self, x, fuse: bool = False):
        """fuse: SiLU and the product as one compiled region (kvbuffer.models.fused; ForwardBatch.fuse)."""
        gate, up = self.gate_up_proj(x)
        if fuse and self.act is F.silu:
            return self.down_proj(fused.silu_mul(gate, up))
        return self.down_proj(self.act(gate) * up)


def route_to_experts(x, top_idx, top_w, first, down, act, accumulate_dtype=None, one_row=False, grouped=0,
                     fuse: bool = False):
    """Mixture-of-experts dispatch: each token through its top-k experts, weighted and summed.

    first (E, O, H) and down (E, H, I) are the experts' stacked weights; `act` maps the first
    matmul's output (..., O) to the down matmul's input (..., I) (gated: silu(gate) * up). Tokens are
    sorted by expert so each matmul is one grouped matmul over all experts: in a forward of up to
    `grouped` tokens (the engine sets kvbuffer.engine.one_row.GROUPED_TOKENS where the kernel is
    built; 0: never) kvbuffer's grouped experts kernel (torch.ops.kvbuffer.grouped_experts), else
    torch._grouped_mm where it serves the dtype, else a loop over the experts that got tokens
    (kvbuffer.reference.experts). Contributions are summed in
    `accumulate_dtype` (default x's). A forward of 1 to `one_row` tokens (the engine sets
    kvbuffer.engine.one_row.EXPERT_TOKENS where the kernel is built; 0 or False: never) takes
    `experts_by_row` instead. `fuse` (a long prompt's chunk: ForwardBatch.fuse): the weighted sum as one
    compiled region (kvbuffer.models.fused.moe_combine).
    """
    if one_row and 0 < x.shape[0] <= one_row and x.dtype == first.dtype == down.dtype:
        return experts_by_row(x, top_idx, top_w, first, down, act, accumulate_dtype)
    E, k = first.shape[0], top_idx.shape[1]
    # the expert ids as the narrowest integers that hold them: a radix sort's passes scale with the key's
    # bits, and topk's int64 ids made the sort a visible share of a MoE step at large batch
    ids = torch.int16 if E <= torch.iinfo(torch.int16).max else torch.int32
    experts, order = torch.sort(top_idx.reshape(-1).to(ids), stable=True)
    # where each expert's rows end: one search of the sorted ids (not torch.bincount: on CUDA it
    # reads the largest id back to the host to size its output)
    offs = torch.searchsorted(experts, torch.arange(1, E + 1, device=x.device, dtype=ids), out_int32=True)
    token_of = order // k
    if grouped and x.shape[0] <= grouped and x.dtype == first.dtype == down.dtype:
        h = act(launch.engine_rows("grouped_experts", x[token_of], first, offs))
        y = launch.engine_rows("grouped_experts", h.contiguous(), down, offs)
    else:
        y = grouped_matmul(act(grouped_matmul(x[token_of], first, offs)), down, offs)
    acc = accumulate_dtype or x.dtype
    if fuse:
        return fused.moe_combine(y, order, top_w, acc)
    if x.is_cuda:  # each token's k rows back in place, weighted and summed: no atomics, deterministic
        y = y.new_empty(y.shape).index_copy_(0, order, y).view(*top_idx.shape, -1) * top_w[..., None]
        return y.sum(1, dtype=acc).to(x.dtype)
    # index_put_ with accumulate: index_add_'s CPU kernel is slow on a busy machine
    y = y * top_w.reshape(-1)[order, None]
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    out.index_put_((token_of,), y.to(out.dtype), accumulate=True)
    return out.to(x.dtype)


def experts_by_row(x, top_idx, top_w, first, down, act, accumulate_dtype=None):
    """route_to_experts for a few tokens, each through its k experts on the one-row experts kernel
    (torch.ops.kvbuffer.gemv_experts): each chosen expert's weights streamed once per token that chose
    it, no sort, gather or grouped-matmul set-up in front; the same sum to the output's rounding (fp32
    accumulation in another order). Why and where it beats the grouped matmul: docs/kernels.md,
    "Routed experts at a few tokens"."""
    S, k = top_idx.shape
    top_idx = top_idx.to(torch.int64).contiguous()  # the kernel's id dtype (topk's already: no copy)
    h = act(launch.engine_rows("gemv_experts", x.contiguous(), first, top_idx))
    y = launch.engine_rows("gemv_experts", h.reshape(S * k, h.shape[-1]).contiguous(), down,
                           top_idx.reshape(S * k, 1))
    y = y.view(S, k, y.shape[-1]) * top_w[..., None]
    return y.sum(1, dtype=accumulate_dtype or x.dtype).to(x.dtype)


class RoutedExperts(nn.Module):
    """A model's routed experts as stacked weights (`expert_weights`: the first matmul's (E, O, H) and
    the down matmul's (E, H, I)) with the activation between them (`activate`: (..., O) -> (..., I)).
    `one_row`: the most tokens a forward may have to run on the experts kernel (route_to_experts); the
    engine sets it (kvbuffer.engine.one_row.EXPERT_TOKENS) where that kernel is built. `grouped`: the
    most tokens a forward may have to run on the grouped experts kernel (the engine sets
    GROUPED_TOKENS where it is built); 0: none."""

    one_row = False
    grouped = 0

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def activate(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def one_row_experts(model: nn.Module) -> list[RoutedExperts]:
    """The routed experts, whose forwards can run on the experts kernels (the one-row experts kernel at a
    few tokens, the grouped one at more: kvbuffer.engine.one_row)."""
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


class Experts(RoutedExperts):
    """Gated routed experts as 3-D tensors: gate_up_proj (E, 2I, H), down_proj (E, H, I)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act=F.silu):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = act

    def expert_weights(self):
        return self.gate_up_proj, self.down_proj

    def activate(self, y):
        gate, up = y.chunk(2, dim=-1)
        return self.act(gate) * up

    def forward(self, x, top_idx, top_w, fuse: bool = False):
        """x (N, H); top_idx, top_w (N, k); fuse: route_to_experts', and SiLU's product as a region."""
        act = self.activate
        if fuse and self.act is F.silu:
            act = lambda y: fused.silu_mul(*y.chunk(2, dim=-1))  # noqa: E731
        return route_to_experts(x, top_idx, top_w.to(x.dtype), self.gate_up_proj, self.down_proj, act,
                                one_row=self.one_row, grouped=self.grouped, fuse=fuse)


class SoftmaxTopKMoE(nn.Module):
    """Qwen3.5-MoE / Qwen3-Next sparse block: softmax router, top-k, shared expert behind a sigmoid gate."""

    def __init__(self, hidden, num_experts, top_k, intermediate, shared_intermediate, norm_topk_prob=True):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.shared_expert = GatedMLP(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x, fuse: bool = False):
        """fuse: the routed experts' activation and weighted sum as compiled regions (kvbuffer.models.fused)."""
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        y = self.experts(h, top_idx, top_w.to(h.dtype), fuse=fuse)
        y = y + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h, fuse=fuse)
        return y.reshape(shape)


def rotary_cos_sin(positions, rotary_dim: int, theta: float, dtype):
    """cos, sin of shape (B, T, rotary_dim) for the half-split (rotate_half) convention, with the
    sign of rotate_half folded into sin's first half ([-sin, sin]): apply_rotary's form of them.
    A forward computes them once for all its attention layers."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=positions.device) / rotary_dim))
    freqs = positions[..., None].float() * inv_freq
    c, s = freqs.cos(), freqs.sin()
    return torch.cat([c, c], dim=-1).to(dtype), torch.cat([-s, s], dim=-1).to(dtype)


def apply_rotary(x, cos, sin, in_place: bool = False):
    """Rotate the first rotary_dim channels of x (B, T, H, D); the rest pass through (partial rotary).

    x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]: the sign sits in `sin`
    (rotary_cos_sin), which is bit for bit the same product, one negation fewer per call.
    in_place: the rotated channels are written into x (a tensor the caller owns), which is returned:
    under partial rotary the channels that pass through are then not copied."""
    r = cos.shape[-1]
    rot, half = x[..., :r], r // 2
    swapped = torch.cat([rot[..., half:], rot[..., :half]], dim=-1)
    turned = rot * cos[:, :, None] + swapped * sin[:, :, None]
    if r == x.shape[-1]:
        return turned
    if in_place:
        x[..., :r].copy_(turned)
        return x
    return torch.cat([turned, x[..., r:]], dim=-1)


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
