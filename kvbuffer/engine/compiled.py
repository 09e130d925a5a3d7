"""The decode and verify forwards under torch.compile (Inductor): the glue between the GEMMs and
the state kernels fused.

Between its GEMMs and state kernels a decode step of the 9B runs hundreds of small launches: norms
and their residual adds, the q/k/v split and its copies, gates, rotary, MoE routing. Inductor fuses
them into a few kernels; kvbuffer's kernels stay graph nodes as the `torch.ops.kvbuffer.*` custom
ops (their fakes trace them; kvbuffer.kernels.launch.engine_rows calls the op while compiling). The
compiled forward runs inside kvbuffer's own CUDA graphs (StepGraphs), so Inductor's own graphs are
off (mode "default"). Dynamo keeps its compilations per model class (the forward's code): engines
built one after another in one process add to that cache (torch._dynamo.reset() between them, as
kvbuffer.bench.e2e does, starts afresh).
Prefill stays uncompiled: a chunk's buffer fill is a host value its chunk plan depends on, so every
fill would compile anew, for launches a long chunk does not wait on.
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
