"""Qwen3.5's multi-token-prediction (MTP) head, used as a drafter for speculative decoding.

The head sees the main model's final hidden state at position p and the embedding of the token at
p + 1, and predicts the token at p + 2: fc(cat(norm_e(embed(t_{p+1})), norm_h(h_p))) -> one full-
attention decoder layer (with its own KV cache) -> norm -> the shared lm_head. Drafting T tokens
applies it T times, feeding its own output hidden state back in place of the main model's.
Checkpoint tensors: mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.*,
mtp.norm (as in the published Qwen3.5 files; transformers itself ignores them).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .layers import Linear, RMSNorm


def mtp_layer_config(cfg):
    """The config of the head's one decoder layer: full attention, MoE when the model's MLPs are."""
    return dataclasses.replace(cfg, layer_types=("full_attention",), mlp_only_layers=())


class MultiTokenPredictor(nn.Module):
    """layer: the head's decoder layer, built by the model from mtp_layer_config (it indexes its own KV
    cache: layer 0)."""

    def __init__(self, cfg, layer: nn.Module):
        super().__init__()
        H = cfg.hidden_size
        self.fc = Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps, zero_centered=True)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(H, cfg.rms_norm_eps, zero_centered=True)
        self.num_attention_layers = 1

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch, caches) -> torch.Tensor:
        """embeds of the next tokens and hidden states (B, T, H) -> the head's hidden states (B, T, H)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        for layer in self.layers:
            x = layer(x, batch, caches)
        return self.norm(x)
