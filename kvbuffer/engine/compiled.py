"""The decode and verify forwards under torch.compile (Inductor), kvbuffer's kernels kept as custom-op
graph nodes, so the glue between the GEMMs and the state kernels is fused.

The compiled forward runs inside kvbuffer's own CUDA graphs (StepGraphs), so Inductor's are off.
Dynamo keeps its compilations per model class; torch._dynamo.reset() between engines starts afresh.
Prefill stays uncompiled: its chunk plan depends on each buffer fill, which would compile anew.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("kvbuffer")

COMPILED_PHASES = ("decode", "verify")
OPTIONS = (True, False, "auto")


def use_compile(option, device: torch.device, cuda_graphs: bool) -> bool:
    """LLM(compile=...) -> whether the forwards are compiled. "auto": on CUDA with CUDA graphs (a
    compile that fails then falls back to the uncompiled forward before anything was written; see
    ModelRunner._replayed); True: wherever torch.compile runs (CPU included, with a C++ compiler)."""
    if option not in OPTIONS:
        raise ValueError(f"compile must be True, False or 'auto', got {option!r}")
    if option == "auto":
        return device.type == "cuda" and cuda_graphs
    return option


def compile_forward(model: torch.nn.Module, caches):
    """The model's forward compiled by Inductor (graph breaks allowed: a path that cannot be traced
    runs eagerly between compiled parts).

    Shapes are static at first and turn dynamic where they change (rows, the attention window), so
    a few compilations serve every bucket. The caches' tensors are marked static: their sizes never
    change within an engine, and with dynamic pool sizes Inductor (torch 2.13) got the mutations of
    the custom ops on views of one pool wrong (tests/engine/test_graphs.py)."""
    for t in caches.tensors().values():
        torch._dynamo.mark_static(t)
    log.info("kvbuffer: the decode and verify forwards are compiled (torch.compile, Inductor)")
    return torch.compile(model)
