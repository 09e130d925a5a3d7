"""The projection kernels' tuner templates (tiles/gemv.py, tiles/grouped.py), families "gemv", "experts",
"grouped" and "fp8_gemv"; their shape is kvbuffer.kernels.keys.projection_shape (one expert's N, K for
the experts'; the scale block bn, bk for the FP8 weight's).

    gemv            y (1, N) = x (1, K) . W^T
    fp8_gemv        y (1, N) = x (1, K) . (q * scale)^T, q float8_e4m3fn, scale per (bn, bk) block
    gemv_experts    y (1, J, N) = x (1, K) . W[e_j]^T for EXPERTS_TIMED experts of a (J, N, K) stack
    grouped_experts y (M, N) = x (M, K) . W[e(r)]^T, GROUPED_EXPERTS experts' rows cycling through GROUPED_ROWS

They depend on no chunk size or buffer layout, and every batch bucket times the same load (the grouped
kernel's: a decode step's routed load at a few hundred requests). Inputs: x ~ N(0, 1), W ~ N(0, 1 / K)
(FP8: q spread over e4m3's range, scales of the same product scale); the check is against the product
in fp64.
"""

from __future__ import annotations

import importlib.util

from kvbuffer.kernels.keys import FP8_DTYPE, GemvDims, KernelKey
from kvbuffer.kernels.specs import SPECS

from .template import Template, from_spec

GEMV_TILES, GROUPED_TILES = "kvbuffer.tiles.gemv", "kvbuffer.tiles.grouped"


def _key(op: str):
    return lambda shape, chunk, drafts: KernelKey("gemv", op, GemvDims(shape["N"], shape["K"]), shape["dtype"])


def _inputs(shape, batch, chunk_size, device, gen):
    import torch

    dt = getattr(torch, shape["dtype"])
    N, K = shape["N"], shape["K"]
    x = torch.randn(1, K, generator=gen, device=device).to(dt)
    w = (torch.randn(N, K, generator=gen, device=device) * K ** -0.5).to(dt)
    return dict(x=x, weight=w, out=torch.empty(1, N, device=device, dtype=dt))


def _reference(shape, chunk_size, args):
    return {"out": args["x"].double() @ args["weight"].double().T}


def _fp8_key(shape, chunk, drafts):
    dims = GemvDims(shape["N"], shape["K"], shape["bn"], shape["bk"])
    return KernelKey("gemv", "fp8_gemv", dims, shape["dtype"], w_dtype=FP8_DTYPE)


def _fp8_inputs(shape, batch, chunk_size, device, gen):
    import torch

    from kvbuffer.reference.fp8 import FP8, scale_grid

    dt = getattr(torch, shape["dtype"])
    N, K = shape["N"], shape["K"]
    x = torch.randn(1, K, generator=gen, device=device).to(dt)
    q = (torch.randn(N, K, generator=gen, device=device) * 64).clamp(-448, 448).to(FP8)
    grid = scale_grid(N, K, (shape["bn"], shape["bk"]))
    scale = (0.5 + torch.rand(grid, generator=gen, device=device)) / (64 * K ** 0.5)
    return dict(x=x, q=q, scale=scale, out=torch.empty(1, N, device=device, dtype=dt))


def _fp8_reference(shape, chunk_size, args):
    from kvbuffer.reference.fp8 import dequantize

    w = dequantize(args["q"], args["scale"], (shape["bn"], shape["bk"]))
    return {"out": args["x"].double() @ w.double().T}


EXPERTS_TIMED = 8  # experts a timed call reads (Nemotron-3 takes 6 per token, Qwen3.5's MoE models 8)


def _experts_inputs(shape, batch, chunk_size, device, gen):
    import torch

    dt = getattr(torch, shape["dtype"])
    N, K, J = shape["N"], shape["K"], EXPERTS_TIMED
    x = torch.randn(1, K, generator=gen, device=device).to(dt)
    w = (torch.randn(J, N, K, generator=gen, device=device) * K ** -0.5).to(dt)
    ids = torch.randperm(J, generator=gen, device=device)[None]
    return dict(x=x, weight=w, expert=ids, out=torch.empty(1, J, N, device=device, dtype=dt))


def _experts_reference(shape, chunk_size, args):
    x, w, ids = args["x"], args["weight"], args["expert"]
    return {"out": (w[ids[0]].double() @ x.double()[0]).unsqueeze(0)}  # (1, J, N)


GROUPED_EXPERTS, GROUPED_ROWS = 32, (6, 12, 18, 24, 24, 30, 36, 42)  # experts a timed call reads, the rows they get


def grouped_counts() -> list[int]:
    """The rows each expert of a timed grouped experts call gets."""
    return [GROUPED_ROWS[e % len(GROUPED_ROWS)] for e in range(GROUPED_EXPERTS)]


def _grouped_inputs(shape, batch, chunk_size, device, gen):
    import torch

    dt = getattr(torch, shape["dtype"])
    N, K, counts = shape["N"], shape["K"], torch.tensor(grouped_counts())
    x = torch.randn(int(counts.sum()), K, generator=gen, device=device).to(dt)
    w = (torch.randn(len(counts), N, K, generator=gen, device=device) * K ** -0.5).to(dt)
    ends = counts.cumsum(0).to(device=device, dtype=torch.int32)
    return dict(x=x, weight=w, ends=ends, out=torch.empty(x.shape[0], N, device=device, dtype=dt))


def _grouped_reference(shape, chunk_size, args):
    import torch

    ends = args["ends"].tolist()
    rows = args["x"].double().split([e - s for s, e in zip([0] + ends[:-1], ends)])
    return {"out": torch.cat([r @ w.double().T for r, w in zip(rows, args["weight"])])}  # (M, N)


def gemv_templates() -> list[Template]:
    if importlib.util.find_spec(GEMV_TILES) is None:
        return []
    spec = {op: SPECS[("gemv", op)] for op in ("gemv", "experts", "grouped", "fp8_gemv")}
    return [from_spec(spec["gemv"], "gemv", "gemv", _key("gemv"), _inputs, _reference, uses_chunk=False),
            from_spec(spec["experts"], "gemv_experts", "experts", _key("experts"), _experts_inputs,
                      _experts_reference, uses_chunk=False),
            from_spec(spec["grouped"], "grouped_experts", "grouped", _key("grouped"), _grouped_inputs,
                      _grouped_reference, uses_chunk=False),
            from_spec(spec["fp8_gemv"], "fp8_gemv", "fp8_gemv", _fp8_key, _fp8_inputs, _fp8_reference,
                      uses_chunk=False)]
