"""kvbuffer: buffered decoding for linear-attention LLMs (Gated DeltaNet, Mamba-2).

Importing kvbuffer imports neither torch nor TileLang: the public names below load their module on
first use (PEP 562), so `kvbuffer --help` answers at once; the compile side (kvbuffer.tiles,
kvbuffer.autotune) loads TileLang on demand, and the runtime only loads compiled artifacts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module (relative to kvbuffer) that defines it
_LAZY = {
    "EngineConfig": ".engine.config", "SpeculativeConfig": ".engine.config",
    "LLM": ".engine.llm", "GenerationOutput": ".engine.llm",
    "ArtifactError": ".errors", "BufferOverflowError": ".errors", "DeviceError": ".errors",
    "DTypeError": ".errors", "KVBufferError": ".errors", "PoolExhaustedError": ".errors",
    "RequestError": ".errors", "ShapeError": ".errors", "SlotError": ".errors",
    "BufferPool": ".pools", "ConvPool": ".pools", "LinearLayerShape": ".pools", "SlotAllocator": ".pools",
    "StatePool": ".pools",
}
_SUBMODULES = ("reference",)

if TYPE_CHECKING:
    from . import reference
    from .engine.config import EngineConfig, SpeculativeConfig
    from .engine.llm import LLM, GenerationOutput
    from .errors import (
        ArtifactError,
        BufferOverflowError,
        DeviceError,
        DTypeError,
        KVBufferError,
        PoolExhaustedError,
        RequestError,
        ShapeError,
        SlotError,
    )
    from .pools import BufferPool, ConvPool, LinearLayerShape, SlotAllocator, StatePool


def __getattr__(name: str):
    """Load a public name's module on first access and keep the name (later accesses are plain)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def demo_checkpoint():
    """Path of the small demo model bundled with kvbuffer (trained by scripts/train_demo.py)."""
    from pathlib import Path

    return Path(__file__).resolve().parent / "demo"


__all__ = [
    "ArtifactError", "BufferOverflowError", "BufferPool", "ConvPool", "DTypeError", "DeviceError", "EngineConfig",
    "GenerationOutput", "KVBufferError", "LLM", "LinearLayerShape", "PoolExhaustedError", "RequestError", "ShapeError",
    "SlotAllocator", "SlotError", "SpeculativeConfig", "StatePool", "demo_checkpoint", "reference", "__version__",
]
