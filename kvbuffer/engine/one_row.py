"""Which of a model's projections run a one-token forward on the one-row kernel (EngineConfig.gemv).

`use_one_row_kernel` turns the one-row kernel on for every bias-free projection whose kernel loads
(from the artifact cache, built once by kvbuffer.kernels.autobuild, or JIT-compiled with
KVBUFFER_JIT=1), the FP8 one-row kernel for an FP8 checkpoint's projections; the others keep torch's
GEMM (FP8: kvbuffer.models.quant.fp8.gemm_path). Routed experts take the experts kernel in forwards of
up to EXPERT_TOKENS tokens and the grouped experts kernel up to GROUPED_TOKENS, where their kernels
load. Forwards of more tokens run torch's matmuls. Where each wins: docs/kernels.md.
"""

from __future__ import annotations

import logging

import torch

from ..errors import ArtifactError
from ..kernels import autobuild, launch, lookup
from ..kernels.keys import FP8_DTYPE, dtype_name, fp8_gemv_fits, gemv_fits, grouped_fits
from ..models.layers import RoutedExperts, one_row_experts, one_row_linears
from ..models.quant.linear import FP8Linear

log = logging.getLogger("kvbuffer")

OPTIONS = (True, False, "auto")
# most tokens a forward's routed experts run on the experts kernel (it reads each token's experts
# apart, so past a few tokens the grouped matmul wins; docs/kernels.md, "Routed experts at a few tokens")
EXPERT_TOKENS = 8
# most tokens a forward's routed experts run on the grouped experts kernel (past several hundred a busy
# expert's weight is streamed several times; docs/kernels.md, "Routed experts at decode batch sizes")
GROUPED_TOKENS = 512


def use_one_row_kernel(model: torch.nn.Module, option, kernels: bool, checkpoint=None) -> str:
    """LLM(gemv=...): set each projection's `one_row`; returns one line saying what runs where.

    "auto" and True: on CUDA with the compiled kernels, where each projection's kernel loads or builds
    (True raises if one cannot; the build's warning names `checkpoint`, the model's directory, where
    given); False: torch's GEMM everywhere."""
    if option not in OPTIONS:
        raise ValueError(f"gemv must be True, False or 'auto', got {option!r}")
    mods = one_row_linears(model)
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear) and m.bias is None]
    mods += fp8
    experts = one_row_experts(model)
    for m in (*mods, *experts):
        m.one_row = False
    for m in experts:
        m.grouped = 0
    if option is False:
        return "gemv=False"
    if not kernels:
        if option is True:
            raise ValueError("gemv=True needs the compiled kernels (kernels=True on a CUDA device)")
        return "the linear layers run on the reference ops"
    act = _activation_dtype(model)
    keys = {m: [launch.gemv_key(m.weight)] for m in mods if not isinstance(m, FP8Linear) and _fits(m.weight)}
    keys.update({m: [launch.fp8_gemv_key(m.weight, *m.block, act)] for m in fp8
                 if m.weight.is_cuda and fp8_gemv_fits(m.in_features, m.block, act)})
    keys.update({m: [launch.gemv_experts_key(w) for w in m.expert_weights()] for m in experts
                 if all(_fits(w) for w in m.expert_weights())})
    grouped = {m: [launch.grouped_experts_key(w) for w in m.expert_weights()] for m in experts
               if all(_fits(w, grouped_fits) for w in m.expert_weights())}
    missing = _missing({key for ks in (*keys.values(), *grouped.values()) for key in ks})
    if missing and not lookup.jit_allowed():
        autobuild.ensure_gemv_kernels(sorted(missing, key=str), checkpoint=checkpoint)
        missing = _missing(missing)
    if missing and option is True:
        raise ValueError(f"gemv=True, but {len(missing)} projection kernel(s) neither load nor build here")
    for m, ks in keys.items():
        m.one_row = not missing.intersection(ks) and (EXPERT_TOKENS if isinstance(m, RoutedExperts) else True)
    for m, ks in grouped.items():
        m.grouped = 0 if missing.intersection(ks) else GROUPED_TOKENS
    on = sum(m.one_row for m in mods)
    line = f"{on} of {len(mods)} projections run one-token forwards on the one-row kernel"
    if experts:
        line += (f"; of {len(experts)} expert layers, {sum(bool(m.one_row) for m in experts)} run forwards of up to "
                 f"{EXPERT_TOKENS} tokens on the one-row experts kernel and {sum(bool(m.grouped) for m in experts)} "
                 f"of up to {GROUPED_TOKENS} on the grouped experts kernel")
    log.info("kvbuffer: %s", line)
    return line


def _activation_dtype(model: torch.nn.Module) -> str:
    """The name of the dtype a model's activations run in: its first floating parameter's that is not FP8."""
    return next((dtype_name(p) for p in model.parameters() if p.is_floating_point() and dtype_name(p) != FP8_DTYPE),
                "bfloat16")


def _fits(weight: torch.Tensor, fits=gemv_fits) -> bool:
    """Whether a projection kernel takes this weight (its last dim is K): on CUDA, in its dtypes, K as
    `fits` (keys.gemv_fits: whole 16-byte chunks; keys.grouped_fits: whole K steps) asks."""
    return weight.is_cuda and fits(weight.shape[-1], dtype_name(weight))


def _missing(keys: set) -> set:
    """The keys whose kernel neither loads from the artifact cache nor JIT-compiles here."""
    out = set()
    for key in keys:
        try:
            lookup.kernel_for(key, 1)
        except ArtifactError:
            out.add(key)
    return out
