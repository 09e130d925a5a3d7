"""An FP8 weight scaled by block, and its product: the semantics the FP8 one-row kernel is tested against.

A weight W (N, K) is kept as q (N, K) float8_e4m3fn and an fp32 scale grid (ceil(N / bn), ceil(K / bk))
with W[i, j] = q[i, j] * scale[i // bn, j // bk] for the block (bn, bk): (128, 128) in the block FP8
checkpoints, (1, K) for one scale per row. Partial blocks at the edges count.
"""

from __future__ import annotations

import torch

from ..checks import check_tensor
from ..errors import ShapeError

FP8 = torch.float8_e4m3fn


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
