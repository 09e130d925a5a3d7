"""The short conv's kernels (tiles/conv1d.py) as tuner templates, family "conv1d".

Their shape is not a head shape: {"family": "conv1d", "D": channels, "W": width, "dtype": activations
and pool, "w_dtype": weight and bias, "bias": whether the conv has one} (kvbuffer.autotune.models.
conv_shape). Every kernel depends on the buffer layout through the pool's span, W + T (the history
plus room for T drafts and the last token), and on no chunk size:

    conv1d_step      decode step (advance, 1 token)
    conv1d_prefill   a prompt (advance, any number of tokens: one kernel)
    conv1d_verify    T drafts + the last token stored as pending (speculative layouts only)
    conv1d_accept    keep each row's accepted drafts (speculative layouts only)

The check compares against kvbuffer.reference.conv's row functions (SiLU, as the engine runs them).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Mapping

from .registry import Template, _compile, _run, source_digest

CONV_TILES = "kvbuffer.tiles.conv1d"
PREFILL_CHECK_TOKENS = 7  # the any-length prefill kernel is checked and timed on an awkward prompt length
THREADS = (128, 256, 64)


def _span(shape: Mapping, drafts: int) -> int:
    """Pool positions per channel: W - 1 history + (drafts + 1) fed tokens (the engine's CacheSpec)."""
    return shape["W"] + drafts


def _configs() -> list[dict]:
    return [{"threads": t} for t in THREADS]


def _update_builder(mode: str, T: int | None):
    """T None: drafts + 1 tokens (verify); 0: any count (prefill)."""
    def build(shape, chunk_size, *, target, drafts=0, **t):
        tiles = importlib.import_module(CONV_TILES)
        prim = tiles.conv1d_update(shape["D"], shape["W"], _span(shape, drafts), drafts + 1 if T is None else T, mode,
                                   dtype=shape["dtype"], w_dtype=shape["w_dtype"], has_bias=shape["bias"],
                                   silu=True, **t)
        return _compile(prim, target)
    return build


def _accept_build(shape, chunk_size, *, target, drafts=0, **t):
    tiles = importlib.import_module(CONV_TILES)
    return _compile(tiles.conv1d_accept(shape["D"], shape["W"], _span(shape, drafts), dtype=shape["dtype"], **t),
                    target)


def _pool(shape, batch, drafts, gen, device):
    import torch

    dt = getattr(torch, shape["dtype"])
    state = torch.randn(batch, shape["D"], _span(shape, drafts), generator=gen, device=device).to(dt)
    slots = torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)
    return state, slots


def _update_inputs(T: int | None):
    def inputs(shape, batch, chunk_size, device, gen, drafts=0):
        import torch

        tokens = drafts + 1 if T is None else (T or PREFILL_CHECK_TOKENS)
        dt, wdt = getattr(torch, shape["dtype"]), getattr(torch, shape["w_dtype"])
        x = torch.randn(batch, tokens, shape["D"], generator=gen, device=device).to(dt)
        state, slots = _pool(shape, batch, drafts, gen, device)
        weight = (0.5 * torch.randn(shape["D"], shape["W"], generator=gen, device=device)).to(wdt)
        bias = torch.randn(shape["D"], generator=gen, device=device).to(wdt) if shape["bias"] else weight.view(-1)[:1]
        return [x, state, slots, weight, bias, torch.empty_like(x)]
    return inputs


def _update_reference(row_function: str):
    def reference(shape, chunk_size, args):
        from kvbuffer.reference import conv

        x, state, slots, weight, bias = args[0], args[1].clone(), args[2], args[3], args[4]
        bias = bias if shape["bias"] else None
        fn = getattr(conv, row_function)
        out = fn(x[:, 0], state, slots, weight, bias)[:, None] if row_function == "step_rows" else \
            fn(x, state, slots, weight, bias)
        return {1: state, 5: out}
    return reference


def _accept_inputs(shape, batch, chunk_size, device, gen, drafts=0):
    import torch

    state, slots = _pool(shape, batch, drafts, gen, device)
    accepted = torch.randint(0, drafts + 2, (batch,), generator=gen, device=device, dtype=torch.int32)
    return [state, slots, accepted]


def _accept_reference(shape, chunk_size, args):
    from kvbuffer.reference import conv

    state = args[0].clone()
    conv.accept_rows(state, args[1], args[2], shape["W"])
    return {0: state}


def conv_templates() -> list[Template]:
    if importlib.util.find_spec(CONV_TILES) is None:
        return []
    src = source_digest()
    common = dict(uses_chunk=False, layouts=True)

    def tpl(name, build, inputs, reference, **extra):
        return Template(name, "conv1d", build, _configs, {"threads": THREADS[0]}, inputs, reference, _run, src,
                        **common, **extra)

    return [
        tpl("conv1d_step", _update_builder("advance", 1), _update_inputs(1), _update_reference("step_rows")),
        tpl("conv1d_prefill", _update_builder("advance", 0), _update_inputs(0), _update_reference("prefill_rows")),
        tpl("conv1d_verify", _update_builder("verify", None), _update_inputs(None), _update_reference("verify_rows"),
            min_drafts=1),
        tpl("conv1d_accept", _accept_build, _accept_inputs, _accept_reference, min_drafts=1),
    ]
