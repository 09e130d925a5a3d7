"""Launchers for the compiled kernels: validate torch tensors, then call a compiled kernel.

Compiling is a separate step (`build_*`, which imports TileLang through kvbuffer.tiles on
demand); the launchers only take an already compiled `CompiledOp`. Importing this package never
imports TileLang.
"""

from .conv import build_conv1d_accept, build_conv1d_update, conv1d_accept, conv1d_update
from .gdn import (
    CompiledOp,
    build_gdn_buffered,
    build_gdn_flush,
    build_gdn_recurrent,
    gdn_buffered_step,
    gdn_flush,
    gdn_prefill,
    gdn_recurrent_step,
    gdn_verify,
)
from .mamba2 import (
    build_mamba2_buffered,
    build_mamba2_flush,
    build_mamba2_recurrent,
    mamba2_buffered_step,
    mamba2_flush,
    mamba2_prefill,
    mamba2_recurrent_step,
    mamba2_verify,
)

__all__ = [
    "CompiledOp", "build_gdn_buffered", "build_gdn_flush", "build_gdn_recurrent",
    "gdn_buffered_step", "gdn_flush", "gdn_prefill", "gdn_recurrent_step", "gdn_verify",
    "build_mamba2_buffered", "build_mamba2_flush", "build_mamba2_recurrent", "mamba2_buffered_step",
    "mamba2_flush", "mamba2_prefill", "mamba2_recurrent_step", "mamba2_verify",
    "build_conv1d_accept", "build_conv1d_update", "conv1d_accept", "conv1d_update",
]
