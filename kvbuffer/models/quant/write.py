"""Writing FP8 checkpoints in the published formats, from a model: Qwen's block FP8 (config.json's
quantization_config, `weight_scale_inv` per block, `modules_to_not_convert`) and NVIDIA ModelOpt's FP8
(also hf_quant_config.json, `weight_scale` and `input_scale` per tensor, `exclude_modules`, k/v cache
scales). The tests and the benchmarks' `--fp8` models are made this way: quantized weights, written,
loaded back with nothing to convert.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..layers import Experts, Linear, PackedLinear, RoutedExperts
from ..loader import _PER_EXPERT, checkpoint_tensors, load_weights, read_config
from .config import BLOCK, FORMATS, HF_QUANT_CONFIG, MODELOPT, QuantConfig, read_quant_config
from .fp8 import FP8, dequantize, quantize
from .load import EXPERT_DTYPE, KV_SCALES, SCALE_SUFFIXES

DEFAULT_BLOCK = (128, 128)
# ModelOpt's static activation scale, chosen rather than calibrated: activations up to 16 in magnitude
# (a normalised layer input) fit e4m3's range
INPUT_SCALE = 16.0 / 448.0
# the projections Qwen's block-FP8 releases keep in bf16 (their last name component), besides the LM head
QWEN_KEPT = ("in_proj_a", "in_proj_b", "in_proj_ba")


def projections(model: nn.Module, experts: bool = True) -> list[str]:
    """The checkpoint names (without `.weight`) of every projection an FP8 checkpoint may quantize: each
    Linear, each PackedLinear part, each routed expert's matrices (`experts.{e}.<proj>`; not with
    experts=False)."""
    names = []
    for path, m in model.named_modules():
        if type(m) is Linear:
            names.append(path)
        elif isinstance(m, PackedLinear):
            parent = path.rpartition(".")[0]
            names += [f"{parent}.{part}".lstrip(".") for part in m.parts]
        elif isinstance(m, RoutedExperts) and experts:
            first = ("gate_proj", "up_proj") if isinstance(m, Experts) else ("up_proj",)
            E = m.expert_weights()[0].shape[0]
            names += [f"{path}.{e}.{p}" for e in range(E) for p in (*first, "down_proj")]
    return names


def _router_gates(model: nn.Module) -> list[str]:
    """Plain nn.Linear modules (MoE routers and gates): never quantized; Qwen lists them all the same."""
    return [path for path, m in model.named_modules() if type(m) is nn.Linear]


def kept_unquantized(model: nn.Module, fmt: str) -> list[str]:
    """The module names the format's releases keep unquantized. Block (Qwen): the LM head, the Gated
    DeltaNet's small in_proj_a / in_proj_b, the routers and shared-expert gates. ModelOpt (Nemotron): the LM
    head, the routers, and the Mamba mixers' projections next to an attention layer."""
    kept = ["lm_head", *_router_gates(model)]
    if fmt == BLOCK:
        return kept + [n for n in projections(model) if n.rpartition(".")[2] in QWEN_KEPT]
    types = getattr(model.config, "layer_types", ())
    near = {i for i, t in enumerate(types) if t == "linear_attention"
            and "full_attention" in (types[i - 1] if i else None, types[i + 1] if i + 1 < len(types) else None)}
    return kept + [f"model.layers.{i}.mixer.{p}" for i in sorted(near) for p in ("in_proj", "out_proj")]


def checkpoint_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s tensors under the names a published checkpoint gives them: packed projections split into
    their parts, stacked experts into one matrix per expert."""
    out, modules = {}, dict(model.named_modules())
    for name, t in checkpoint_tensors(model).items():
        prefix, _, field = name.rpartition(".")
        if isinstance(modules.get(prefix), RoutedExperts) and t.dim() == 3:
            halves = ("gate_proj", "up_proj") if field == "gate_up_proj" else (field,)
            for e in range(t.shape[0]):
                for h, piece in zip(halves, t[e].chunk(len(halves))):
                    out[f"{prefix}.{e}.{h}.weight"] = piece
        else:
            out[name] = t
    return out


def quantize_tensors(model: nn.Module, fmt: str, block: tuple[int, int] = DEFAULT_BLOCK,
                     experts: bool = True) -> tuple[dict, dict, QuantConfig]:
    """(tensors, config.json's quantization_config, its QuantConfig) of `model` in format `fmt` (BLOCK or
    MODELOPT): each projection not kept unquantized (kept_unquantized) as float8_e4m3fn with its scales,
    the rest as they are (views of the model's parameters). With experts=False the routed experts stay
    stacked and unquantized (the loader dequantizes FP8 experts anyway)."""
    if fmt not in FORMATS:
        raise ValueError(f"fp8 format must be one of {FORMATS}, got {fmt!r}")
    kept = kept_unquantized(model, fmt)
    quant = QuantConfig(fmt, block=block if fmt == BLOCK else None, excluded=tuple(kept), fp8_kv_cache=fmt == MODELOPT)
    tensors = {k: v.detach() for k, v in (checkpoint_of(model) if experts else checkpoint_tensors(model)).items()}
    for name in projections(model, experts):
        w = tensors.get(f"{name}.weight")
        if w is None or quant.is_excluded(name):
            continue
        q, scale = quantize(w, block if fmt == BLOCK else tuple(w.shape))
        tensors[f"{name}.weight"] = q
        if fmt == BLOCK:
            tensors[f"{name}.weight_scale_inv"] = scale
        else:
            tensors[f"{name}.weight_scale"] = scale.reshape(())
            tensors[f"{name}.input_scale"] = torch.tensor(INPUT_SCALE)
    if fmt == BLOCK:
        config = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=list(block),
                      modules_to_not_convert=kept)
    else:
        for path, m in model.named_modules():
            if hasattr(m, "qkv_proj"):  # an attention layer: its k/v cache scales
                tensors[f"{path}.k_proj.k_scale"] = torch.tensor(1.0)
                tensors[f"{path}.v_proj.v_scale"] = torch.tensor(1.0)
        config = dict(quant_method="modelopt", quant_algo="FP8", kv_cache_quant_algo="FP8", exclude_modules=kept)
    return tensors, config, quant


def write_checkpoint(model: nn.Module, hf_config: dict, out_dir: str | Path, fp8: str | None = None,
                     block: tuple[int, int] = DEFAULT_BLOCK) -> Path:
    """Write `model` (built from `hf_config`) as a checkpoint directory: config.json and
    model.safetensors, FP8 in format `fp8` (BLOCK, MODELOPT; None: as the model is) with
    hf_quant_config.json for ModelOpt. Returns the directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(hf_config)
    if fp8 is None:
        tensors = checkpoint_of(model)
    else:
        tensors, config["quantization_config"], _ = quantize_tensors(model, fp8, block)
    if fp8 == MODELOPT:
        q = config["quantization_config"]
        fields = ("quant_algo", "kv_cache_quant_algo", "exclude_modules")
        (out / HF_QUANT_CONFIG).write_text(json.dumps(
            {"producer": {"name": "modelopt"}, "quantization": {k: q[k] for k in fields}}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def quantize_model(model: nn.Module, fp8: str, block: tuple[int, int] = DEFAULT_BLOCK) -> nn.Module:
    """`model` with its projections in FP8 as write_checkpoint would write them and the loader load them
    back, converted in place on the model's device (the benchmarks' random FP8 models); its routed
    experts are left as they are (the loader dequantizes FP8 experts), so that the conversion needs
    no memory beyond the FP8 copies of the projections."""
    tensors, _, quant = quantize_tensors(model, fp8, block, experts=False)
    load_weights(model, tensors, quant)
    return model


def dequantize_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Write the FP8 checkpoint `src` dequantized into `dst` (config.json without its quantization_config;
    each FP8 weight as W = q * scale in fp32, routed experts in the dtype the loader dequantizes them to;
    no scales): the dequantized model an FP8 model's reference path equals. Returns `dst`."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    config = read_config(src)
    quant = read_quant_config(config, src)
    if quant is None:
        raise ValueError(f"{src} declares no FP8 format")
    config.pop("quantization_config", None)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out = {}
    for name, t in tensors.items():
        if t.dtype == FP8:
            prefix = name.removesuffix(".weight")
            scale = tensors[f"{prefix}.{quant.scale_name}"].float()
            block = quant.block if quant.kind == BLOCK else tuple(t.shape)
            dtype = EXPERT_DTYPE if _PER_EXPERT.match(name) else torch.float32
            out[name] = dequantize(t, scale if quant.kind == BLOCK else scale.reshape(1, 1), block, dtype)
        elif name.rpartition(".")[2] not in (*SCALE_SUFFIXES, *KV_SCALES):
            out[name] = t
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
