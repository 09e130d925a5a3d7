"""The one-token projections on their compiled TileLang kernels: compile (`build_gemv`, `build_gemv_experts`)
and validated launch. `gemv`: y = x W^T; `gemv_experts`: each row through each of its chosen experts' W
(a mixture-of-experts layer at a few tokens).

At one token a projection is bound by reading its weight; tiles/gemv.py streams it faster than
torch's GEMM does at that size. Semantics are `torch.nn.functional.linear(x, weight)` without a bias,
accumulated in fp32 and rounded once to the weight's dtype. The launcher checks every tensor
before the kernel runs (a bad call raises a typed error and writes nothing).
"""

from __future__ import annotations

import torch

from ..checks import check_expert_ids, check_tensor
from ..errors import ShapeError
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


GRID_ROWS = 65535  # CUDA's limit on a grid's y dimension: the experts kernel's (row, expert) pairs


def build_gemv_experts(N: int, K: int, *, dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile y[s, j] = x[s] . W[expert[s, j]]^T for experts' weights (E, N, K), any E, rows and k."""
    return build_template("gemv_experts", "gemv_experts", dict(N=N, K=K, dtype=dtype, **tunables), module="gemv")


def gemv_experts(op: CompiledOp, x: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor,
                 out: torch.Tensor | None = None, *, checked: bool = True) -> torch.Tensor:
    """x (S, K), weight (E, N, K), expert (S, J) int64 -> (S, J, N): each row through each of its J
    experts' weights. `checked` also reads the ids back to check they name experts (a sync); the
    kernel itself reads an id outside [0, E) as an expert of zero weights."""
    expect_kind(op, "gemv_experts")
    p = op.params
    dev = x.device if isinstance(x, torch.Tensor) else None
    dt = ACT_DTYPES[p["dtype"]]
    check_tensor("x", x, (None, p["K"]), (dt,), dev)
    check_on_cuda("x", dev)
    check_tensor("weight", weight, (None, p["N"], p["K"]), (dt,), dev)
    check_tensor("expert", expert, (x.shape[0], None), (torch.int64,), dev)
    for name, t in (("x", x), ("weight", weight), ("expert", expert)):
        check_contiguous(name, t)
    if expert.numel() > GRID_ROWS:
        raise ShapeError(f"gemv_experts runs one block row per (row, expert) pair, at most {GRID_ROWS}; got "
                         f"{x.shape[0]} x {expert.shape[1]} (more tokens are the grouped matmul's)")
    if checked:
        check_expert_ids(expert, weight.shape[0])
    out = out_tensor(out, (x.shape[0], expert.shape[1], p["N"]), x)
    if out.numel():
        op.fn(x, weight, expert, out)
    return out
