"""`torch.ops.kvbuffer.fp8_gemv`: the one-row projection with an FP8 weight, as a torch custom op.

    torch.ops.kvbuffer.fp8_gemv(x, q, scale, block_n, block_k) -> (rows, N)

x (rows, K) times W^T for W = q * scale by block (kvbuffer.reference.fp8): q (N, K) float8_e4m3fn,
scale fp32 (ceil(N / block_n), ceil(K / block_k)); accumulated in fp32, rounded once to x's dtype; x is
not quantized. CPU: the reference. CUDA: the FP8 one-row kernel (kvbuffer.kernels.launch.fp8_gemv; x in
bf16 or fp16). A fake serves torch.compile. Every implementation first checks what reads no tensor
data: one device, x's rank and dtype, q's and scale's shapes (the scale grid) and dtypes.
"""

from __future__ import annotations

import torch

from ..checks import check_same_device, check_tensor
from ..errors import DTypeError
from ..reference import fp8 as ref_fp8
from . import launch
from .compiled import ACT_DTYPES
from .keys import GEMV_DTYPES


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
