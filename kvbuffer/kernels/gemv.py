"""The projections on their compiled TileLang kernels: compile (`build_gemv`, `build_fp8_gemv`,
`build_gemv_experts`, `build_grouped_experts`) and validated launch. `gemv`: y = x W^T; `fp8_gemv`: the
same with an FP8 weight W = q * scale by block (kvbuffer.reference.fp8), x unquantized; `gemv_experts`:
each row through each of its chosen experts' W (a mixture-of-experts layer at a few tokens);
`grouped_experts`: rows sorted by expert, each through its expert's W (the same layer at any token
count, tiles/grouped.py).

At one token a projection is bound by reading its weight; tiles/gemv.py streams it faster than
torch's GEMM does at that size. Semantics are `torch.nn.functional.linear(x, weight)` without a bias,
accumulated in fp32 and rounded once to the weight's dtype. The launcher checks every tensor
before the kernel runs (a bad call raises a typed error and writes nothing).
"""

from __future__ import annotations

import torch

from ..checks import check_expert_ends, check_expert_ids, check_tensor
from ..errors import ShapeError
from ..reference.fp8 import FP8, scale_grid
from .compiled import ACT_DTYPES, CompiledOp, check_contiguous, check_on_cuda, expect_kind, out_tensor
from .keys import FP8_DTYPE, GemvDims, KernelKey
from .specs import spec_for


def build_gemv(N: int, K: int, rows: int = 1, *, dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile y (rows, N) = x (rows, K) . W (N, K)^T for the local GPU (tunables: tiles.gemv.DEFAULT's)."""
    key = KernelKey("gemv", "gemv", GemvDims(N, K), dtype, T=rows)
    return spec_for(key).build(key, tunables)


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


def build_fp8_gemv(N: int, K: int, block: tuple[int, int], rows: int = 1, *, dtype: str = "bfloat16",
                   **tunables) -> CompiledOp:
    """Compile y (rows, N) = x (rows, K) . (q * scale)^T for an FP8 weight q (N, K) scaled per `block`
    (bn, bk), x and y in `dtype`, for the local GPU (tunables: tiles.gemv.FP8_DEFAULT's)."""
    key = KernelKey("gemv", "fp8_gemv", GemvDims(N, K, *block), dtype, w_dtype=FP8_DTYPE, T=rows)
    return spec_for(key).build(key, tunables)


def fp8_gemv(op: CompiledOp, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, K) . (q * scale)^T -> (rows, N) in x's dtype: q (N, K) float8_e4m3fn, scale fp32 of the
    kernel's block grid (ceil(N / bn), ceil(K / bk)), x in the kernel's dtype, all contiguous on CUDA."""
    expect_kind(op, "fp8_gemv")
    p = op.params
    dev = x.device if isinstance(x, torch.Tensor) else None
    check_tensor("x", x, (p["rows"], p["K"]), (ACT_DTYPES[p["dtype"]],), dev)
    check_on_cuda("x", dev)
    check_tensor("q", q, (p["N"], p["K"]), (FP8,), dev)
    check_tensor("scale", scale, scale_grid(p["N"], p["K"], (p["bn"], p["bk"])), (torch.float32,), dev)
    for name, t in (("x", x), ("q", q), ("scale", scale)):
        check_contiguous(name, t)
    out = out_tensor(out, (p["rows"], p["N"]), x)
    op.fn(x, q, scale, out)
    return out


GRID_ROWS = 65535  # CUDA's limit on a grid's y dimension: the experts kernel's (row, expert) pairs


def _check_experts_call(op: CompiledOp, kind: str, x, weight, index_name: str, index, index_shape, index_dtype):
    """What both experts launchers check: the kernel's kind, x (rows, K) and the experts' weight
    (E, N, K) in its dtype on CUDA, the routing tensor's shape and dtype, all contiguous."""
    expect_kind(op, kind)
    p = op.params
    dev = x.device if isinstance(x, torch.Tensor) else None
    dt = ACT_DTYPES[p["dtype"]]
    check_tensor("x", x, (None, p["K"]), (dt,), dev)
    check_on_cuda("x", dev)
    check_tensor("weight", weight, (None, p["N"], p["K"]), (dt,), dev)
    check_tensor(index_name, index, index_shape, (index_dtype,), dev)
    for name, t in (("x", x), ("weight", weight), (index_name, index)):
        check_contiguous(name, t)


def build_gemv_experts(N: int, K: int, *, dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile y[s, j] = x[s] . W[expert[s, j]]^T for experts' weights (E, N, K), any E, rows and k."""
    key = KernelKey("gemv", "experts", GemvDims(N, K), dtype)
    return spec_for(key).build(key, tunables)


def gemv_experts(op: CompiledOp, x: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor,
                 out: torch.Tensor | None = None, *, checked: bool = True) -> torch.Tensor:
    """x (S, K), weight (E, N, K), expert (S, J) int64 -> (S, J, N): each row through each of its J
    experts' weights. `checked` also reads the ids back to check they name experts (a sync); the
    kernel itself reads an id outside [0, E) as an expert of zero weights."""
    _check_experts_call(op, "gemv_experts", x, weight, "expert", expert, (x.shape[0], None), torch.int64)
    p = op.params
    if expert.numel() > GRID_ROWS:
        raise ShapeError(f"gemv_experts runs one block row per (row, expert) pair, at most {GRID_ROWS}; got "
                         f"{x.shape[0]} x {expert.shape[1]} (more tokens are the grouped matmul's)")
    if checked:
        check_expert_ids(expert, weight.shape[0])
    out = out_tensor(out, (x.shape[0], expert.shape[1], p["N"]), x)
    if out.numel():
        op.fn(x, weight, expert, out)
    return out


def build_grouped_experts(N: int, K: int, *, dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile y[r] = x[r] . W[e(r)]^T for rows sorted by expert and experts' weights (E, N, K), any E
    and rows (tunables: tiles.grouped.DEFAULT's)."""
    key = KernelKey("gemv", "grouped", GemvDims(N, K), dtype)
    return spec_for(key).build(key, tunables)


def grouped_experts(op: CompiledOp, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
                    out: torch.Tensor | None = None, *, checked: bool = True) -> torch.Tensor:
    """x (M, K) sorted by expert, weight (E, N, K), ends (E,) int32 (expert e's rows end at ends[e]) ->
    (M, N): torch._grouped_mm(x, weight.transpose(1, 2), offs=ends). `checked` also reads the ends back
    to check they partition x's rows (a sync)."""
    weight_experts = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() else None
    _check_experts_call(op, "grouped_experts", x, weight, "ends", ends, (weight_experts,), torch.int32)
    p = op.params
    if weight.shape[0] > GRID_ROWS:
        raise ShapeError(f"grouped_experts runs one block row per expert, at most {GRID_ROWS}; got {weight.shape[0]}")
    if checked:
        check_expert_ends(ends, x.shape[0])
    out = out_tensor(out, (x.shape[0], p["N"]), x)
    if out.numel():
        op.fn(x, weight, ends, out)
    return out
