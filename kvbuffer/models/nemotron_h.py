"""Nemotron-H / Nemotron-3 (`model_type: nemotron_h`): a stack of single-mixer blocks.

Each block is `x + mixer(norm(x))` with one mixer chosen by the layer pattern: Mamba-2 ('M'),
attention without rotary embedding ('*'), a relu^2 MLP ('-') or a routed relu^2 MoE ('E', sigmoid
router with a score-correction bias and group-limited top-k, one shared expert, optional latent
projection as in Nemotron-3 Super). Module names follow transformers' (checkpoints store the
backbone as `backbone.*`), so the weights load one to one.

Deviation from transformers, on purpose: no dt floor. transformers clamps dt to `time_step_min`
in its chunked prefill only (its single-token decode applies none), so its own two paths disagree
for small dt; kvbuffer uses one rule everywhere (see kvbuffer.reference.gating.mamba2_front).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from ..pools import LinearLayerShape
from ..runtime import mixing
from . import fused
from .config_fields import ConfigFields
from .layers import Linear, PackedLinear, RoutedExperts, cache_layout, fp32, rms_normalize, route_to_experts

MODEL_TYPES = ("nemotron_h",)

# hybrid_override_pattern characters, and the legacy layer-type names older config.json files use
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


def _relu2(x):
    return torch.square(F.relu(x))


_ACTIVATIONS = {"relu2": _relu2, "silu": F.silu, "relu": F.relu, "gelu": F.gelu}


def _unsupported(message: str):
    return CheckpointError(f"nemotron_h: {message}")


def _layer_types(f: ConfigFields) -> tuple[str, ...]:
    """`layers_block_type` (or `layer_types`), else `hybrid_override_pattern`, as layer types;
    `num_hidden_layers`, when given, must be their number."""
    key = "layers_block_type" if f.has("layers_block_type") else "layer_types" if f.has("layer_types") else None
    if key is None:
        pattern = f.raw("hybrid_override_pattern")
        if not isinstance(pattern, str) or not 1 <= len(pattern) <= 4096:
            raise f.error("hybrid_override_pattern", "a string of 1 to 4096 layer characters", pattern)
        bad = sorted(set(pattern) - set(_PATTERN))
        if bad:
            raise _unsupported(f"hybrid_override_pattern has unknown layer characters {bad}")
        f.layer_count(len(pattern), "hybrid_override_pattern")
        return tuple(_PATTERN[ch] for ch in pattern)
    types = f.str_list(key, set(_PATTERN.values()) | set(_LEGACY))
    f.layer_count(len(types), key)
    return tuple(_LEGACY.get(t, t) for t in types)


def _mtp_layer_types(f: ConfigFields) -> tuple[str, ...]:
    """The MTP head's block kinds: `mtp_layers_block_type`, or vLLM's `mtp_hybrid_override_pattern`."""
    supported = {"full_attention", "moe", "mlp"}
    if f.has("mtp_layers_block_type"):
        return tuple(_LEGACY.get(t, t) for t in f.str_list("mtp_layers_block_type", supported | {"attention"}))
    pattern = f.raw("mtp_hybrid_override_pattern", "*E")
    if not isinstance(pattern, str) or not 1 <= len(pattern) <= 64:
        raise f.error("mtp_hybrid_override_pattern", "a string of 1 to 64 layer characters", pattern)
    types = tuple(_PATTERN.get(ch, ch) for ch in pattern)
    bad = sorted(set(types) - supported)
    if bad:
        raise _unsupported(f"MTP layers of kinds {bad} are not supported (attention, MoE and MLP blocks are)")
    return types


@dataclass(frozen=True)
class NemotronHConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" | "mlp" | "moe"
    layer_norm_epsilon: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    # attention (no rotary embedding)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # Mamba-2
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool  # in_proj / out_proj of the Mamba mixer
    # MLP and MoE
    intermediate_size: int
    mlp_hidden_act: str
    mlp_bias: bool
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ("full_attention", "moe")  # the MTP head's blocks (Nemotron-3 Super)

    @classmethod
    def from_hf(cls, d: dict) -> "NemotronHConfig":
        """Build from a config.json dict; absent optional fields take transformers' defaults. Every
        field is read through ConfigFields: a bad one is a CheckpointError naming it."""
        f = ConfigFields(d)
        vocab, H, n_heads = f.int("vocab_size"), f.int("hidden_size"), f.int("num_attention_heads")
        if not f.has("head_dim") and H < n_heads:
            raise f.error("hidden_size", f"at least num_attention_heads ({n_heads}) when head_dim is not given", H)
        mamba_heads = f.int("mamba_num_heads")
        f.choice("mamba_hidden_act", ("silu",), "silu")  # the runtime's short conv applies SiLU
        mlp_act = f.choice("mlp_hidden_act", _ACTIVATIONS, "relu2")
        return cls(
            model_type=f.choice("model_type", MODEL_TYPES, "nemotron_h"),
            vocab_size=vocab,
            hidden_size=H,
            layer_types=_layer_types(f),
            layer_norm_epsilon=f.float("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=f.bool("tie_word_embeddings", False),
            eos_token_ids=f.ids("eos_token_id", vocab, () if "eos_token_id" in d or vocab <= 2 else (2,)),
            num_attention_heads=n_heads,
            num_key_value_heads=_divisor(f, "num_key_value_heads", n_heads, n_heads, "num_attention_heads"),
            head_dim=f.int("head_dim", H // n_heads),
            mamba_num_heads=mamba_heads,
            mamba_head_dim=f.int("mamba_head_dim"),
            ssm_state_size=f.int("ssm_state_size", 128),
            n_groups=_divisor(f, "n_groups", f.int("mamba_n_groups", 8), mamba_heads, "mamba_num_heads"),
            conv_kernel=f.int("conv_kernel", f.int("mamba_d_conv", 4)),
            use_conv_bias=f.bool("use_conv_bias", f.bool("mamba_conv_bias", True)),
            use_bias=f.bool("use_bias", False),
            intermediate_size=f.int("intermediate_size", 21504),
            mlp_hidden_act=mlp_act,
            mlp_bias=f.bool("mlp_bias", False),
            n_routed_experts=f.int("n_routed_experts", 8),
            num_experts_per_tok=f.int("num_experts_per_tok", 2),
            moe_intermediate_size=f.int("moe_intermediate_size", 7688),
            moe_shared_expert_intermediate_size=f.int("moe_shared_expert_intermediate_size", 7688),
            moe_latent_size=f.int("moe_latent_size", None),
            n_group=f.int("n_group", 1),
            topk_group=f.int("topk_group", 1),
            norm_topk_prob=f.bool("norm_topk_prob", True),
            routed_scaling_factor=f.float("routed_scaling_factor", 1.0),
            num_nextn_predict_layers=f.int("num_nextn_predict_layers", 0, lo=0, hi=64),
            mtp_layer_types=_mtp_layer_types(f),
        ).checked(f)

    def checked(self, f: ConfigFields) -> "NemotronHConfig":
        """Refuse what each field allows alone but the routed experts cannot run together (only
        when a block routes: dense models' files need not state consistent MoE fields)."""
        routes = "moe" in self.layer_types or (self.num_nextn_predict_layers and "moe" in self.mtp_layer_types)
        if not routes:
            return self
        E, G = self.n_routed_experts, self.n_group
        if E % G:
            raise _unsupported(f"n_routed_experts={E} is not a multiple of n_group={G}")
        if self.topk_group > G:
            raise f.error("topk_group", f"at most n_group ({G})", self.topk_group)
        if self.num_experts_per_tok > self.topk_group * (E // G):
            raise f.error("num_experts_per_tok", f"at most the {self.topk_group * (E // G)} experts of the "
                          "topk_group groups a token may route to", self.num_experts_per_tok)
        return self

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: x, then B and C for every group."""
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def linear_shape(self) -> LinearLayerShape:
        return LinearLayerShape(self.n_groups, self.mamba_num_heads, self.ssm_state_size, self.mamba_head_dim,
                                delta_rule=False)


class RMSNorm(nn.Module):
    """transformers' NemotronHRMSNorm: the weight multiplies in fp32, then the result is cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_normalize(x, self.eps, self.weight)  # a bf16 weight multiplies in fp32 all the same


class GroupedGatedRMSNorm(nn.Module):
    """y * silu(z), then RMS-normalised per group of `group_size` channels (gate before norm)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.eps, self.group_size = eps, group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y, gate):
        h = F.silu(gate.float()) * y  # y promoted to fp32 inside the product: one launch fewer
        g = rms_normalize(h.view(*h.shape[:-1], -1, self.group_size), self.eps)
        return self.weight * g.view(h.shape).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """in_proj -> [gate | x B C | dt] -> short conv + SiLU -> Mamba-2 SSM (buffered or recurrent) -> gated norm."""

    def __init__(self, cfg: NemotronHConfig, linear_index: int):
        super().__init__()
        self.cfg, self.linear_index = cfg, linear_index
        Hm, D, I = cfg.mamba_num_heads, cfg.conv_dim, cfg.mamba_intermediate
        self.in_proj = Linear(cfg.hidden_size, I + D + Hm, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(D, D, cfg.conv_kernel, groups=D, bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(Hm))
        self.A_log = nn.Parameter(torch.zeros(Hm))
        self.D = nn.Parameter(torch.ones(Hm))
        self.norm = GroupedGatedRMSNorm(I, I // cfg.n_groups, cfg.layer_norm_epsilon)
        self.out_proj = Linear(I, cfg.hidden_size, bias=cfg.use_bias)

    def forward(self, h, batch, caches):
        c = self.cfg
        Bt, T, _ = h.shape
        I, G, N = c.mamba_intermediate, c.n_groups, c.ssm_state_size
        gate, xbc, dt = torch.split(self.in_proj(h), [I, c.conv_dim, c.mamba_num_heads], dim=-1)
        xbc = mixing.short_conv(xbc, self.conv1d.weight[:, 0], self.conv1d.bias, batch, caches, self.linear_index)
        x, B, C = torch.split(xbc, [I, G * N, G * N], dim=-1)
        y = mixing.mamba2_mix(x.reshape(Bt, T, c.mamba_num_heads, c.mamba_head_dim), dt,
                              B.reshape(Bt, T, G, N), C.reshape(Bt, T, G, N),
                              fp32(self, "A_log"), fp32(self, "dt_bias"), fp32(self, "D"), batch, caches,
                              self.linear_index)
        if batch.fuse:
            n = self.norm
            y = fused.grouped_gated_norm(y.reshape(Bt, T, -1, n.group_size), gate, n.weight, n.eps)
        else:
            y = self.norm(y.reshape(Bt, T, I), gate)
        return self.out_proj(y.to(h.dtype))


class Attention(nn.Module):
    """Grouped-query attention with no positional encoding (Nemotron-H's attention layers use none)."""

    def __init__(self, cfg: NemotronHConfig, attn_index: int):
        super().__init__()
        self.cfg, self.attn_index = cfg, attn_index
        H, n, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = PackedLinear(H, {"q_proj": n * d, "k_proj": kv * d, "v_proj": kv * d})
        self.o_proj = Linear(n * d, H, bias=False)

    def forward(self, h, batch, caches):
        B, T, _ = h.shape
        d = self.cfg.head_dim
        q, k, v = (t.view(B, T, -1, d) for t in self.qkv_proj(h))
        o = mixing.attention(q, k, v, batch, caches, self.attn_index, d ** -0.5)
        return self.o_proj(o.reshape(B, T, -1))


class MLP(nn.Module):
    """down(act(up(x))): no gate projection."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool):
        super().__init__()
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = _ACTIVATIONS[act]

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


class UngatedExperts(RoutedExperts):
    """Routed experts as 3-D tensors: up_proj (E, I, H), down_proj (E, H, I); down(act(up(x))) each.

    Contributions accumulate in the routing weights' dtype (fp32), as transformers does.
    """

    def __init__(self, num_experts: int, dim: int, intermediate: int, act: str):
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, intermediate))
        self.act = _ACTIVATIONS[act]

    def expert_weights(self):
        return self.up_proj, self.down_proj

    def activate(self, y):
        return self.act(y)

    def forward(self, x, top_idx, top_w, fuse: bool = False):
        """x (N, dim); top_idx, top_w (N, k); fuse: route_to_experts', and the activation as a region."""
        act = (lambda y: fused.activation(self.act, y)) if fuse else self.activate
        return route_to_experts(x, top_idx, top_w, self.up_proj, self.down_proj, act,
                                accumulate_dtype=top_w.dtype, one_row=self.one_row,
                                grouped=self.grouped, fuse=fuse)


class TopKRouter(nn.Module):
    """Sigmoid scores; experts chosen by score + correction bias within the best `topk_group` groups.

    The weights are the uncorrected scores of the chosen experts (optionally renormalised), times
    `routed_scaling_factor`. Router parameters stay fp32 whatever dtype the model is cast to, as
    transformers keeps them (`_keep_in_fp32_modules_strict`).
    """

    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        # a buffer in transformers; a (frozen) parameter here so the loader checks it like every tensor
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for p in (self.weight, self.e_score_correction_bias):
            p.data = p.data.float()
        return self

    def forward(self, h):
        """h (N, hidden) -> (top_w (N, k) fp32, top_idx (N, k))."""
        c = self.cfg
        scores = F.linear(h.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        if c.topk_group < c.n_group:  # else every group is kept (Nemotron-3 Nano: one group): no mask to build
            choice = self._keep_best_groups(choice)
        top_idx = torch.topk(choice, k=c.num_experts_per_tok, dim=-1, sorted=False)[1]
        top_w = scores.gather(1, top_idx)
        if c.norm_topk_prob:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        return top_w * c.routed_scaling_factor, top_idx

    def _keep_best_groups(self, choice):
        """choice with the experts outside the `topk_group` best groups (by their top-2 sum) at -inf."""
        c = self.cfg
        E, G = c.n_routed_experts, c.n_group
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False)[1]
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, False)
        return choice.masked_fill(dropped[:, :, None].expand(-1, G, E // G).reshape(-1, E), float("-inf"))


class MoE(nn.Module):
    """Routed experts (through an optional latent projection) plus one always-on shared expert."""

    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        if cfg.n_routed_experts % cfg.n_group:
            raise _unsupported(f"n_routed_experts={cfg.n_routed_experts} is not a multiple of n_group={cfg.n_group}")
        dim = cfg.moe_latent_size or cfg.hidden_size
        self.gate = TopKRouter(cfg)
        self.experts = UngatedExperts(cfg.n_routed_experts, dim, cfg.moe_intermediate_size, cfg.mlp_hidden_act)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.mlp_hidden_act,
                                  cfg.mlp_bias)
        if cfg.moe_latent_size is not None:  # Nemotron-3 Super: experts work in a smaller latent space
            self.fc1_latent_proj = Linear(cfg.hidden_size, dim, bias=cfg.mlp_bias)
            self.fc2_latent_proj = Linear(dim, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x, fuse: bool = False):
        """fuse: the routed experts' activation and weighted sum as compiled regions (kvbuffer.models.fused)."""
        h = x.reshape(-1, x.shape[-1])
        top_w, top_idx = self.gate(h)
        latent = self.fc1_latent_proj(h) if hasattr(self, "fc1_latent_proj") else h
        y = self.experts(latent, top_idx, top_w, fuse=fuse)
        y = self.fc2_latent_proj(y) if hasattr(self, "fc2_latent_proj") else y
        return y.view(x.shape) + self.shared_experts(x)


class Block(nn.Module):
    """x + mixer(norm(x)); the mixer's kind is the layer's type."""

    def __init__(self, cfg: NemotronHConfig, i: int, linear_index: int, attn_index: int):
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if self.kind == "linear_attention":
            self.mixer = Mamba2Mixer(cfg, linear_index)
        elif self.kind == "full_attention":
            self.mixer = Attention(cfg, attn_index)
        elif self.kind == "moe":
            self.mixer = MoE(cfg)
        else:
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_hidden_act, cfg.mlp_bias)

    def forward(self, x, batch, caches):
        h = self.norm(x.to(self.norm.weight.dtype))
        if self.kind in ("linear_attention", "full_attention"):
            return x + self.mixer(h, batch, caches)
        return x + (self.mixer(h, fuse=batch.fuse) if self.kind == "moe" else self.mixer(h))


class Backbone(nn.Module):
    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers, n_lin, n_att = [], 0, 0
        for i, kind in enumerate(cfg.layer_types):
            layers.append(Block(cfg, i, n_lin, n_att))
            n_lin, n_att = n_lin + (kind == "linear_attention"), n_att + (kind == "full_attention")
        self.layers = nn.ModuleList(layers)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class NemotronHForCausalLM(nn.Module):
    """Token ids (B, T) + a ForwardBatch -> logits (B, T, vocab)."""

    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight

        self.mtp = None  # the multi-token-prediction head, attached when a checkpoint has one

    def embed(self, input_ids):
        return self.model.embeddings(input_ids)

    def forward(self, input_ids, batch, caches, return_hidden: bool = False, last_logits: bool = False):
        """Logits (B, T, vocab), or (B, 1, vocab) of each row's last token with last_logits (a prompt's
        forward: the vocabulary product and the logits tensor of every other position are not made);
        with return_hidden also the final-norm hidden states (B, T, hidden) the MTP head reads."""
        x = self.model.embeddings(input_ids)
        for layer in self.model.layers:
            x = layer(x, batch, caches)
        # a prompt's forward without return_hidden normalises only the last tokens (a norm is per token)
        h = self.model.norm_f(x[:, -1:] if last_logits and not return_hidden else x)
        logits = self.lm_head(h[:, -1:] if last_logits else h)
        return (logits, h) if return_hidden else logits

    def attach_mtp(self) -> None:
        """Add Nemotron-3 Super's MTP head (checkpoint tensors mtp.*); loaded with the rest."""
        self.mtp = MultiTokenPredictor(self.config)

    def cache_layout(self) -> list[tuple[str, int] | None]:
        return cache_layout(self.config.layer_types)

    def cache_geometry(self) -> dict:
        """What the engine needs to size the pools and the KV cache."""
        c = self.config
        return dict(linear_shape=c.linear_shape, num_linear_layers=c.layer_types.count("linear_attention"),
                    conv_dim=c.conv_dim, conv_width=c.conv_kernel,
                    num_attention_layers=c.layer_types.count("full_attention"),
                    num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Published Nemotron-H files store the backbone as `backbone.*` (transformers renames it `model.*`)."""
        for prefix in ("language_model.", "backbone.mtp.", "model.mtp."):
            if name.startswith(prefix):
                name = ("mtp." if prefix != "language_model." else "") + name[len(prefix):]
        if name.startswith("backbone."):
            return "model." + name[len("backbone."):]
        return name

    @staticmethod
    def skip_checkpoint_tensor(name: str) -> bool:
        return False


class MTPBlock(Block):
    """A block of the MTP head: the first also fuses the token embedding with the target's hidden
    state (enorm, hnorm, eh_proj), the last ends with final_layernorm (vLLM's checkpoint layout)."""

    def __init__(self, cfg: NemotronHConfig, i: int, attn_index: int, first: bool, last: bool):
        super().__init__(cfg, i, 0, attn_index)
        H, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        if first:
            self.enorm, self.hnorm = RMSNorm(H, eps), RMSNorm(H, eps)
            self.eh_proj = Linear(2 * H, H, bias=False)
        if last:
            self.final_layernorm = RMSNorm(H, eps)


class MultiTokenPredictor(nn.Module):
    """Nemotron-3 Super's MTP head: fuse(embedding of t+1, hidden at t) -> its blocks -> final norm.

    Its attention blocks have their own KV cache (attention layer indices count from 0 here).
    """

    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        import dataclasses

        types = cfg.mtp_layer_types
        mcfg = dataclasses.replace(cfg, layer_types=types)
        attn = [sum(t == "full_attention" for t in types[:i]) for i in range(len(types))]
        self.layers = nn.ModuleList(MTPBlock(mcfg, i, attn[i], i == 0, i == len(types) - 1)
                                    for i in range(len(types)))
        self.num_attention_layers = types.count("full_attention")

    def forward(self, embeds, hidden, batch, caches):
        first = self.layers[0]
        x = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(hidden)], dim=-1))
        for layer in self.layers:
            x = layer(x, batch, caches)
        return self.layers[-1].final_layernorm(x)


def _divisor(f: ConfigFields, key: str, default: int, of: int, of_key: str) -> int:
    """A head or group count that divides `of` (heads in one group share it)."""
    value = f.int(key, default)
    if of % value:
        raise f.error(key, f"a divisor of {of_key} ({of})", value)
    return value
