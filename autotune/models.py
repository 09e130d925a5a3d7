"""Head shapes to tune for: model presets, a checkpoint's config.json, or explicit Hk,Hv,K,V.

A shape is the plain dict the registry and the cache key use: family ('gdn' or 'mamba2'), Hk, Hv,
K, V (kvbuffer.pools.LinearLayerShape's generic form; Mamba-2: Hk = n_groups, Hv = heads,
K = ssm_state_size, V = head_dim) and dtype (activations and buffer entries).

The short conv in front of those layers has a shape of its own (family 'conv1d', see conv_shape):
its channels are q, k, v (GDN) or x, B, C (Mamba-2), 2 * Hk * K + Hv * V in both families. The
model's softmax-attention layers have theirs (family 'attention', see config_attention_shape): query
and KV heads, head dim, and the dtypes of the activations and the KV cache. Its projections without
a bias, one shape per distinct weight matrix (family 'gemv', see config_gemv_shapes), run on the
one-row kernel in a forward of one token; its routed experts, one shape per distinct expert weight,
on the experts kernel in forwards of a few tokens (family 'experts') and on the grouped experts
kernel in larger ones (family 'grouped'). In an FP8 checkpoint (its quantization, or `fp8` for a
preset) the shapes are the FP8 model's, as the engine holds it: its FP8 projections get the FP8
one-row kernel's (family 'fp8_gemv', with the weight's scale block), the ones it keeps unquantized the
bf16 kernel's, and in a block-FP8 one each K of the projections that run block-scaled FP8 GEMMs gets
the activation quantizer's (family 'fp8_quant').
"""

from __future__ import annotations

import json
from pathlib import Path

from kvbuffer import presets
from kvbuffer.kernels.fp8_ops import fp8_quant_fits
from kvbuffer.kernels.keys import attention_shape, fp8_gemv_fits, gemv_fits, grouped_fits, projection_shape
from kvbuffer.reference.fp8 import GROUP
from kvbuffer.tuning import make_conv_shape, make_shape

DEFAULT_DTYPE = "bfloat16"


def preset_shape(name: str, dtype: str = DEFAULT_DTYPE) -> dict:
    if name.lower() not in HEAD_SHAPES:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(HEAD_SHAPES)} (or a checkpoint dir)")
    return make_shape(**HEAD_SHAPES[name.lower()], dtype=dtype)


def parse_heads(text: str, family: str = "gdn", dtype: str = DEFAULT_DTYPE) -> dict:
    """'16,32,128,128' -> shape."""
    try:
        Hk, Hv, K, V = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--heads takes Hk,Hv,K,V (four integers), got {text!r}") from None
    return make_shape(family, Hk, Hv, K, V, dtype)


def checkpoint_shape(path: str | Path, dtype: str | None = None) -> dict:
    """The linear-attention head shape from a checkpoint directory's config.json (or the file itself)."""
    path = Path(path)
    cfg_path = path / "config.json" if path.is_dir() else path
    return config_shape(json.loads(cfg_path.read_text()), dtype, source=str(cfg_path))


def config_dtype(cfg: dict, dtype: str | None = None) -> str:
    """`dtype` if given, else the dtype a transformers-style config names (its text config's first),
    else bfloat16."""
    text = cfg.get("text_config") or cfg
    return dtype or text.get("dtype") or text.get("torch_dtype") or cfg.get("torch_dtype") or DEFAULT_DTYPE


def config_shape(cfg: dict, dtype: str | None = None, source: str = "config") -> dict:
    """The linear-attention head shape a transformers-style config dict declares."""
    text = cfg.get("text_config") or cfg  # Qwen3.5 checkpoints are vision-language models
    dtype = config_dtype(cfg, dtype)
    if "linear_num_value_heads" in text:
        return make_shape("gdn", text["linear_num_key_heads"], text["linear_num_value_heads"],
                          text["linear_key_head_dim"], text["linear_value_head_dim"], dtype)
    if "mamba_num_heads" in text:
        return make_shape("mamba2", text.get("n_groups", 1), text["mamba_num_heads"], text["ssm_state_size"],
                          text["mamba_head_dim"], dtype)
    raise ValueError(f"{source}: model_type {text.get('model_type')!r} has no linear-attention layers "
                     "kvbuffer knows (expected linear_* (Gated DeltaNet) or mamba_* (Mamba-2) keys)")


# Head shapes of kvbuffer.presets' real models (the one preset table), without the dtype
HEAD_SHAPES: dict[str, dict] = {
    name: {k: v for k, v in config_shape(presets.get(name).hf_config()).items() if k != "dtype"}
    for name in presets.MODELS
}


CONV_WIDTH = 4                                   # both families' published checkpoints
CONV_BIAS = {"gdn": False, "mamba2": True}       # Qwen3.5's conv has no bias; Nemotron-H's has one


def conv_shape(shape: dict, width: int | None = None, bias: bool | None = None) -> dict:
    """The short conv of the layers with this head shape; weights in the activations' dtype."""
    D = 2 * shape["Hk"] * shape["K"] + shape["Hv"] * shape["V"]
    return make_conv_shape(D, width or CONV_WIDTH, shape["dtype"], shape["dtype"],
                           CONV_BIAS[shape["family"]] if bias is None else bias)


def checkpoint_conv_shape(path: str | Path, shape: dict) -> dict:
    """conv_shape with the width and bias a checkpoint's config.json declares."""
    path = Path(path)
    cfg = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    text = cfg.get("text_config") or cfg
    width = text.get("linear_conv_kernel_dim") or text.get("conv_kernel") or text.get("mamba_d_conv")
    bias = text.get("use_conv_bias", text.get("mamba_conv_bias")) if shape["family"] == "mamba2" else None
    return conv_shape(shape, width, None if bias is None else bool(bias))


def config_attention_shape(cfg: dict, dtype: str | None = None) -> dict | None:
    """The attention layers' shape a transformers-style config declares (None: no attention layers).
    The KV cache holds the activations' dtype (kvbuffer.runtime.caches)."""
    text = cfg.get("text_config") or cfg
    heads, kv_heads = text.get("num_attention_heads"), text.get("num_key_value_heads")
    kinds = list(text.get("layer_types") or ()) + list(text.get("layers_block_type") or ())  # Qwen / NemotronH
    has_attention = any(k in ("full_attention", "attention") for k in kinds) \
        or "*" in (text.get("hybrid_override_pattern") or "")
    if not (has_attention and heads and kv_heads):
        return None
    dtype = config_dtype(cfg, dtype)
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return attention_shape(heads, kv_heads, head_dim, dtype, dtype)


def preset_attention_shape(name: str, dtype: str = DEFAULT_DTYPE) -> dict | None:
    return config_attention_shape(presets.get(name.lower()).hf_config(), dtype)


def checkpoint_attention_shape(path: str | Path, dtype: str | None = None) -> dict | None:
    path = Path(path)
    return config_attention_shape(json.loads((path / "config.json" if path.is_dir() else path).read_text()), dtype)


def meta_model(cfg: dict):
    """The model a config declares, built on the meta device: its layer shapes with no memory, and no
    copy of them here."""
    import torch

    from kvbuffer.models.loader import build_model

    with torch.device("meta"):
        return build_model(cfg)


def config_projection_counts(cfg: dict) -> dict[tuple[int, int], int]:
    """(N, K) -> how many of the model's bias-free projections (kvbuffer.models.layers.one_row_linears)
    have a weight of that shape."""
    from kvbuffer.models.layers import one_row_linears

    model = meta_model(cfg)
    counts: dict[tuple[int, int], int] = {}
    for m in one_row_linears(model):
        counts[tuple(m.weight.shape)] = counts.get(tuple(m.weight.shape), 0) + 1
    return counts


def config_expert_shapes(cfg: dict) -> set[tuple[int, int]]:
    """(N, K) of each distinct expert weight of the model's routed experts (kvbuffer.models.layers.
    one_row_experts)."""
    from kvbuffer.models.layers import one_row_experts

    return {tuple(w.shape[1:]) for m in one_row_experts(meta_model(cfg)) for w in m.expert_weights()}


FP8_BLOCK, FP8_ROW = "block", "modelopt"  # the FP8 formats: Qwen's block scales, ModelOpt's one per tensor
FP8_FORMATS = {"gdn": FP8_BLOCK, "mamba2": FP8_ROW}  # each family's published FP8 checkpoints'
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's own file beside config.json


def _quantization(cfg: dict) -> dict:
    """config.json's quantization_config (a vision-language model's may sit in its text config)."""
    return cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config") or {}


def config_fp8_format(cfg: dict, modelopt_file: dict | None = None) -> str | None:
    """The FP8 format a config declares (FP8_BLOCK: quant_method "fp8"; FP8_ROW: ModelOpt FP8, in its
    quantization_config or in hf_quant_config.json's contents `modelopt_file`), or None."""
    q = _quantization(cfg)
    if q.get("quant_method") == "fp8":
        return FP8_BLOCK
    modelopt = modelopt_file.get("quantization", modelopt_file) if modelopt_file else q
    if q.get("quant_method") in ("modelopt", None) and modelopt.get("quant_algo") == "FP8":
        return FP8_ROW
    return None


def fp8_weight_block(cfg: dict, fmt: str, K: int) -> tuple[int, int]:
    """The scale block of an FP8 weight of K columns: the block format's weight_block_size (default
    128 x 128), ModelOpt's per-tensor scale kept as one scale per row (1, K)."""
    if fmt == FP8_ROW:
        return 1, K
    return tuple(_quantization(cfg).get("weight_block_size") or (128, 128))


def config_gemv_shapes(cfg: dict, dtype: str | None = None, fp8: str | None = None, model=None) -> list[dict]:
    """The one-token projection shapes of the model a transformers-style config declares, as the engine
    looks their kernels up (kvbuffer.engine.one_row): one per distinct weight shape of its bias-free
    Linear / PackedLinear modules the one-row kernel takes (family "gemv"), one per distinct FP8Linear
    weight the FP8 one-row kernel takes (family "fp8_gemv", with its scale block), the activation
    quantizer's (family "fp8_quant", fp8_quant_shapes), and one per distinct expert weight of its routed
    experts for each of the two experts kernels (families "experts" and "grouped"); none for a model in
    another dtype than bf16, fp16. With an FP8 format (`fp8`, else the one the config declares) the model
    is the one that format's release loads (fp8_meta_model: a block-FP8 Qwen3.5's in_proj is an FP8 group
    of q, k, v, z and a bf16 Linear of b, a); `model`: that model, built already (a checkpoint's)."""
    from kvbuffer.models.layers import one_row_experts, one_row_linears
    from kvbuffer.models.quant.linear import FP8Linear

    dtype = config_dtype(cfg, dtype)
    if model is None:
        fmt = fp8 or config_fp8_format(cfg)
        model = meta_model(cfg) if fmt is None else fp8_meta_model(cfg, fmt)
    plain = dict.fromkeys(tuple(m.weight.shape) for m in one_row_linears(model))
    out = [projection_shape("gemv", N, K, dtype) for N, K in plain if gemv_fits(K, dtype)]
    fp8_mods = [m for m in model.modules() if isinstance(m, FP8Linear)]
    blocks = list(dict.fromkeys((m.out_features, m.in_features, tuple(m.block)) for m in fp8_mods))
    one_row = dict.fromkeys((m.out_features, m.in_features, tuple(m.block)) for m in fp8_mods if m.bias is None)
    out += [projection_shape("fp8_gemv", N, K, dtype, b) for N, K, b in one_row if fp8_gemv_fits(K, b, dtype)]
    out += fp8_quant_shapes(blocks, dtype)
    experts = sorted({tuple(w.shape[1:]) for m in one_row_experts(model) for w in m.expert_weights()})
    for family, fits in (("experts", gemv_fits), ("grouped", grouped_fits)):
        out += [projection_shape(family, N, K, dtype) for N, K in experts if fits(K, dtype)]
    return out


def fp8_meta_model(cfg: dict, fmt: str):
    """The model a config declares, on the meta device, with its projections in FP8 format `fmt` as that
    format's releases quantize them (kvbuffer.models.quant.write: the scale block the config names, else
    128 x 128) and as the loader installs them."""
    from kvbuffer.models.quant.write import quantize_model

    block = fp8_weight_block(cfg, fmt, 0) if fmt == FP8_BLOCK else (128, 128)
    return quantize_model(meta_model(cfg), fmt, tuple(block))


def checkpoint_meta_model(path: Path, cfg: dict):
    """The model a checkpoint directory loads as (its FP8 modules where its tensors are FP8), on the meta
    device: the loader run on the safetensors headers' shapes and dtypes, no weight read."""
    import torch
    from safetensors import safe_open

    from kvbuffer.models.loader import load_weights
    from kvbuffer.models.quant.config import read_quant_config

    dtypes = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                piece = st.get_slice(name)
                if piece.get_dtype() not in dtypes:
                    raise ValueError(f"{f}: tensor {name} is {piece.get_dtype()}; checkpoints hold {tuple(dtypes)}")
                tensors[name] = torch.empty(piece.get_shape(), dtype=dtypes[piece.get_dtype()], device="meta")
    model = meta_model(cfg)
    load_weights(model, tensors, read_quant_config(cfg, path))
    return model


def fp8_quant_shapes(blocks: list[tuple[int, int, tuple[int, int]]], dtype: str) -> list[dict]:
    """The activation quantizer's shapes for FP8 weights (N, K, scale block): one per K of those that run
    block-scaled FP8 GEMMs (kvbuffer.models.quant.fp8.gemm_path: (128, 128) blocks, N and K multiples of
    128, bf16 activations)."""
    if dtype != "bfloat16":
        return []
    ks = sorted({K for N, K, b in blocks if b == (GROUP, GROUP) and N % GROUP == 0 and fp8_quant_fits(K, dtype)})
    return [projection_shape("fp8_quant", K, K, dtype, (1, GROUP)) for K in ks]


def preset_gemv_shapes(name: str, dtype: str = DEFAULT_DTYPE, fp8: bool = False) -> list[dict]:
    """The projection shapes of a preset; `fp8`: in its family's FP8 format (FP8_FORMATS)."""
    cfg = presets.get(name.lower()).hf_config()
    return config_gemv_shapes(cfg, dtype, FP8_FORMATS[config_shape(cfg)["family"]] if fp8 else None)


def checkpoint_gemv_shapes(path: str | Path, dtype: str | None = None) -> list[dict]:
    """The projection shapes of a checkpoint, FP8 ones when its config.json or hf_quant_config.json
    declares an FP8 format: of a directory with its weights, as it loads (checkpoint_meta_model: FP8
    where its tensors are, the modules it keeps unquantized in bf16); of a config alone, as the format's
    releases quantize (fp8_meta_model)."""
    path = Path(path)
    cfg = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    quant = path / HF_QUANT_CONFIG if path.is_dir() else path.parent / HF_QUANT_CONFIG
    fmt = config_fp8_format(cfg, json.loads(quant.read_text()) if quant.is_file() else None)
    if fmt is not None and path.is_dir() and any(path.glob("*.safetensors")):
        return config_gemv_shapes(cfg, dtype, model=checkpoint_meta_model(path, cfg))
    return config_gemv_shapes(cfg, dtype, fmt)
