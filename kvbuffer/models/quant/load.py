"""Loading an FP8 checkpoint's tensors into a model: its FP8 projections become FP8Linear /
FP8PackedLinear modules (kvbuffer.models.quant.linear), its FP8 routed experts are dequantized, its
k/v cache scales are recorded on the attention layers; every tensor the format does not explain is a
CheckpointError that names it.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import CheckpointError
from ..layers import Linear, PackedLinear
from .config import BLOCK, QuantConfig
from .fp8 import FP8, dequantize, scale_grid
from .linear import FP8Linear, FP8PackedLinear

SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale")
KV_SCALES = ("k_scale", "v_scale")
EXPERT_DTYPE = torch.bfloat16  # FP8 routed experts are dequantized at load to this dtype


def check_fp8_declared(tensors: dict[str, torch.Tensor], quant: QuantConfig | None) -> None:
    """An FP8 tensor in a checkpoint that declares no FP8 format is refused, by name."""
    if quant is None:
        for name, t in tensors.items():
            if t.dtype == FP8:
                raise CheckpointError(f"tensor {name} is float8_e4m3fn, but config.json declares no "
                                      f"quantization_config (kvbuffer loads FP8 checkpoints in the formats of "
                                      f"docs/fp8.md)")


def _take_scales(tensors: dict, prefix: str, q: torch.Tensor, quant: QuantConfig, names=()):
    """(weight scale grid fp32, its block, input scale or None) of the FP8 weight `prefix`.weight, popped
    from `tensors` after their shapes are checked: a block grid of ceil(N/bn) x ceil(K/bk), or one value
    per tensor (then kept as one per row, block (1, K): packed parts stack their scales alike)."""
    if quant.is_excluded(prefix, *names):
        raise CheckpointError(f"tensor {prefix}.weight is float8_e4m3fn, but the quantization config keeps "
                              f"{prefix} unquantized")
    scale_name = f"{prefix}.{quant.scale_name}"
    if scale_name not in tensors:
        raise CheckpointError(f"tensor {prefix}.weight is float8_e4m3fn but the checkpoint lacks its scale "
                              f"{scale_name}")
    scale = tensors.pop(scale_name)
    want = scale_grid(q.shape[0], q.shape[1], quant.block) if quant.kind == BLOCK else ()
    if quant.kind == BLOCK and tuple(scale.shape) != want or quant.kind != BLOCK and scale.numel() != 1:
        raise CheckpointError(f"tensor {scale_name}: shape {tuple(scale.shape)}, expected {want or '() (one scale)'} "
                              f"for the weight of shape {tuple(q.shape)}")
    if not scale.is_floating_point() or scale.dtype == FP8:
        raise CheckpointError(f"tensor {scale_name} is {scale.dtype}; scales are fp32, bf16 or fp16")
    if quant.kind == BLOCK:
        scale, block = scale.float(), quant.block
    else:
        scale, block = scale.float().reshape(1, 1).expand(q.shape[0], 1).contiguous(), (1, q.shape[1])
    input_scale = tensors.pop(f"{prefix}.input_scale", None)
    if input_scale is not None and input_scale.numel() != 1:
        raise CheckpointError(f"tensor {prefix}.input_scale: shape {tuple(input_scale.shape)}, expected () (one scale)")
    if quant.kind != BLOCK and input_scale is None:
        raise CheckpointError(f"tensor {prefix}.weight is FP8 (ModelOpt) but the checkpoint lacks {prefix}.input_scale")
    return scale, block, input_scale


def dequantize_experts(tensors: dict[str, torch.Tensor], quant: QuantConfig | None, is_expert) -> dict:
    """`tensors` with each FP8 per-expert weight (is_expert(name)) dequantized to EXPERT_DTYPE and its
    scales taken out: the routed experts run unquantized (docs/fp8.md)."""
    if quant is None:
        return tensors
    out = dict(tensors)
    for name, t in tensors.items():
        if t.dtype == FP8 and is_expert(name):
            prefix = name.removesuffix(".weight")
            _check_weight(name, t)
            scale, block, _ = _take_scales(out, prefix, t, quant)
            out[name] = dequantize(t, scale, block, EXPERT_DTYPE)
    return out


def _check_weight(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise CheckpointError(f"tensor {name}: an FP8 weight must be 2-D (N, K), got shape {tuple(t.shape)}")


def _fp8_linear(tensors, prefix, quant, names, shape, bias) -> FP8Linear:
    q = tensors.pop(f"{prefix}.weight")
    _check_weight(f"{prefix}.weight", q)
    if tuple(q.shape) != shape:
        raise CheckpointError(f"tensor {prefix}.weight: checkpoint shape {tuple(q.shape)}, model expects {shape}")
    scale, block, input_scale = _take_scales(tensors, prefix, q, quant, names)
    return FP8Linear(q, scale, block, input_scale, bias)


def _pop_bias(tensors, prefix, size):
    b = tensors.pop(f"{prefix}.bias", None)
    if b is not None and tuple(b.shape) != (size,):
        raise CheckpointError(f"tensor {prefix}.bias: checkpoint shape {tuple(b.shape)}, model expects {(size,)}")
    return b


def install_fp8(model: nn.Module, tensors: dict[str, torch.Tensor], quant: QuantConfig,
                original: dict[str, str]) -> set[str]:
    """Replace each projection of `model` whose weight `tensors` (under kvbuffer's names; `original`
    maps them back to the checkpoint's) holds in FP8 by its FP8 module, built from the tensors it pops
    from `tensors`; record the k/v cache scales. Returns the parameter names now loaded."""
    loaded: set[str] = set()
    for path, module in list(model.named_modules()):
        new = None
        if type(module) is Linear and _is_fp8(tensors, f"{path}.weight"):
            bias = _pop_bias(tensors, path, module.out_features) if module.bias is not None else None
            new = _fp8_linear(tensors, path, quant, [original.get(f"{path}.weight", "").removesuffix(".weight")],
                              (module.out_features, module.in_features), bias)
        elif isinstance(module, PackedLinear):
            new = _packed(module, path, tensors, quant, original)
        if new is not None:
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent), attr, new)
            loaded.update(f"{path}.{n}".lstrip(".") for n, _ in new.named_parameters())
    _record_kv_scales(model, tensors)
    for name, t in tensors.items():
        if t.dtype == FP8:
            raise CheckpointError(f"tensor {name} is float8_e4m3fn, but kvbuffer runs only the linear projections and "
                                  f"routed experts in FP8")
        if name.rpartition(".")[2] in SCALE_SUFFIXES:
            raise CheckpointError(f"tensor {name} scales a weight the checkpoint does not store in FP8")
    return loaded


def _is_fp8(tensors, name) -> bool:
    t = tensors.get(name)
    return t is not None and not isinstance(t, list) and t.dtype == FP8


def _packed(module: PackedLinear, path: str, tensors, quant, original):
    """The FP8PackedLinear for `module`, or None when none of its weights is FP8 in the checkpoint."""
    parent = path.rpartition(".")[0]
    names = [f"{parent}.{part}".lstrip(".") for part in module.parts]
    if _is_fp8(tensors, f"{path}.weight".lstrip(".")):  # the checkpoint holds the packed tensor itself
        whole = path.lstrip(".")
        bias = _pop_bias(tensors, whole, sum(module.sizes)) if module.bias is not None else None
        group = _fp8_linear(tensors, whole, quant, [], (sum(module.sizes), module.in_features), bias)
        offsets = [sum(module.sizes[:i]) for i in range(len(module.sizes))]
        return FP8PackedLinear(module.in_features, dict(zip(module.parts, module.sizes)), [group],
                               [(0, o) for o in offsets])
    fp8 = [i for i, n in enumerate(names) if _is_fp8(tensors, f"{n}.weight")]
    if not fp8:
        return None
    missing = [f"{n}.weight" for n in names if f"{n}.weight" not in tensors]
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s), first: {missing[:3]}")
    bn = quant.block[0] if quant.kind == BLOCK else 1
    together = [i for i in fp8 if module.sizes[i] % bn == 0]  # block rows that concatenate
    alone = [[i] for i in fp8 if i not in together]
    plain = [i for i in range(len(names)) if i not in fp8]
    groups, layout = [], [None] * len(names)
    for members in ([together] if together else []) + alone:
        parts = [_fp8_linear(tensors, names[i], quant, [original.get(f"{names[i]}.weight", "").removesuffix(".weight")],
                             (module.sizes[i], module.in_features),
                             _pop_bias(tensors, names[i], module.sizes[i]) if module.bias is not None else None)
                 for i in members]
        groups.append(_concat(parts))
        _place(layout, members, module.sizes, len(groups) - 1)
    if plain:
        groups.append(_plain_group(module, names, plain, tensors))
        _place(layout, plain, module.sizes, len(groups) - 1)
    return FP8PackedLinear(module.in_features, dict(zip(module.parts, module.sizes)), groups, layout)


def _place(layout, members, sizes, group) -> None:
    offset = 0
    for i in members:
        layout[i] = (group, offset)
        offset += sizes[i]


def _concat(parts: list[FP8Linear]) -> FP8Linear:
    """One FP8Linear of parts stacked on N, their scale grids stacked (each part's N a multiple of the
    block's rows), with the largest input scale (as vLLM fuses them)."""
    if len(parts) == 1:
        return parts[0]
    q = torch.cat([p.weight.data for p in parts])
    scale, block = torch.cat([p.weight_scale.data for p in parts]), parts[0].block
    inputs = [p.input_scale.data for p in parts if p.input_scale is not None]
    input_scale = torch.stack(inputs).max() if inputs else None
    biases = [p.bias.data for p in parts if p.bias is not None]
    return FP8Linear(q, scale, block, input_scale, torch.cat(biases) if biases else None)


def _plain_group(module: PackedLinear, names, members, tensors) -> Linear:
    """A Linear of the unquantized parts `members`, stacked on N, on the packed module's device and dtype."""
    n = sum(module.sizes[i] for i in members)
    lin = Linear(module.in_features, n, bias=module.bias is not None, device=module.weight.device,
                 dtype=module.weight.dtype)
    with torch.no_grad():
        weights = []
        for i in members:
            w = tensors.pop(f"{names[i]}.weight")
            want = (module.sizes[i], module.in_features)
            if tuple(w.shape) != want:
                raise CheckpointError(f"tensor {names[i]}.weight: checkpoint shape {tuple(w.shape)}, "
                                      f"model expects {want}")
            weights.append(w.to(lin.weight.dtype))
        lin.weight.copy_(torch.cat(weights))
        if module.bias is not None:
            lin.bias.copy_(torch.cat([_pop_bias(tensors, names[i], module.sizes[i]) for i in members]))
    return lin


def _record_kv_scales(model: nn.Module, tensors: dict) -> None:
    """Pop every k_scale / v_scale (at the attention layer, or under its k_proj / v_proj / attn) and keep
    them, as floats, in the attention layer's `kv_cache_scales`: recorded, not applied (kvbuffer's KV
    cache is not FP8)."""
    modules = dict(model.named_modules())
    for name in [n for n in tensors if n.rpartition(".")[2] in KV_SCALES]:
        t = tensors.pop(name)
        if t.numel() != 1 or not t.is_floating_point():
            raise CheckpointError(f"tensor {name}: a KV cache scale must be one floating-point value, "
                                  f"got shape {tuple(t.shape)} {t.dtype}")
        owner, _, kind = name.rpartition(".")
        if owner.rpartition(".")[2] in ("k_proj", "v_proj", "attn"):
            owner = owner.rpartition(".")[0]
        if owner not in modules:
            raise CheckpointError(f"tensor {name}: no attention layer {owner} in the model")
        scales = dict(getattr(modules[owner], "kv_cache_scales", {}))
        scales[kind[0]] = float(t)
        modules[owner].kv_cache_scales = scales
