"""The FP8 custom ops: the one-row projection with an FP8 weight, and the activation quantizer of a
block-FP8 GEMM.

    torch.ops.kvbuffer.fp8_gemv(x, q, scale, block_n, block_k) -> (rows, N)

x (rows, K) times W^T for W = q * scale by block (kvbuffer.reference.fp8): q (N, K) float8_e4m3fn,
scale fp32 (ceil(N / block_n), ceil(K / block_k)); accumulated in fp32, rounded once to x's dtype; x is
not quantized. CPU: the reference. CUDA: the FP8 one-row kernel (kvbuffer.kernels.launch.fp8_gemv; x in
bf16 or fp16).

    torch.ops.kvbuffer.fp8_quant_act(x) -> (q (Mp, K) float8_e4m3fn, scale (K / 128, Mp) fp32)

x (M, K) quantized per token and 128 columns, rows padded with zeros to Mp (a multiple of 4), the
scales group-major so that `scale.t()` is torch._scaled_mm's block-wise scale_a:
kvbuffer.reference.fp8.quantize_activations_padded, bit for bit. CPU: the reference. CUDA: the fused
kernel (tiles/fp8_quant.py, x in bf16 or fp16) where it loads, is built on first use or JIT-compiles,
else the reference on the GPU (the reason logged once per shape).

A fake serves torch.compile for each. Every implementation first checks what reads no tensor data.
"""

from __future__ import annotations

import logging

import torch

from ..checks import check_same_device, check_tensor
from ..errors import ArtifactError, DeviceError, DTypeError
from ..reference import fp8 as ref_fp8
from . import autobuild, launch, lookup, specs
from .compiled import ACT_DTYPES, CompiledOp, check_contiguous, check_on_cuda, expect_kind
from .keys import FP8_DTYPE, GEMV_DTYPES, GemvDims, KernelKey, dtype_name

log = logging.getLogger("kvbuffer")


def check_call(x, q, scale, block_n: int, block_k: int) -> None:
    """The checks every implementation runs first: devices, shapes and dtypes."""
    check_same_device(dict(x=x, q=q, scale=scale))
    check_tensor("x", x, (None, None), tuple(ACT_DTYPES.values()))
    ref_fp8.check_scaled_weight(q, scale, (block_n, block_k))
    check_tensor("q", q, (None, x.shape[1]))


@torch.library.custom_op("kvbuffer::fp8_gemv", mutates_args=(), device_types="cpu")
def fp8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """reference.fp8.linear: x (rows, K) . (q * scale)^T -> (rows, N) in x's dtype."""
    check_call(x, q, scale, block_n, block_k)
    return ref_fp8.linear(x, q, scale, (block_n, block_k)).contiguous()


@fp8_gemv.register_fake
def _fake(x, q, scale, block_n, block_k):
    check_call(x, q, scale, block_n, block_k)
    return x.new_empty(x.shape[0], q.shape[0])


@fp8_gemv.register_kernel("cuda")
def _cuda(x, q, scale, block_n, block_k):
    check_call(x, q, scale, block_n, block_k)
    kernel_dtypes = tuple(ACT_DTYPES[d] for d in GEMV_DTYPES)
    if x.dtype not in kernel_dtypes:  # before the lookup: no kernel is built for a call that cannot run
        raise DTypeError(f"x must be bfloat16 or float16 for the FP8 one-row kernel on CUDA, got {x.dtype}")
    return launch.fp8_gemv(x, q, scale, block_n, block_k)


# ----------------------------------------------------------------------------------------------
# the activation quantizer of a block-FP8 GEMM


def fp8_quant_key(K: int, dtype: str) -> KernelKey:
    """The quantizer kernel for x of K columns in `dtype` (a name): dims N = K, its scale block (1, GROUP)."""
    spec = specs.FP8_QUANT_ACT
    return KernelKey(spec.family, spec.op, GemvDims(int(K), int(K), 1, ref_fp8.GROUP), dtype, w_dtype=FP8_DTYPE)


def fp8_quant_fits(K: int, dtype: str) -> bool:
    """Whether the quantizer kernel takes x of K columns in `dtype` (a name)."""
    return dtype in GEMV_DTYPES and K >= ref_fp8.GROUP and K % ref_fp8.GROUP == 0


def build_fp8_quant_act(K: int, *, dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile the quantizer for x (any rows, K) in `dtype` for the local GPU (tunables:
    tiles.fp8_quant.DEFAULT's)."""
    key = fp8_quant_key(K, dtype)
    return specs.spec_for(key).build(key, tunables)


def run_fp8_quant_act(op: CompiledOp, x: torch.Tensor, q: torch.Tensor | None = None,
                      scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x (M, K) on the compiled quantizer `op` into q (Mp, K) float8_e4m3fn and scale
    (K / 128, Mp) fp32 (allocated when not given), all contiguous on CUDA; every tensor checked first."""
    expect_kind(op, "fp8_quant_act")
    p = op.params
    dev = x.device if isinstance(x, torch.Tensor) else None
    check_tensor("x", x, (None, p["K"]), (ACT_DTYPES[p["dtype"]],), dev)
    check_on_cuda("x", dev)
    rows = ref_fp8.padded_rows(x.shape[0])
    shapes = {"q": ((rows, p["K"]), ref_fp8.FP8), "scale": ((p["K"] // ref_fp8.GROUP, rows), torch.float32)}
    given = {"q": q, "scale": scale}
    for name, (shape, dtype) in shapes.items():
        if given[name] is None:
            given[name] = torch.empty(shape, dtype=dtype, device=dev)
        check_tensor(name, given[name], shape, (dtype,), dev)
    for name, t in (("x", x), *given.items()):
        check_contiguous(name, t)
    if rows:
        op.fn(x, given["q"], given["scale"])
    return given["q"], given["scale"]


def launch_fp8_quant_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer's kernel for x looked up (artifact cache, else JIT, else ArtifactError) and run on
    torch's stream."""
    op = lookup.kernel_for(fp8_quant_key(x.shape[1], dtype_name(x)))
    return launch._on_torch_stream(run_fp8_quant_act, op, x)


_NO_KERNEL: set = set()  # (device, K, dtype name) where no quantizer kernel loads or builds (said once)


def _load_or_build(key: KernelKey) -> CompiledOp:
    """The kernel of `key`: from the artifact cache or a JIT compile (lookup.kernel_for), else built into the
    cache now (autobuild), else an ArtifactError saying why not."""
    try:
        return lookup.kernel_for(key)
    except ArtifactError:
        if lookup.jit_allowed():
            raise
        why = autobuild.ensure_gemv_kernels([key])
        if why is not None:
            raise ArtifactError(why) from None
        return lookup.kernel_for(key)


def quant_kernel(x: torch.Tensor) -> CompiledOp | None:
    """The quantizer kernel for CUDA x: from the artifact cache, a JIT compile, or built now on first use
    (kvbuffer.kernels.autobuild), held by lookup's one in-process cache (so clear_kernels forgets it); None
    where none loads or builds here (x's dtype or K not taken, no TileLang or nvcc,
    KVBUFFER_BUILD_KERNELS=0, a GPU TileLang has no target for), said once per device, K and dtype."""
    entry = (x.device, x.shape[1], dtype_name(x))
    if entry in _NO_KERNEL:
        return None
    if not fp8_quant_fits(x.shape[1], entry[2]):
        why = f"it takes bfloat16 or float16 x of K a multiple of {ref_fp8.GROUP}, got {entry[2]}, K = {x.shape[1]}"
    else:
        try:
            return _load_or_build(fp8_quant_key(x.shape[1], entry[2]))
        except (ArtifactError, DeviceError) as e:
            why = str(e).splitlines()[0]
    log.info("kvbuffer: block-FP8 activations of K = %d (%s) on %s are quantized with torch ops, not the fused "
             "kernel: %s", x.shape[1], entry[2], x.device, why)
    _NO_KERNEL.add(entry)
    return None


@torch.library.custom_op("kvbuffer::fp8_quant_act", mutates_args=(), device_types="cpu")
def fp8_quant_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.fp8.quantize_activations_padded: x (M, K) -> (q (Mp, K) e4m3fn, scale (K / 128, Mp) fp32)."""
    ref_fp8.check_activations(x)
    return ref_fp8.quantize_activations_padded(x)


@fp8_quant_act.register_fake
def _quant_fake(x):
    ref_fp8.check_activations(x)
    rows = ref_fp8.padded_rows(x.shape[0])  # a symbolic row count too
    return (x.new_empty(rows, x.shape[1], dtype=ref_fp8.FP8),
            x.new_empty(x.shape[1] // ref_fp8.GROUP, rows, dtype=torch.float32))


@fp8_quant_act.register_kernel("cuda")
def _quant_cuda(x):
    ref_fp8.check_activations(x)
    op = quant_kernel(x)
    if op is None:
        return ref_fp8.quantize_activations_padded(x)
    return launch._on_torch_stream(run_fp8_quant_act, op, x.contiguous())
