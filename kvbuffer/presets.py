"""The one table of model presets: each named model's transformers-style config dict.

Everything that speaks of a model by name derives from this table instead of keeping its own copy:
the capacity planner's geometries (kvbuffer.plan.GEOMETRIES), the tuner's head shapes
(kvbuffer.autotune.models) and the benchmarks' random-weight models (kvbuffer.bench.e2e).
A config here is what the model's config.json says (layer mix, head shapes, widths); the fields a
published config does not pin down for us are listed in `approximate` and marked so in results.
The two `smoke` presets are tiny models for tests on a CPU; the planner and the tuner skip them.
`write_checkpoint` writes a preset with random weights as a checkpoint directory, in bf16 or in the FP8
format its family publishes (`Preset.fp8_format`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class Preset:
    """One named model: its config.json dict and the parameter count its name states."""

    name: str
    config: Mapping
    params_billions: float | None  # the planner counts the weights at this size (None: count the parameters)
    approximate: tuple[str, ...] = ()  # config fields chosen by us, not read from the published config
    smoke: bool = False  # a tiny test model, not a real one

    def hf_config(self) -> dict:
        """A fresh, mutable copy of the config dict (what `kvbuffer.models.loader.build_model` takes)."""
        return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in self.config.items()}

    @property
    def fp8_format(self) -> str:
        """The FP8 format this family's releases use (kvbuffer.models.quant): Qwen's block FP8 ("block")
        or NVIDIA ModelOpt's per-tensor FP8 ("modelopt", Nemotron)."""
        return "modelopt" if self.config["model_type"] == "nemotron_h" else "block"


def _qwen_layers(n: int) -> list[str]:
    """Qwen3.5 / Qwen3-Next: every fourth layer is full attention."""
    return (["linear_attention"] * 3 + ["full_attention"]) * (n // 4)


def _nemotron_pattern(mamba: int, attention_after: tuple[int, ...]) -> str:
    """Mamba-2 ('M') and MoE ('E') in alternation, an attention layer ('*') after the listed pairs."""
    return "".join("ME" + ("*" if i in attention_after else "") for i in range(mamba))


_QWEN = dict(vocab_size=248320, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
             linear_value_head_dim=128, eos_token_id=None)
_NEMOTRON = dict(model_type="nemotron_h", vocab_size=131072, num_attention_heads=32, num_key_value_heads=2,
                 head_dim=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, eos_token_id=None)


def _qwen(name, params, hidden, layers, Hv, heads, kv_heads, approximate=(), **extra) -> Preset:
    config = dict(model_type="qwen3_5_text", hidden_size=hidden, layer_types=_qwen_layers(layers),
                  num_attention_heads=heads, num_key_value_heads=kv_heads, linear_num_value_heads=Hv, **_QWEN)
    return Preset(name, MappingProxyType({**config, **extra}), params, tuple(approximate))


def _nemotron(name, params, hidden, pattern, heads, approximate=(), **extra) -> Preset:
    config = dict(hidden_size=hidden, hybrid_override_pattern=pattern, mamba_num_heads=heads, **_NEMOTRON)
    return Preset(name, MappingProxyType({**config, **extra}), params, tuple(approximate))


_MOE_QWEN = ("moe_intermediate_size", "shared_expert_intermediate_size")
_TABLE = (
    _qwen("qwen3.5-9b", 9, 4096, 32, 32, 16, 4, intermediate_size=12288),
    _qwen("qwen3.5-27b", 27, 5120, 64, 48, 24, 4, intermediate_size=17408, approximate=("intermediate_size",)),
    _qwen("qwen3.5-35b-a3b", 35, 2048, 40, 32, 16, 2, approximate=_MOE_QWEN, model_type="qwen3_5_moe_text",
          num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512),
    _qwen("qwen3.5-122b-a10b", 122, 3072, 48, 64, 32, 2, approximate=_MOE_QWEN, model_type="qwen3_5_moe_text",
          num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
    _qwen("qwen3-next-80b", 80, 2048, 48, 32, 16, 2, approximate=("num_experts", "num_experts_per_tok") + _MOE_QWEN,
          model_type="qwen3_next", num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
          shared_expert_intermediate_size=512),
    _nemotron("nemotron-3-nano", 30, 2688, _nemotron_pattern(23, (3, 7, 11, 15, 19, 22)), 64,
              approximate=("intermediate_size",), n_routed_experts=128, num_experts_per_tok=6,
              moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5,
              intermediate_size=1856),
    _nemotron("nemotron-3-super", 120, 4096, _nemotron_pattern(40, (4, 9, 14, 19, 24, 29, 34, 39)), 128,
              approximate=("hybrid_override_pattern", "n_routed_experts", "num_experts_per_tok",
                           "moe_intermediate_size", "moe_shared_expert_intermediate_size", "moe_latent_size",
                           "intermediate_size"),
              n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688, moe_latent_size=1024,
              moe_shared_expert_intermediate_size=5376, intermediate_size=2688),
    Preset("tiny-qwen", MappingProxyType(dict(
        model_type="qwen3_5_text", vocab_size=97, hidden_size=64, intermediate_size=96, layer_types=_qwen_layers(4),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, eos_token_id=None)), None, smoke=True),
    Preset("tiny-nemotron", MappingProxyType(dict(
        model_type="nemotron_h", vocab_size=97, hidden_size=64,
        layers_block_type=["mamba", "moe", "attention", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, intermediate_size=96, eos_token_id=None)), None, smoke=True),
)

BY_NAME: Mapping[str, Preset] = MappingProxyType({p.name: p for p in _TABLE})
MODELS: tuple[str, ...] = tuple(p.name for p in _TABLE if not p.smoke)  # the real models, in table order


def get(name: str) -> Preset:
    """The preset called `name` (case-insensitive); ValueError listing the presets otherwise."""
    if not isinstance(name, str) or name.lower() not in BY_NAME:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(BY_NAME)}")
    return BY_NAME[name.lower()]


def write_checkpoint(name: str, out_dir: str | Path, *, fp8: bool = False, seed: int = 0) -> Path:
    """Preset `name` with random bf16 weights (seeded; matrices N(0, 0.02)) written to `out_dir` as a
    checkpoint directory (config.json, model.safetensors), in the preset's FP8 format with `fp8`, as its
    family publishes it (quantization_config, and hf_quant_config.json for ModelOpt). A real model's
    size needs that much memory on the CPU. Returns the directory."""
    import torch

    from .models.loader import build_model
    from .models.quant.write import write_checkpoint as write

    preset = get(name)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_model(preset.hf_config())
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
    return write(model, preset.hf_config(), out_dir, preset.fp8_format if fp8 else None)
