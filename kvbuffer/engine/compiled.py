"""The decode and verify forwards under torch.compile (Inductor), kvbuffer's kernels kept as custom-op
graph nodes, so the glue between the GEMMs and the state kernels is fused.

The compiled forward runs inside kvbuffer's own CUDA graphs (StepGraphs), so Inductor's are off.
Dynamo keeps its compilations per model class; torch._dynamo.reset() between engines starts afresh.
A prompt's forward stays eager (its chunk plan depends on each buffer fill, which would compile anew);
its elementwise stretches run as compiled regions instead (kvbuffer.models.fused).
A compilation is said on one stderr line (CompiledForward); kvbuffer's commands keep Inductor's
caches in kvbuffer's cache folder (keep_inductor_cache), so a later run compiles from them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("kvbuffer")

COMPILED_PHASES = ("decode", "verify")
OPTIONS = (True, False, "auto")
INDUCTOR_DIR = "torchinductor"  # Inductor's caches, inside kvbuffer's cache folder (keep_inductor_cache)
# decode steps a run must expect before compiling them repays: a compile takes tens of seconds for a large
# model (less from Inductor's cache) and saves a few milliseconds a step (docs/results.md)
COMPILE_MIN_STEPS = 4096
REPORT_SECONDS = 2.0  # a later compilation (a new shape) that takes this long is said on one line


def use_compile(option, device: torch.device, cuda_graphs: bool, why_no_graphs: str | None = None) -> bool:
    """LLM(compile=...) -> whether the forwards are compiled. "auto": on CUDA with CUDA graphs (a
    compile that fails then falls back to the uncompiled forward before anything was written; see
    ModelRunner._replayed); on CUDA without them, one WARNING line says why (`why_no_graphs`).
    True: wherever torch.compile runs (CPU included, with a C++ compiler)."""
    if option not in OPTIONS:
        raise ValueError(f"compile must be True, False or 'auto', got {option!r}")
    if option != "auto":
        return option
    if device.type == "cuda" and not cuda_graphs:  # the user's own choice (no reason given) is no news
        log.log(logging.WARNING if why_no_graphs else logging.INFO, "kvbuffer: decode steps run uncompiled: %s",
                why_no_graphs or "CUDA graphs or the kernels are off")
    return device.type == "cuda" and cuda_graphs


def worth_compiling(steps: int) -> bool:
    """Whether a run of `steps` decode steps repays compiling them (COMPILE_MIN_STEPS): a short run
    such as the demo's would spend longer compiling than all its steps take."""
    return steps >= COMPILE_MIN_STEPS


def compile_forward(model: torch.nn.Module, caches, stream=None) -> "CompiledForward":
    """The model's forward compiled by Inductor (graph breaks allowed: a path that cannot be traced
    runs eagerly between compiled parts).

    Shapes are static at first and turn dynamic where they change (rows, the attention window), so
    a few compilations serve every bucket. The caches' tensors are marked static: their sizes never
    change within an engine, and with dynamic pool sizes Inductor (torch 2.13) got the mutations of
    the custom ops on views of one pool wrong (tests/engine/test_graphs.py)."""
    for t in caches.tensors().values():
        torch._dynamo.mark_static(t)
    log.info("kvbuffer: the decode and verify forwards are compiled (torch.compile, Inductor)")
    return CompiledForward(torch.compile(model), stream)


class CompiledForward:
    """A compiled forward that says on one stderr line when it compiles: its first call (where
    Dynamo traces and Inductor compiles or loads from its cache) as `compiling ... done in N s`, and
    a later call that compiled a new graph (Dynamo's count of them grew) for REPORT_SECONDS or more."""

    def __init__(self, fn, stream=None):
        self.fn, self.stream, self.calls = fn, stream, 0

    def __call__(self, *args, **kwargs):
        from torch._dynamo.utils import counters

        self.calls += 1
        if self.calls == 1:
            with said_compiling("the decode step", self.stream):
                return self.fn(*args, **kwargs)
        graphs, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - t0
            if counters["stats"]["unique_graphs"] > graphs and seconds >= REPORT_SECONDS:
                (self.stream or sys.stderr).write(
                    f"kvbuffer: compiled the decode step again for a new shape in {seconds:.1f}s\n")


@contextlib.contextmanager
def said_compiling(what: str, stream=None):
    """A first compilation said on one stderr line: `kvbuffer: compiling <what> (torch.compile; Inductor's
    cache: <folder>)... done in N s` (the end written even if the work fails)."""
    stream = stream or sys.stderr
    stream.write(f"kvbuffer: compiling {what} (torch.compile; Inductor's cache: {inductor_cache()})...")
    stream.flush()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        stream.write(f" done in {time.perf_counter() - t0:.1f}s\n")


def inductor_cache() -> str:
    """Where Inductor keeps its caches in this process ($TORCHINDUCTOR_CACHE_DIR, else torch's default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cache_dir()


def keep_inductor_cache(environ=os.environ) -> Path | None:
    """For kvbuffer's own commands: Inductor's caches (FX graphs, autotuning, Triton) in INDUCTOR_DIR
    of kvbuffer's cache folder, so that a later run compiles from them. Only where that folder is
    marked as kvbuffer's (a first-use build or `kvbuffer tune` wrote it) and the caller has not
    chosen a folder ($TORCHINDUCTOR_CACHE_DIR set): returns the folder set, else None."""
    from ..artifacts import MARKER, MARKER_TEXT, cache_dir

    if environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    root = cache_dir()
    try:
        marked = (root / MARKER).read_text().startswith(MARKER_TEXT)
    except (OSError, ValueError):
        marked = False
    if not marked:
        return None
    folder = root / INDUCTOR_DIR
    environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder
