"""Which of a model's projections run a one-token forward on the one-row kernel (LLM(gemv=...)).

A B = 1 decode step is mostly projections, each bound by reading its weight once, and kvbuffer's
one-row kernel (tiles/gemv.py) streams them faster than torch's GEMM does at one row
(docs/kernels.md, "One-token projections"). `use_one_row_kernel` turns it on for every bias-free projection
(kvbuffer.models.layers.one_row_linears) whose kernel loads: from the artifact cache, or built there
once (untuned) when TileLang and nvcc are here (kvbuffer.kernels.autobuild), or JIT-compiled with
KVBUFFER_JIT=1. A projection whose kernel is not there keeps torch's GEMM; nothing else changes.
Forwards of more than one token never take it.
"""

from __future__ import annotations

import logging

import torch

from ..errors import ArtifactError
from ..kernels import autobuild, launch, lookup
from ..kernels.keys import dtype_name, gemv_fits
from ..models.layers import one_row_linears

log = logging.getLogger("kvbuffer")

OPTIONS = (True, False, "auto")


def use_one_row_kernel(model: torch.nn.Module, option, kernels: bool) -> str:
    """LLM(gemv=...): set each projection's `one_row`; returns one line saying what runs where.

    "auto" and True: on CUDA with the compiled kernels, where each projection's kernel loads (True
    raises if one cannot); False: torch's GEMM everywhere."""
    if option not in OPTIONS:
        raise ValueError(f"gemv must be True, False or 'auto', got {option!r}")
    mods = one_row_linears(model)
    for m in mods:
        m.one_row = False
    if option is False:
        return "gemv=False"
    if not kernels:
        if option is True:
            raise ValueError("gemv=True needs the compiled kernels (kernels=True on a CUDA device)")
        return "the linear layers run on the reference ops"
    fits = [m for m in mods if m.weight.is_cuda and gemv_fits(m.weight.shape[1], dtype_name(m.weight))]
    keys = {m: launch.gemv_key(m.weight) for m in fits}
    missing = _missing(set(keys.values()))
    if missing and not lookup.jit_allowed():
        unbuilt = autobuild.ensure_gemv_kernels(sorted(missing, key=str))
        missing = _missing(missing)
        if unbuilt:
            log.info("kvbuffer: one-token projections on torch's GEMM where not built (%s)", unbuilt)
    if missing and option is True:
        raise ValueError(f"gemv=True, but {len(missing)} projection kernel(s) neither load nor build here")
    for m, key in keys.items():
        m.one_row = key not in missing
    on = sum(m.one_row for m in mods)
    log.info("kvbuffer: %d of %d projections run one-token forwards on the one-row kernel", on, len(mods))
    return f"{on} of {len(mods)} projections"


def _missing(keys: set) -> set:
    """The keys whose kernel neither loads from the artifact cache nor JIT-compiles here."""
    out = set()
    for key in keys:
        try:
            lookup.kernel_for(key, 1)
        except ArtifactError:
            out.add(key)
    return out
