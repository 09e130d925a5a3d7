"""Tiny random-weight transformers models of every supported type, saved as checkpoints.

transformers picks fused kernels at import when fla, mamba_ssm or causal_conv1d are importable,
and those break on CPU; they are blocked here before transformers is imported.
"""

from __future__ import annotations

import sys

for _name in ("fla", "mamba_ssm", "causal_conv1d"):
    sys.modules.setdefault(_name, None)

import torch  # noqa: E402

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
              initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
QWEN_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                   linear_value_head_dim=8, intermediate_size=96,
                   layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                   num_hidden_layers=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# Nemotron-H: every mixer kind twice (M Mamba-2, * attention, - MLP, E MoE); Mamba layers are 1st and 5th
NEMOTRON_H = dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe",
                                     "full_attention"],
                  mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4,
                  intermediate_size=96, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=2.5)


def make_hf_model(model_type: str, seed: int = 0, **overrides):
    """A transformers CausalLM of `model_type` with random weights (fp32, eval mode).

    `overrides` change the tiny Nemotron-H config (e.g. moe_latent_size); other types take none.
    """
    torch.manual_seed(seed)
    if overrides and model_type != "nemotron_h":
        raise ValueError(f"config overrides are only supported for nemotron_h, got {sorted(overrides)}")
    if model_type == "qwen3_5_text":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON, **QWEN_LINEAR))
    elif model_type == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**COMMON, **QWEN_LINEAR, **MOE))
    elif model_type == "qwen3_next":
        from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**COMMON, **QWEN_LINEAR, **MOE))
    elif model_type == "nemotron_h":
        # transformers' Mamba-2 mixer clamps dt to (config.time_step_min, inf) in its chunked prefill
        # only (config.time_step_limit is not used; its decode applies no clamp, nor does kvbuffer).
        # time_step_min = 0 cannot be passed at construction (dt_bias init takes its log), so the
        # clamp is lifted afterwards: in the config (saved with the checkpoint) and in every mixer.
        from transformers.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM
        model = NemotronHForCausalLM(NemotronHConfig(**COMMON, **{**NEMOTRON_H, **overrides}))
        model.config.time_step_min = 0.0
        g = torch.Generator().manual_seed(4321)
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "time_step_limit"):
                    module.time_step_limit = (0.0, float("inf"))
                    # softplus(dt + dt_bias) spans ~0.05 .. 1, not the default 1e-3 .. 0.1: decays matter
                    module.dt_bias.copy_(torch.rand(module.dt_bias.shape, generator=g) * 3.5 - 3.0)
                if hasattr(module, "e_score_correction_bias"):  # a buffer: _randomize would skip it
                    module.e_score_correction_bias.normal_(0, 0.1, generator=g)
    else:
        raise ValueError(model_type)
    _randomize(model)
    return model.eval()


def saved_hf_model(model_type: str, tmp_path_factory):
    """make_hf_model's model and the checkpoint directory it was saved to (a pytest tmp folder)."""
    hf = make_hf_model(model_type)
    path = tmp_path_factory.mktemp(model_type)
    hf.save_pretrained(path)
    return hf, path


def _randomize(model):
    """Default init leaves norms at identity and A_log/dt_bias tame; perturb everything a little."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() <= 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif "experts" in name and p.abs().sum() == 0:
                p.normal_(0, 0.1, generator=g)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], new_tokens: int):
    """transformers' greedy generate for one prompt: (tokens, per-step logits (new_tokens, V))."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, min_new_tokens=new_tokens, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack([lg[0] for lg in out.logits])


def add_mtp_head(path, seed: int = 0) -> None:
    """Add random Qwen3.5-style MTP tensors (mtp.*) to a saved checkpoint, as published files carry
    them (transformers itself neither builds nor saves the head)."""
    import json

    from safetensors.torch import load_file, save_file

    from kvbuffer.models import REGISTRY
    from kvbuffer.models.loader import checkpoint_tensors

    cfg_dict = json.loads((path / "config.json").read_text())
    config_cls, model_cls = REGISTRY[cfg_dict["model_type"]]
    model = model_cls(config_cls.from_hf(cfg_dict))
    model.attach_mtp()
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(path / "model.safetensors"))
    for name, p in sorted(checkpoint_tensors(model.mtp).items()):
        scale = 0.1 if p.dim() > 1 else 0.05
        base = torch.zeros_like(p) if p.dim() <= 1 else torch.zeros_like(p)
        tensors[f"mtp.{name}"] = (base + scale * torch.randn(p.shape, generator=g)).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
