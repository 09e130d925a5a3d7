"""The quantization a checkpoint declares: its config.json `quantization_config` and, for NVIDIA
ModelOpt releases, `hf_quant_config.json`; and which modules it keeps unquantized.

Two formats are read (docs/fp8.md): Qwen's block FP8 (`quant_method: "fp8"`, e4m3 weights with one
`weight_scale_inv` per `weight_block_size` block, activations quantized on the fly) and ModelOpt FP8
(`quant_method: "modelopt"`, `quant_algo: "FP8"`: one `weight_scale` and one static `input_scale` per
tensor). Every other method is refused with a CheckpointError that names it.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from ...errors import CheckpointError
from ...jsonfile import read_object

BLOCK = "block"    # Qwen block FP8: weight_scale_inv per (bn, bk) block
MODELOPT = "modelopt"  # ModelOpt FP8: weight_scale and input_scale per tensor
FORMATS = (BLOCK, MODELOPT)
HF_QUANT_CONFIG = "hf_quant_config.json"


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's FP8 format: `kind` (BLOCK or MODELOPT), the weight block (BLOCK only), the module
    names it keeps unquantized (`excluded`, matched as vLLM matches that format's list) and whether it
    declares an FP8 KV cache (its k/v scales are then loaded and recorded, never applied: kvbuffer's KV
    cache is not FP8)."""

    kind: str
    block: tuple[int, int] | None = None
    excluded: tuple[str, ...] = ()
    fp8_kv_cache: bool = False

    @property
    def scale_name(self) -> str:
        """The suffix of a quantized weight's scale tensor: `<module>.<scale_name>`."""
        return "weight_scale_inv" if self.kind == BLOCK else "weight_scale"

    def is_excluded(self, *names: str) -> bool:
        """Whether the module under any of `names` (a checkpoint's name, kvbuffer's name) is kept
        unquantized. Block FP8 (vLLM's Fp8Config): the module's full name is in the list. ModelOpt
        (vLLM's ModelOptFp8Config): the full name is in the list, or an entry is a substring of it, or
        an entry is a wildcard pattern (`*`) that matches it; a name under `language_model.` is also
        tried without that prefix."""
        for name in names:
            if name in self.excluded:
                return True
            if self.kind != MODELOPT:
                continue
            variants = [name, name.removeprefix("language_model.")]
            if any(entry in v or fnmatch.fnmatchcase(v, entry) for entry in self.excluded for v in variants):
                return True
        return False


def read_quant_config(hf_config: dict, path: Path) -> QuantConfig | None:
    """The FP8 format `hf_config` (config.json of the checkpoint in `path`) and `path`'s
    hf_quant_config.json declare; None when neither declares a quantization. CheckpointError names
    any method, algorithm or field kvbuffer does not load."""
    declared = hf_config.get("quantization_config")
    if declared is None and isinstance(hf_config.get("text_config"), dict):
        declared = hf_config["text_config"].get("quantization_config")
    modelopt = _read_hf_quant_config(path)
    if declared is None and modelopt is None:
        return None
    if declared is not None and not isinstance(declared, dict):
        raise CheckpointError(f"config.json: quantization_config must be a JSON object, got {declared!r:.80}")
    method = (declared or {}).get("quant_method", "modelopt" if modelopt is not None else None)
    if method == "fp8":
        return _block_fp8(declared)
    if method == "modelopt":
        return _modelopt_fp8(modelopt if modelopt is not None else declared)
    raise CheckpointError(f"config.json: quantization method {method!r} is not supported; kvbuffer loads FP8 "
                          f"checkpoints in Qwen's block format (quant_method 'fp8') and NVIDIA ModelOpt's "
                          f"(quant_method 'modelopt', quant_algo 'FP8'): docs/fp8.md")


def _read_hf_quant_config(path: Path) -> dict | None:
    """hf_quant_config.json's `quantization` object (ModelOpt's own file), or None without the file."""
    f = path / HF_QUANT_CONFIG
    if not f.is_file():
        return None
    data = read_object(f)
    q = data.get("quantization", data)
    if not isinstance(q, dict):
        raise CheckpointError(f"{f} must hold a JSON object with a 'quantization' object")
    return q


def _names(value, field: str, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{where}: {field} must be a list of module names, got {value!r:.80}")
    return tuple(value)


def _block_fp8(q: dict) -> QuantConfig:
    where = "config.json quantization_config"
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}: fmt {fmt!r} is not supported (FP8 weights must be e4m3)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise CheckpointError(f"{where}: activation_scheme {scheme!r} is not supported with quant_method 'fp8' "
                              f"(block FP8 quantizes activations on the fly: 'dynamic')")
    block = q.get("weight_block_size")
    if block is None:
        raise CheckpointError(f"{where}: quant_method 'fp8' without weight_block_size (per-tensor FP8 of this "
                              f"method) is not supported; block FP8 needs weight_block_size, e.g. [128, 128]")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: weight_block_size must be two positive integers, got {block!r:.80}")
    excluded = _names(q.get("modules_to_not_convert", q.get("ignored_layers")), "modules_to_not_convert", where)
    return QuantConfig(BLOCK, block=(block[0], block[1]), excluded=excluded)


def _modelopt_fp8(q: dict) -> QuantConfig:
    where = "ModelOpt quantization config"
    algo = q.get("quant_algo")
    if algo != "FP8":
        raise CheckpointError(f"{where}: quant_algo {algo!r} is not supported; kvbuffer loads ModelOpt's 'FP8' "
                              f"(per-tensor scales) only")
    kv = q.get("kv_cache_quant_algo")
    if kv not in (None, "FP8"):
        raise CheckpointError(f"{where}: kv_cache_quant_algo {kv!r} is not supported (FP8 or none)")
    excluded = _names(q.get("exclude_modules", q.get("ignore")), "exclude_modules", where)
    return QuantConfig(MODELOPT, excluded=excluded, fp8_kv_cache=kv == "FP8")
