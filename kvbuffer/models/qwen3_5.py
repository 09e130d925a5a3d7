"""Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet layers, gated full attention every few layers.

One implementation serves the three model types; they differ only in how the linear layer's input
projections are packed (Qwen3-Next fuses them per key-head group) and in dense vs MoE MLPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..pools import LinearLayerShape
from ..runtime import mixing
from . import fused
from .config_fields import ConfigFields
from .layers import (GatedMLP, GatedRMSNorm, Linear, PackedLinear, RMSNorm, SoftmaxTopKMoE, apply_rotary, cache_layout, fp32,
                     rotary_cos_sin)
from .mtp import MultiTokenPredictor, mtp_layer_config

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
ACTIVATIONS = ("silu", "swish")  # transformers' names of the SiLU that the MLPs and experts apply


@dataclass(frozen=True)
class Qwen35Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention"
    rms_norm_eps: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen35Config":
        """Build from a config.json dict (the published multimodal files nest it under text_config),
        every field read through ConfigFields: a bad one is a CheckpointError naming it."""
        top = ConfigFields(d)
        text = top.obj("text_config") if top.has("text_config") else top
        rope = text.obj("rope_parameters" if text.has("rope_parameters") else "rope_scaling")
        top_type = top.choice("model_type", MODEL_TYPES)
        vocab, H = text.int("vocab_size"), text.int("hidden_size")
        n_heads = text.int("num_attention_heads")
        kv_heads = _divisor(text, "num_key_value_heads", n_heads, "num_attention_heads")
        head_dim = text.int("head_dim") if text.has("head_dim") else _derived_head_dim(text, H, n_heads)
        layer_types = text.str_list("layer_types", ("linear_attention", "full_attention"))
        text.layer_count(len(layer_types), "layer_types")
        text.choice("hidden_act", ACTIVATIONS, "silu")
        experts = text.int("num_experts", 0, lo=0) if "moe" in top_type or top_type == "qwen3_next" else 0
        eos_fields = text if text.has("eos_token_id") else top
        return cls(
            model_type=top_type,
            vocab_size=vocab,
            hidden_size=H,
            layer_types=layer_types,
            rms_norm_eps=text.float("rms_norm_eps", 1e-6),
            tie_word_embeddings=top.bool("tie_word_embeddings", text.bool("tie_word_embeddings", False)),
            eos_token_ids=eos_fields.ids("eos_token_id", vocab),
            num_attention_heads=n_heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=rope.float("rope_theta", text.float("rope_theta", 10000.0)),
            partial_rotary_factor=_rotary_factor(rope if rope.has("partial_rotary_factor") else text, head_dim),
            linear_num_key_heads=text.int("linear_num_key_heads"),
            linear_num_value_heads=_multiple(text, "linear_num_value_heads", "linear_num_key_heads"),
            linear_key_head_dim=text.int("linear_key_head_dim"),
            linear_value_head_dim=text.int("linear_value_head_dim"),
            linear_conv_kernel_dim=text.int("linear_conv_kernel_dim", 4),
            intermediate_size=text.int("intermediate_size", 0, lo=0),
            num_experts=experts,
            num_experts_per_tok=text.int("num_experts_per_tok", hi=experts) if experts else 0,
            moe_intermediate_size=text.int("moe_intermediate_size") if experts else 0,
            shared_expert_intermediate_size=text.int("shared_expert_intermediate_size") if experts else 0,
            norm_topk_prob=text.bool("norm_topk_prob", True),
            mlp_only_layers=text.int_list("mlp_only_layers", (), hi=len(layer_types) - 1),
            decoder_sparse_step=text.int("decoder_sparse_step", 1),
        ).checked(text)

    def checked(self, fields: ConfigFields) -> "Qwen35Config":
        """Refuse what each field allows alone but the model cannot run together."""
        dense = [i for i in range(len(self.layer_types)) if not self.is_moe_layer(i)]
        if dense and not self.intermediate_size:
            raise fields.error("intermediate_size", f"an integer >= 1 (layer {dense[0]} has a dense MLP)", 0)
        return self

    @property
    def linear_shape(self) -> LinearLayerShape:
        return LinearLayerShape(self.linear_num_key_heads, self.linear_num_value_heads,
                                self.linear_key_head_dim, self.linear_value_head_dim, delta_rule=True)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


class GatedDeltaNetMixer(nn.Module):
    """Projections -> short conv -> Gated DeltaNet (buffered or recurrent) -> gated norm -> out_proj."""

    def __init__(self, cfg: Qwen35Config, linear_index: int):
        super().__init__()
        self.cfg, self.linear_index = cfg, linear_index
        Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Kd, Vd, H = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.hidden_size
        self.fused_inputs = cfg.model_type == "qwen3_next"
        if self.fused_inputs:
            parts = {"in_proj_qkvz": 2 * Hk * Kd + 2 * Hv * Vd, "in_proj_ba": 2 * Hv}
        else:
            parts = {"in_proj_qkv": 2 * Hk * Kd + Hv * Vd, "in_proj_z": Hv * Vd, "in_proj_b": Hv, "in_proj_a": Hv}
        self.in_proj = PackedLinear(H, parts)  # every input projection in one GEMM
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim, groups=cfg.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.zeros(Hv))
        self.norm = GatedRMSNorm(Vd, cfg.rms_norm_eps)
        self.out_proj = Linear(Hv * Vd, H, bias=False)

    def _projections(self, x):
        """(qkv (B, T, conv_dim), z (B, T, Hv, V), b, a (B, T, Hv)) in the unfused layout."""
        c = self.cfg
        Hk, Hv, Kd, Vd = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        B, T, _ = x.shape
        if not self.fused_inputs:
            qkv, z, b, a = self.in_proj(x)
            return qkv, z.view(B, T, Hv, Vd), b, a
        # Qwen3-Next packs [q, k, v, z] and [b, a] per key-head group
        r = Hv // Hk
        qkvz, ba = self.in_proj(x)
        q, k, v, z = torch.split(qkvz.view(B, T, Hk, 2 * Kd + 2 * r * Vd), [Kd, Kd, r * Vd, r * Vd], dim=-1)
        b, a = torch.split(ba.view(B, T, Hk, 2 * r), [r, r], dim=-1)
        qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        return qkv, z.reshape(B, T, Hv, Vd), b.reshape(B, T, Hv), a.reshape(B, T, Hv)

    def forward(self, x, batch, caches):
        c = self.cfg
        Hk, Hv, Kd, Vd = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        B, T, _ = x.shape
        qkv, z, b, a = self._projections(x)
        qkv = mixing.short_conv(qkv, self.conv1d.weight[:, 0], None, batch, caches, self.linear_index)
        q, k, v = torch.split(qkv, [Hk * Kd, Hk * Kd, Hv * Vd], dim=-1)
        o = mixing.gated_delta_mix(q.reshape(B, T, Hk, Kd), k.reshape(B, T, Hk, Kd), v.reshape(B, T, Hv, Vd),
                                   a, b, fp32(self, "A_log"), fp32(self, "dt_bias"), batch, caches, self.linear_index)
        if batch.fuse:
            o = fused.gated_norm(o, z, self.norm.weight, self.norm.eps, x.dtype)
        else:
            o = self.norm(o.to(x.dtype), z)
        return self.out_proj(o.reshape(B, T, Hv * Vd))


class GatedAttention(nn.Module):
    """Full attention with per-head q/k RMSNorm, partial rotary embedding and a sigmoid output gate."""

    def __init__(self, cfg: Qwen35Config, attn_index: int):
        super().__init__()
        self.cfg, self.attn_index = cfg, attn_index
        H, n, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = PackedLinear(H, {"q_proj": 2 * n * d, "k_proj": kv * d, "v_proj": kv * d})  # q with its gate
        self.o_proj = Linear(n * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centered=True)

    @staticmethod
    def rope(cfg: Qwen35Config, positions, dtype):
        """(cos, sin) for apply_rotary: the same for every attention layer of a forward."""
        return rotary_cos_sin(positions, int(cfg.head_dim * cfg.partial_rotary_factor), cfg.rope_theta, dtype)

    def forward(self, x, batch, caches, rope=None):
        c = self.cfg
        B, T, _ = x.shape
        d = c.head_dim
        q, k, v = self.qkv_proj(x)
        q, gate = torch.chunk(q.view(B, T, -1, 2 * d), 2, dim=-1)
        k, v = k.view(B, T, -1, d), v.view(B, T, -1, d)
        cos, sin = rope if rope is not None else self.rope(c, batch.positions, x.dtype)
        if batch.fuse:
            q = fused.norm_rope(q, self.q_norm.scale(), self.q_norm.eps, cos, sin)
            k = fused.norm_rope(k, self.k_norm.scale(), self.k_norm.eps, cos, sin)
        else:  # rotated in place: the norms' own outputs
            q = apply_rotary(self.q_norm(q), cos, sin, in_place=True)
            k = apply_rotary(self.k_norm(k), cos, sin, in_place=True)
        o = mixing.attention(q, k, v, batch, caches, self.attn_index, d ** -0.5)
        # per head: the strided gate is read in place, not copied first
        o = fused.sigmoid_mul(o, gate) if batch.fuse else o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(B, T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen35Config, i: int, linear_index: int, attn_index: int):
        super().__init__()
        if cfg.layer_types[i] == "linear_attention":
            self.linear_attn = GatedDeltaNetMixer(cfg, linear_index)
        else:
            self.self_attn = GatedAttention(cfg, attn_index)
        if cfg.is_moe_layer(i):
            self.mlp = SoftmaxTopKMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                      cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
                                      cfg.norm_topk_prob)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)

    def forward(self, x, batch, caches, rope=None):
        """rope: the forward's (cos, sin) for an attention layer (computed here if not given)."""
        if batch.fuse:
            return self._fused_forward(x, batch, caches, rope)
        x = x + self._mix(self.input_layernorm(x), batch, caches, rope)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _mix(self, h, batch, caches, rope):
        if hasattr(self, "linear_attn"):
            return self.linear_attn(h, batch, caches)
        return self.self_attn(h, batch, caches, rope)

    def _fused_forward(self, x, batch, caches, rope):
        """forward with each norm (and the residual add before the second) one compiled region, and the
        MLP's SiLU and product another, as the MoE's weighted sum (kvbuffer.models.fused)."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        y = self._mix(fused.rms_norm(x, norm1.scale(), norm1.eps), batch, caches, rope)
        x, h = fused.add_rms_norm(x, y, norm2.scale(), norm2.eps)
        return x + self.mlp(h, fuse=True)


class Backbone(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers, n_lin, n_att = [], 0, 0
        for i, kind in enumerate(cfg.layer_types):
            layers.append(DecoderLayer(cfg, i, n_lin, n_att))
            n_lin, n_att = n_lin + (kind == "linear_attention"), n_att + (kind != "linear_attention")
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)


class Qwen35ForCausalLM(nn.Module):
    """Token ids (B, T) + a ForwardBatch -> logits (B, T, vocab)."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

        self.mtp = None  # the multi-token-prediction head, attached when a checkpoint has one

    def embed(self, input_ids):
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, batch, caches, return_hidden: bool = False, last_logits: bool = False):
        """Logits (B, T, vocab), or (B, 1, vocab) of each row's last token with last_logits (a prompt's
        forward: the vocabulary product and the logits tensor of every other position are not made);
        with return_hidden also the final-norm hidden states (B, T, hidden) the MTP head reads."""
        x = self.model.embed_tokens(input_ids)
        rope = GatedAttention.rope(self.config, batch.positions, x.dtype) \
            if "full_attention" in self.config.layer_types else None
        for layer in self.model.layers:
            x = layer(x, batch, caches, rope)
        # a prompt's forward without return_hidden normalises only the last tokens (a norm is per token)
        h = self.model.norm(x[:, -1:] if last_logits and not return_hidden else x)
        logits = self.lm_head(h[:, -1:] if last_logits else h)
        return (logits, h) if return_hidden else logits

    def attach_mtp(self) -> None:
        """Add the MTP head (checkpoint tensors mtp.*); its weights are loaded with the rest."""
        layer = DecoderLayer(mtp_layer_config(self.config), 0, linear_index=0, attn_index=0)
        self.mtp = MultiTokenPredictor(self.config, layer)

    def cache_geometry(self) -> dict:
        """What the engine needs to size the pools and the KV cache."""
        c = self.config
        n_lin = sum(t == "linear_attention" for t in c.layer_types)
        return dict(linear_shape=c.linear_shape, num_linear_layers=n_lin, conv_dim=c.conv_dim,
                    conv_width=c.linear_conv_kernel_dim, num_attention_layers=len(c.layer_types) - n_lin,
                    num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim)

    def cache_layout(self) -> list[tuple[str, int] | None]:
        return cache_layout(self.config.layer_types)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Map a checkpoint tensor name to this module's (published Qwen3.5 files nest the LM)."""
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        if name.startswith("model.mtp."):
            return name[len("model."):]
        return name

    @staticmethod
    def skip_checkpoint_tensor(name: str) -> bool:
        """The vision tower is not used by the text decoder."""
        return name.startswith(("model.visual.", "visual."))


def _divisor(fields: ConfigFields, key: str, of: int, of_key: str) -> int:
    """A head count that divides `of` (grouped heads share one key/value head)."""
    value = fields.int(key)
    if of % value:
        raise fields.error(key, f"a divisor of {of_key} ({of})", value)
    return value


def _multiple(fields: ConfigFields, key: str, of_key: str) -> int:
    """A head count that is a multiple of the one named `of_key`."""
    value, of = fields.int(key), fields.int(of_key)
    if value % of:
        raise fields.error(key, f"a multiple of {of_key} ({of})", value)
    return value


def _derived_head_dim(fields: ConfigFields, hidden: int, heads: int) -> int:
    if hidden < heads:
        raise fields.error("hidden_size", f"at least num_attention_heads ({heads}) when head_dim is not given",
                           hidden)
    return hidden // heads


def _rotary_factor(fields: ConfigFields, head_dim: int) -> float:
    """partial_rotary_factor in (0, 1] whose rotated channels (head_dim * it) are an even number >= 2."""
    factor = fields.float("partial_rotary_factor", 1.0, hi=1.0)
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        raise fields.error("partial_rotary_factor", f"a factor that rotates an even number >= 2 of the head's "
                           f"{head_dim} channels (it rotates {rotary})", factor)
    return factor
