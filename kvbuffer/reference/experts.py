"""A mixture-of-experts layer's matmul over rows sorted by expert: the semantics of the grouped
experts kernel (torch.ops.kvbuffer.grouped_experts, whose CPU implementation this is) and, being
torch's own grouped matmul where that serves the dtype, also the engine's path where the kernel is
not built or not taken.

    x (M, K) sorted by expert; weight (E, N, K); ends (E,) int32, expert e's rows ending at ends[e]
    (expert e holds rows ends[e - 1] .. ends[e], ends[-1] = M); y (M, N), y[r] = x[r] . weight[e(r)]^T
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's grouped matmul serves bf16 on CUDA and fp32/bf16 on CPU, contiguous, with every row
    16-byte aligned; anything else loops over the experts."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype or not (x.is_contiguous() and w.is_contiguous()):
        return False
    if x.dtype not in ((torch.bfloat16,) if x.is_cuda else (torch.float32, torch.bfloat16)):
        return False
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], w.shape[1], w.shape[2]))


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert times w[e]^T: (M, N) for w (E, N, K).

    The grouped matmul reads the ends on the device; only the fallback loop needs them on the
    host (a sync, so that path cannot be captured in a CUDA graph).
    """
    if grouped_ok(x, w):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends)
    parts, start = [], 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            parts.append(F.linear(x[start:end], w[e]))
        start = end
    return torch.cat(parts) if parts else x.new_zeros((0, w.shape[1]))
