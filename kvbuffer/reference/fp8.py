"""FP8 (e4m3) semantics the FP8 kernels are tested against: a weight scaled by block and its product
(the FP8 one-row kernel), and the activations quantized per token and GROUP columns (the activation
quantizer in front of a block-FP8 GEMM).

A weight W (N, K) is kept as q (N, K) float8_e4m3fn and an fp32 scale grid (ceil(N / bn), ceil(K / bk))
with W[i, j] = q[i, j] * scale[i // bn, j // bk] for the block (bn, bk): (128, 128) in the block FP8
checkpoints, (1, K) for one scale per row. Partial blocks at the edges count.
"""

from __future__ import annotations

import torch

from ..checks import check_tensor
from ..errors import ShapeError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
GROUP = 128  # activations are quantized per token and per this many columns (block FP8)
AMAX_FLOOR = 1e-12  # a group's amax is raised to this before it scales (an all-zero group: q = 0)
ROW_MULTIPLE = 4  # _scaled_mm's 1 x 128 activation scales need a column stride of 16 bytes: rows pad to this


def scale_grid(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid's shape for an (n, k) weight in (bn, bk) blocks."""
    return -(-n // block[0]), -(-k // block[1])


def check_scaled_weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    """q (N, K) float8_e4m3fn and scale, fp32 of q's grid for `block` (bn, bk >= 1)."""
    bn, bk = block
    if bn < 1 or bk < 1:
        raise ShapeError(f"the scale block (bn, bk) must be positive, got ({bn}, {bk})")
    check_tensor("q", q, (None, None), (FP8,))
    check_tensor("scale", scale, scale_grid(q.shape[0], q.shape[1], block), (torch.float32,))


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W = q * scale block by block, in fp32."""
    s = scale.float().repeat_interleave(block[0], 0)[: q.shape[0]]
    return q.float() * s.repeat_interleave(block[1], 1)[:, : q.shape[1]]


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x (..., K) . W^T for W = dequantize(q, scale, block), in fp32 (fp64 for an fp64 x), rounded once to
    x's dtype: weight-only dequantization, x as it is."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return torch.nn.functional.linear(x.to(acc), dequantize(q, scale, block).to(acc)).to(x.dtype)


def check_activations(x: torch.Tensor) -> None:
    """x (M, K) floating, K a positive multiple of GROUP: what activation quantization takes."""
    check_tensor("x", x, (None, None), (torch.bfloat16, torch.float16, torch.float32))
    if x.shape[1] < GROUP or x.shape[1] % GROUP:
        raise ShapeError(f"x's columns must be a positive multiple of {GROUP} (one scale per {GROUP}), got "
                         f"x of shape {tuple(x.shape)}")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (M, K) e4m3fn, scale (M, K / GROUP) fp32) of x (M, K): one scale per token and GROUP columns,
    the dynamic activation scheme of block FP8. In fp32: s = max(amax, AMAX_FLOOR) / FP8_MAX, q =
    clamp(x / s, -FP8_MAX, FP8_MAX) rounded to e4m3; a NaN in a group makes its scale and q NaN."""
    m, k = x.shape
    g = x.float().view(m, k // GROUP, GROUP)
    amax = g.abs().amax(-1).clamp(min=AMAX_FLOOR)
    # a divisor tensor, not a Python number: torch's CUDA division by a host scalar multiplies by its
    # reciprocal (a bit off the correctly rounded quotient), so the bits would differ by device
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, k)
    return q, scale


def padded_rows(m: int) -> int:
    """The rows a block-FP8 GEMM's quantized activations take: m rounded up to ROW_MULTIPLE."""
    return -(-m // ROW_MULTIPLE) * ROW_MULTIPLE


def quantize_activations_padded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (Mp, K) e4m3fn, scale (K / GROUP, Mp) fp32) for x (M, K), Mp = padded_rows(M): x padded with
    rows of zeros and quantized by quantize_activations, its scales stored group-major, so that
    `scale.t()` is the column-major scale_a torch._scaled_mm takes for 1 x 128 block-wise scaling."""
    check_activations(x)
    m, k = x.shape
    padded = x.new_zeros(padded_rows(m), k)
    padded[:m] = x
    q, scale = quantize_activations(padded)
    return q, scale.t().contiguous()
