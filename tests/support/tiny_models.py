"""Tiny random kvbuffer models built without transformers (the GPU machine has no transformers).

Head dims are multiples of 16 so that the compiled kernels serve them (tests/support/hf_models.py's are 8).
Weights are drawn on the CPU from a seeded generator, so every machine builds the same model.
"""

from __future__ import annotations

import torch

from kvbuffer.models.loader import build_model, checkpoint_tensors

QWEN3_5 = dict(model_type="qwen3_5_text", vocab_size=97, hidden_size=64, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=96, eos_token_id=None,
               layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
NEMOTRON_H = dict(model_type="nemotron_h", vocab_size=97, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, eos_token_id=None,
                  layers_block_type=["mamba", "mlp", "attention", "mamba", "mlp"],
                  mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=32, n_groups=2, conv_kernel=4,
                  intermediate_size=96, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=48)
CONFIGS = {"qwen3_5": QWEN3_5, "nemotron_h": NEMOTRON_H}


def tiny_model(kind: str, seed: int = 0, **overrides):
    """A kvbuffer model (fp32, CPU, eval) with seeded random weights strong enough to matter."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # default inits (biases) that are perturbed below, not replaced
        model = build_model(dict(CONFIGS[kind], **overrides))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(checkpoint_tensors(model).items()):  # by checkpoint name: packing changes no draw
            if name.endswith("dt_bias"):   # softplus(dt + dt_bias) ~ 0.05 .. 1: decays matter
                p.copy_(torch.rand(p.shape, generator=g) * 3.5 - 3.0)
            elif p.dim() <= 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.4 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model.eval()
