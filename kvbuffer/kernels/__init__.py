"""kvbuffer's kernel layer: keys, specs, lookup, validated launchers and the `torch.ops.kvbuffer.*` custom ops.

    keys.py       KernelKey (family, op, the family's own dims), PREFILL_CHUNKS
    specs.py      one KernelSpec per kernel: template, defaults, configs, launch parameters, arguments,
                  reference, custom ops, where tune stores it; every build goes through it
    lookup.py     artifact-else-JIT lookup with one in-process cache (allow_jit, kernel_for, clear_kernels)
    compiled.py   CompiledOp and the checks every launcher shares
    gdn.py, mamba2.py, conv.py, attention.py, gemv.py   compile (`build_*`) and validated launch per family
    prefill.py    the chunked prefill of packed prompts (both linear families): compile, launch, reference
    launch.py     a custom op's CUDA call: lookup + launch (checked, or direct for engine-built rows)
    torch_ops.py  the torch.library registrations (CPU reference, CUDA launch, fakes)
    fp8_ops.py    the same for the FP8 one-row projection (torch.ops.kvbuffer.fp8_gemv) and the block-FP8
                  GEMM's activation quantizer (torch.ops.kvbuffer.fp8_quant_act)

Importing this package registers the custom ops and never imports TileLang: compiling
(`build_*`, a JIT lookup) imports it through kvbuffer.tiles on demand.
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
