"""Model families kvbuffer serves, looked up by the `model_type` of a checkpoint's config.json."""

from __future__ import annotations

from .qwen3_5 import MODEL_TYPES as _QWEN_TYPES
from .qwen3_5 import Qwen35Config, Qwen35ForCausalLM

# model_type -> (config class, model class)
REGISTRY: dict[str, tuple[type, type]] = {t: (Qwen35Config, Qwen35ForCausalLM) for t in _QWEN_TYPES}


def register(model_types, config_cls, model_cls) -> None:
    for t in model_types:
        REGISTRY[t] = (config_cls, model_cls)


def supported_model_types() -> list[str]:
    return sorted(REGISTRY)
from .nemotron_h import MODEL_TYPES as _NEMOTRON_TYPES, NemotronHConfig, NemotronHForCausalLM  # noqa: E402
register(_NEMOTRON_TYPES, NemotronHConfig, NemotronHForCausalLM)
