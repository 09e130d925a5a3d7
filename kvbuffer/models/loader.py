"""Load a Hugging Face-format checkpoint directory (config.json + *.safetensors) into a kvbuffer model.

Tensor names are mapped to the module's names (published Qwen3.5 files nest the language model
under model.language_model.*), per-expert MoE tensors are stacked into the 3-D expert tensors,
and every missing, unexpected or mis-shaped tensor is reported by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from . import REGISTRY, supported_model_types

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded as it is; the message names the file or tensor."""


def read_config(path: str | Path) -> dict:
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise CheckpointError(f"no config.json in {path}")
    return json.loads(cfg_file.read_text())


def build_model(hf_config: dict):
    """Construct the model (random weights) for a config.json dict."""
    model_type = hf_config.get("model_type")
    if model_type not in REGISTRY:
        raise CheckpointError(f"unsupported model_type {model_type!r}; kvbuffer supports {supported_model_types()}")
    config_cls, model_cls = REGISTRY[model_type]
    try:
        cfg = config_cls.from_hf(hf_config)
    except KeyError as e:
        raise CheckpointError(f"config.json for {model_type} lacks {e.args[0]!r}") from None
    return model_cls(cfg)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


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


def load_weights(model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint tensors into `model`; raise CheckpointError naming any mismatch."""
    mapped = {}
    for name, t in _stack_experts(tensors).items():
        if model.skip_checkpoint_tensor(name):
            continue
        mapped[model.checkpoint_name(name)] = t
    if any(n.startswith("mtp.") for n in mapped) and getattr(model, "mtp", "absent") is None:
        model.attach_mtp()  # the checkpoint carries a multi-token-prediction head
    params = dict(model.named_parameters())
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
            if t.shape != p.shape:
                # conv1d weights are stored (D, 1, W) by transformers and may come as (D, W)
                if t.numel() == p.numel() and "conv1d" in name:
                    t = t.reshape(p.shape)
                else:
                    raise CheckpointError(f"tensor {name}: checkpoint shape {tuple(t.shape)}, model expects {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))


def load_checkpoint(path: str | Path, *, dtype=None, device=None):
    """config.json + safetensors in `path` -> a model in eval mode."""
    path = Path(path)
    model = build_model(read_config(path))
    load_weights(model, _read_tensors(path))
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval()
