"""kvbuffer's kernel layer: one module per kernel family, each defining its specs, compile (`build_*`),
validated launch, CUDA launch, engine ops, `torch.ops.kvbuffer.*` custom ops and tuner inputs, and
registering them (kvbuffer.kernels.specs.register).

    gdn.py, mamba2.py  the linear families (what they share: linear.py; their chunked prefill: prefill.py)
    conv.py            the short conv with draft rollback
    attention.py       decode attention over the KV cache
    gemv.py, fp8_ops.py  the projections: one-row, experts and grouped experts; FP8 one-row and the
                       block-FP8 activation quantizer
    keys.py            KernelKey (family, op, the family's own dims), PREFILL_CHUNKS
    specs.py           KernelSpec, the family registry, spec_for
    lookup.py          artifact-else-JIT lookup with one in-process cache (allow_jit, kernel_for, clear_kernels)
    compiled.py, calls.py  CompiledOp and the launchers' checks; the launch on torch's stream, EngineOp, and
                       the registration of a custom op's fake and CUDA implementations
    launch.py, torch_ops.py  the launches and engine ops by the names the engine uses; the ops' contract

Importing this package registers the families and their custom ops and never imports TileLang:
compiling (`build_*`, a JIT lookup) imports it through kvbuffer.tiles on demand. A new family is one
more module here and its name in the line below.
"""

from . import gdn, mamba2, conv, attention, gemv, fp8_ops  # noqa: I001  (the kernel families, registered in this order)
from . import specs, torch_ops
from .attention import attention_decode, attention_reference, build_attention_combine, build_attention_decode
from .compiled import CompiledOp
from .conv import build_conv1d_accept, build_conv1d_update, conv1d_accept, conv1d_update
from .gdn import (
    build_gdn_buffered,
    build_gdn_flush,
    build_gdn_recurrent,
    gdn_buffered_step,
    gdn_flush,
    gdn_prefill,
    gdn_recurrent_step,
    gdn_verify,
)
from .fp8_ops import build_fp8_gemv, fp8_gemv
from .gemv import build_gemv, build_gemv_experts, build_grouped_experts, gemv, gemv_experts, grouped_experts
from .keys import PREFILL_CHUNKS, AttnDims, ConvDims, GDNDims, GemvDims, KernelKey, Mamba2Dims
from .lookup import allow_jit, clear_kernels, jit_allowed, kernel_for
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
from .prefill import build_gdn_chunk_prefill, build_mamba2_chunk_prefill, chunk_prefill

# every torch.ops.kvbuffer.* op the registered families define
OPS = tuple(dict.fromkeys(op for spec in specs.SPECS.values() for op in spec.custom_ops))

__all__ = [
    "OPS", "PREFILL_CHUNKS", "AttnDims", "CompiledOp", "ConvDims", "GDNDims", "GemvDims", "KernelKey", "Mamba2Dims",
    "allow_jit", "clear_kernels", "jit_allowed", "kernel_for",
    "build_gdn_buffered", "build_gdn_flush", "build_gdn_recurrent",
    "gdn_buffered_step", "gdn_flush", "gdn_prefill", "gdn_recurrent_step", "gdn_verify",
    "build_mamba2_buffered", "build_mamba2_flush", "build_mamba2_recurrent", "mamba2_buffered_step",
    "mamba2_flush", "mamba2_prefill", "mamba2_recurrent_step", "mamba2_verify",
    "build_gdn_chunk_prefill", "build_mamba2_chunk_prefill", "chunk_prefill",
    "build_conv1d_accept", "build_conv1d_update", "conv1d_accept", "conv1d_update",
    "attention_decode", "attention_reference", "build_attention_combine", "build_attention_decode",
    "build_gemv", "gemv", "build_fp8_gemv", "fp8_gemv", "build_gemv_experts", "gemv_experts",
    "build_grouped_experts", "grouped_experts",
]
