"""The projection kernels (tiles/gemv.py, tiles/grouped.py) as tuner templates, families "gemv",
"experts" and "grouped".

Its shape is kvbuffer.kernels.keys.projection_shape: {"family": "gemv", "N": output features, "K": input
features, "dtype"}; one per distinct weight matrix of a model's linear layers without bias
(kvbuffer.autotune.models.model_gemv_shapes). It depends on no chunk size and no buffer layout, and
only a one-token forward runs it, so the tuner's batch buckets all time the same one-row product
(the winner is the same in each).

    gemv            y (1, N) = x (1, K) . W^T
    gemv_experts    y (1, J, N) = x (1, K) . W[e_j]^T for J distinct experts of a (J, N, K) stack
    grouped_experts y (M, N) = x (M, K) . W[e(r)]^T for rows sorted by expert

The experts kernel's shape has the same fields, family "experts" (one expert's N, K and the dtype;
one per distinct expert weight of a model's routed experts, kvbuffer.autotune.models); it is timed
with EXPERTS_TIMED experts chosen, a mixture-of-experts layer's top-k at one token. The grouped
experts kernel's shape is family "grouped" (the same fields); it is timed with
GROUPED_EXPERTS experts whose rows cycle through GROUPED_ROWS, a decode step's routed load at a few
hundred requests (Nemotron-3-Nano at B = 512: ~24 rows for each of 128 experts on average, the busy
ones up to twice that on even routing, several times that on skewed), in every batch bucket alike; so
its winner is the best tile for that load, not for every load the engine gives it (from under one row
to a few hundred rows an expert).
Inputs: x and W drawn N(0, 1) and N(0, 1 / K), so outputs are O(1). The check compares against the
product in fp64.
"""

from __future__ import annotations

import importlib
import importlib.util

from .registry import Template, _compile, _run, source_digest

GEMV_TILES, GROUPED_TILES = "kvbuffer.tiles.gemv", "kvbuffer.tiles.grouped"


def _tiles():
    return importlib.import_module(GEMV_TILES)


def _build(shape, chunk_size, *, target, **t):
    return _compile(_tiles().gemv(shape["N"], shape["K"], 1, dtype=shape["dtype"], **t), target)


def _inputs(shape, batch, chunk_size, device, gen):
    import torch

    dt = getattr(torch, shape["dtype"])
    N, K = shape["N"], shape["K"]
    x = torch.randn(1, K, generator=gen, device=device).to(dt)
    w = (torch.randn(N, K, generator=gen, device=device) * K ** -0.5).to(dt)
    return [x, w, torch.empty(1, N, device=device, dtype=dt)]


def _reference(shape, chunk_size, args):
    x, w = args[0], args[1]
    return {2: x.double() @ w.double().T}


EXPERTS_TIMED = 8  # experts a timed call reads (Nemotron-3 takes 6 per token, Qwen3.5's MoE models 8)


def _build_experts(shape, chunk_size, *, target, **t):
    return _compile(_tiles().gemv_experts(shape["N"], shape["K"], dtype=shape["dtype"], **t), target)


def _experts_inputs(shape, batch, chunk_size, device, gen):
    import torch

    dt = getattr(torch, shape["dtype"])
    N, K, J = shape["N"], shape["K"], EXPERTS_TIMED
    x = torch.randn(1, K, generator=gen, device=device).to(dt)
    w = (torch.randn(J, N, K, generator=gen, device=device) * K ** -0.5).to(dt)
    ids = torch.randperm(J, generator=gen, device=device)[None]
    return [x, w, ids, torch.empty(1, J, N, device=device, dtype=dt)]


def _experts_reference(shape, chunk_size, args):
    x, w, ids = args[0], args[1], args[2]
    return {3: (w[ids[0]].double() @ x.double()[0]).unsqueeze(0)}  # (1, J, N)


GROUPED_EXPERTS, GROUPED_ROWS = 32, (6, 12, 18, 24, 24, 30, 36, 42)  # experts a timed call reads, the rows they get


def grouped_counts() -> list[int]:
    """The rows each expert of a timed grouped experts call gets."""
    return [GROUPED_ROWS[e % len(GROUPED_ROWS)] for e in range(GROUPED_EXPERTS)]


def _build_grouped(shape, chunk_size, *, target, **t):
    tiles = importlib.import_module(GROUPED_TILES)
    return _compile(tiles.grouped_experts(shape["N"], shape["K"], dtype=shape["dtype"], **t), target)


def _grouped_inputs(shape, batch, chunk_size, device, gen):
    import torch

    dt = getattr(torch, shape["dtype"])
    N, K, counts = shape["N"], shape["K"], torch.tensor(grouped_counts())
    x = torch.randn(int(counts.sum()), K, generator=gen, device=device).to(dt)
    w = (torch.randn(len(counts), N, K, generator=gen, device=device) * K ** -0.5).to(dt)
    ends = counts.cumsum(0).to(device=device, dtype=torch.int32)
    return [x, w, ends, torch.empty(x.shape[0], N, device=device, dtype=dt)]


def _grouped_reference(shape, chunk_size, args):
    import torch

    ends = args[2].tolist()
    rows = args[0].double().split([e - s for s, e in zip([0] + ends[:-1], ends)])
    return {3: torch.cat([r @ w.double().T for r, w in zip(rows, args[1])])}  # (M, N)


def gemv_templates() -> list[Template]:
    if importlib.util.find_spec(GEMV_TILES) is None:
        return []
    tiles = _tiles()
    grouped = importlib.import_module(GROUPED_TILES)
    return [Template("gemv", "gemv", _build, tiles.get_configs, dict(tiles.DEFAULT), _inputs, _reference, _run,
                     source_digest(), uses_chunk=False),
            Template("gemv_experts", "experts", _build_experts, tiles.get_configs, dict(tiles.DEFAULT),
                     _experts_inputs, _experts_reference, _run, source_digest(), uses_chunk=False),
            Template("grouped_experts", "grouped", _build_grouped, grouped.get_configs, dict(grouped.DEFAULT),
                     _grouped_inputs, _grouped_reference, _run, source_digest(), uses_chunk=False)]
