"""Load a Hugging Face-format checkpoint directory (config.json + *.safetensors) into a kvbuffer model.

Tensor names are mapped to the module's names (published Qwen3.5 files nest the language model
under model.language_model.*), per-expert MoE tensors are stacked into the 3-D expert tensors,
and every missing, unexpected or mis-shaped tensor is reported by name. FP8 checkpoints (Qwen's block
format, NVIDIA ModelOpt's) load through kvbuffer.models.quant; tensors of any other non-float kind
(int8, bool, int64, uint8, other float8s) are refused by name.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..jsonfile import read_object
from . import REGISTRY, supported_model_types
from .layers import PackedLinear
from .quant.config import QuantConfig, read_quant_config
from .quant.fp8 import FP8, has_nan_bytes
from .quant.load import check_fp8_declared, dequantize_experts, install_fp8

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

__all__ = ["CheckpointError", "build_model", "checkpoint_tensors", "load_checkpoint", "load_weights", "read_config"]


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint directory (or the file itself) as a dict; CheckpointError names
    the file when it is missing, not JSON, or not a JSON object."""
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise CheckpointError(f"no config.json in {path}")
    return read_object(cfg_file)


def build_model(hf_config: dict):
    """Construct the model (random weights) for a config.json dict. Every field is checked first
    (CheckpointError naming it), then the model is sized on the meta device: one larger than the
    memory of the device it is built on is a CheckpointError before anything is allocated."""
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else None
    if not isinstance(model_type, str) or model_type not in REGISTRY:
        raise CheckpointError(f"unsupported model_type {model_type!r}; kvbuffer supports {supported_model_types()}")
    from .sizing import check_fits

    config_cls, model_cls = REGISTRY[model_type]
    try:
        config = config_cls.from_hf(hf_config)
        check_fits(model_cls, config)
        return model_cls(config)
    except CheckpointError:
        raise
    except KeyError as e:
        raise CheckpointError(f"config.json for {model_type} lacks {e.args[0]!r}") from None
    except (TypeError, ValueError, RuntimeError) as e:  # a field of the wrong type or value: "hidden_size": "160"
        raise CheckpointError(f"config.json for {model_type} has a bad value: {e}") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's *.safetensors files, each name in exactly one file."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    tensors, origin = {}, {}
    for f in files:
        for name, t in _read_file(f).items():
            if name in origin:
                raise CheckpointError(f"tensor {name} is in both {origin[name].name} and {f.name} (in {path})")
            origin[name] = f
            tensors[name] = t
    return tensors


def _read_file(f: Path) -> dict[str, torch.Tensor]:
    """One safetensors file, with its tensors checked for NaN and infinity: corrupt bytes and
    diverged training both show up there, and a non-finite weight poisons every token after it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not f.is_file():
        raise CheckpointError(f"{f} is not a regular file")
    try:
        tensors = load_file(str(f))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
    for name, t in tensors.items():
        _check_kind(name, t, f)
        if t.dtype == FP8 and has_nan_bytes(t) or t.dtype != FP8 and not all_finite(t):
            raise CheckpointError(f"tensor {name} in {f} has non-finite values (NaN or infinity)")
    return tensors


def all_finite(t: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN and no infinity: its minimum and maximum are finite (both
    propagate NaN), one pass with no tensor-sized temporary."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _check_kind(name: str, t: torch.Tensor, f: Path) -> None:
    """Weights are floating point (fp32, bf16, fp16) or float8_e4m3fn (in a declared FP8 format, checked
    at load): an integer, bool or other float8 tensor is a format kvbuffer does not load, refused before
    it could be cast to float and run as garbage."""
    if t.dtype == FP8 or (t.is_floating_point() and t.element_size() > 1):
        return
    raise CheckpointError(f"tensor {name} in {f} is {str(t.dtype).removeprefix('torch.')}: kvbuffer loads "
                          f"floating-point weights and FP8 (e4m3) in the formats of docs/fp8.md; quantized or "
                          f"integer tensors of other formats (int8, int4, GPTQ, AWQ, bitsandbytes, ...) are not "
                          f"supported")


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """experts.{e}.gate_proj/up_proj/down_proj.weight -> experts.gate_up_proj (E, 2I, H), down_proj (E, H, I)."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for prefix, experts in groups.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))):
            raise CheckpointError(f"{prefix}: expert indices are not 0..{len(ids) - 1}")
        for kind, t0 in experts[0].items():  # torch.stack would fail without naming the odd tensor
            for e in ids:
                t = experts[e].get(kind)
                if t is not None and t.shape != t0.shape:
                    raise CheckpointError(f"tensor {prefix}.{e}.{kind}.weight: shape {tuple(t.shape)}, "
                                          f"expert 0 has {tuple(t0.shape)}")
        try:
            if "gate_proj" in experts[0]:
                out[f"{prefix}.gate_up_proj"] = torch.stack(
                    [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], 0) for e in ids])
            else:  # non-gated experts (relu^2): up_proj only
                out[f"{prefix}.up_proj"] = torch.stack([experts[e]["up_proj"] for e in ids])
            out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
        except KeyError as e:
            raise CheckpointError(f"{prefix}: an expert lacks its {e.args[0]} weight") from None
    return out


def _packed(model):
    """(path, PackedLinear, field, the parts' checkpoint names) for every packed tensor of `model`."""
    for path, module in model.named_modules():
        if isinstance(module, PackedLinear):
            parent = path.rpartition(".")[0]
            for field in ("weight", "bias") if module.bias is not None else ("weight",):
                yield path, module, field, [f"{parent}.{part}.{field}".lstrip(".") for part in module.parts]


def _pack_projections(model, mapped: dict) -> None:
    """Gather, in place in `mapped`, the checkpoint's separate projections (q_proj, k_proj, v_proj,
    ...) under the name of the model's PackedLinear tensor they make up, as a list of parts that
    load_weights copies into their slices (no concatenated copy: loading peaks no higher than before).
    Each part is checked against its own shape first, so that an error names the checkpoint's tensor.
    A checkpoint that holds the packed tensor itself (and none of its parts) is taken as it is."""
    for path, module, field, names in _packed(model):
        packed = f"{path}.{field}".lstrip(".")
        present = [n for n in names if n in mapped]
        if packed in mapped:
            if present:
                raise CheckpointError(f"checkpoint has both {packed} and its part(s) {present[:3]}")
            continue
        missing = [n for n in names if n not in mapped]
        if missing:
            raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s), first: {missing[:3]}")
        for n, size in zip(names, module.sizes):
            want = (size, module.in_features) if field == "weight" else (size,)
            if tuple(mapped[n].shape) != want:
                raise CheckpointError(f"tensor {n}: checkpoint shape {tuple(mapped[n].shape)}, model expects {want}")
        mapped[packed] = [mapped.pop(n) for n in names]


def checkpoint_tensors(module) -> dict[str, torch.Tensor]:
    """`module`'s parameters under the names a checkpoint gives them (relative to `module`): each
    PackedLinear split back into its parts (views), the inverse of what load_weights packs."""
    out = dict(module.named_parameters())
    for path, packed, field, names in _packed(module):
        whole = out.pop(f"{path}.{field}".lstrip("."))
        out.update(zip(names, torch.split(whole, packed.sizes)))
    return out


def load_weights(model, tensors: dict[str, torch.Tensor], quant: QuantConfig | None = None) -> None:
    """Copy checkpoint tensors into `model`; raise CheckpointError naming any mismatch. With `quant`
    (the checkpoint's FP8 format), its FP8 projections replace the model's (kvbuffer.models.quant)."""
    check_fp8_declared(tensors, quant)
    mapped, original = {}, {}
    for name, t in _stack_experts(dequantize_experts(tensors, quant, _PER_EXPERT.match)).items():
        if model.skip_checkpoint_tensor(name):
            continue
        mapped[model.checkpoint_name(name)] = t
        original[model.checkpoint_name(name)] = name
    if any(n.startswith("mtp.") for n in mapped) and getattr(model, "mtp", "absent") is None:
        model.attach_mtp()  # the checkpoint carries a multi-token-prediction head
    loaded = install_fp8(model, mapped, quant, original) if quant is not None else set()
    _pack_projections(model, mapped)
    params = {n: p for n, p in model.named_parameters() if n not in loaded}
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied:
        params.pop("lm_head.weight", None)
        mapped.pop("lm_head.weight", None)
    missing = sorted(set(params) - set(mapped))
    unexpected = sorted(set(mapped) - set(params))
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s), first: {missing[:3]}")
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} unexpected tensor(s), first: {unexpected[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            t = mapped[name]
            if isinstance(t, list):  # a packed projection's parts, shapes checked by _pack_projections
                for part, piece in zip(t, torch.split(p, [part.shape[0] for part in t])):
                    piece.copy_(part)  # in the parameter's dtype, rounded once
                continue
            if t.shape != p.shape:
                # conv1d weights are stored (D, 1, W) by transformers and may come as (D, W); a (W, D)
                # of the same size is a transposed weight, refused
                if "conv1d" in name and p.dim() == 3 and p.shape[1] == 1 and tuple(t.shape) == (p.shape[0], p.shape[2]):
                    t = t.reshape(p.shape)
                else:
                    raise CheckpointError(f"tensor {name}: checkpoint shape {tuple(t.shape)}, model expects {tuple(p.shape)}")
            p.copy_(t)


_BUILD_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what set_default_dtype takes
_RANDOM_INITS = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
                 "trunc_normal_")


@contextlib.contextmanager
def parameters_to_load(dtype: torch.dtype | None = None, device=None):
    """Around building a model whose every parameter is loaded next (load_weights refuses a checkpoint
    that lacks one, and the models hold no buffers): torch.nn.init's random initialisers leave their
    tensor as it is, and parameters are made in `dtype` on `device` (None: the defaults), so a large
    model is neither filled with random numbers, nor built in fp32 first, nor copied once more to its
    device. Process-wide while it lasts, as torch.set_default_dtype is; all is put back on the way out."""
    saved = {name: getattr(torch.nn.init, name) for name in _RANDOM_INITS}
    default = torch.get_default_dtype()
    try:
        for name in _RANDOM_INITS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        if dtype is not None:
            torch.set_default_dtype(dtype)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            yield
    finally:
        torch.set_default_dtype(default)
        for name, init in saved.items():
            setattr(torch.nn.init, name, init)


def load_checkpoint(path: str | Path, *, dtype=None, device=None):
    """config.json + safetensors in `path` -> a model in eval mode. An FP8 checkpoint's quantized weights
    stay FP8 whatever `dtype` (docs/fp8.md)."""
    path = Path(path)
    hf_config = read_config(path)
    quant = read_quant_config(hf_config, path)
    with torch.device("meta"):  # every config field checked before a tensor is read or memory is taken
        build_model(hf_config)
    tensors = _read_tensors(path)  # and every tensor's kind and values before the model takes memory
    with parameters_to_load(dtype if dtype in _BUILD_DTYPES else None, device):
        model = build_model(hf_config)
    load_weights(model, tensors, quant)
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval()
