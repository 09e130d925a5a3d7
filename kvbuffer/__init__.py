"""kvbuffer: buffered decoding for linear-attention LLMs (Gated DeltaNet, Mamba-2).

Importing kvbuffer never imports TileLang: the compile side (kvbuffer.tiles, kvbuffer.autotune)
loads it on demand, and the runtime only loads compiled artifacts.
"""

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
    ShapeError,
    SlotError,
)
from .pools import BufferPool, ConvPool, LinearLayerShape, SlotAllocator, StatePool

__version__ = "0.1.0"


def demo_checkpoint():
    """Path of the small demo model bundled with kvbuffer (trained by scripts/train_demo.py)."""
    from pathlib import Path

    return Path(__file__).resolve().parent / "demo"


__all__ = [
    "ArtifactError", "BufferOverflowError", "BufferPool", "ConvPool", "DTypeError", "DeviceError", "EngineConfig",
    "GenerationOutput", "KVBufferError", "LLM", "LinearLayerShape", "PoolExhaustedError", "ShapeError", "SlotAllocator",
    "SlotError", "SpeculativeConfig", "StatePool", "demo_checkpoint", "reference", "__version__",
]
