"""The one-token projection y = x W^T on its compiled TileLang kernel: compile (`build_gemv`) and validated launch.

At one token a projection is bound by reading its weight; tiles/gemv.py streams it faster than
torch's GEMM does at that size. Semantics are `torch.nn.functional.linear(x, weight)` without a bias,
accumulated in fp32 and rounded once to the weight's dtype. The launcher checks every tensor
before the kernel runs (a bad call raises a typed error and writes nothing).
"""

from __future__ import annotations

import torch

from ..checks import check_tensor
from .compiled import ACT_DTYPES, CompiledOp, build_template, check_contiguous, check_on_cuda, expect_kind, out_tensor


def build_gemv(N: int, K: int, rows: int = 1, *, dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile y (rows, N) = x (rows, K) . W (N, K)^T for the local GPU (tunables: tiles.gemv.DEFAULT's)."""
    return build_template("gemv", "gemv", dict(N=N, K=K, rows=rows, dtype=dtype, **tunables), module="gemv")


def gemv(op: CompiledOp, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, K) . weight (N, K)^T -> (rows, N), all contiguous in the kernel's dtype."""
    expect_kind(op, "gemv")
    p = op.params
    dev = x.device if isinstance(x, torch.Tensor) else None
    dt = ACT_DTYPES[p["dtype"]]
    check_tensor("x", x, (p["rows"], p["K"]), (dt,), dev)
    check_on_cuda("x", dev)
    check_tensor("weight", weight, (p["N"], p["K"]), (dt,), dev)
    for name, t in (("x", x), ("weight", weight)):
        check_contiguous(name, t)
    out = out_tensor(out, (p["rows"], p["N"]), x)
    op.fn(x, weight, out)
    return out
