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

import importlib.util
from typing import Mapping

from kvbuffer.kernels.keys import ConvDims, KernelKey
from kvbuffer.kernels.specs import SPECS

from .template import Template, from_spec

CONV_TILES = "kvbuffer.tiles.conv1d"
PREFILL_CHECK_TOKENS = 7  # the any-length prefill kernel is checked and timed on an awkward prompt length


def _span(shape: Mapping, drafts: int) -> int:
    """Pool positions per channel: W - 1 history + (drafts + 1) fed tokens (the engine's CacheSpec)."""
    return shape["W"] + drafts


def _update_key(mode: str, T: int | None):
    """T None: drafts + 1 tokens (verify); 0: any count (prefill)."""
    return lambda shape, chunk, drafts: KernelKey(
        "conv1d", mode, ConvDims(shape["D"], shape["W"], _span(shape, drafts)), shape["dtype"],
        w_dtype=shape["w_dtype"], T=drafts + 1 if T is None else T, has_bias=shape["bias"], silu=True)


def _accept_key(shape, chunk, drafts) -> KernelKey:
    return KernelKey("conv1d", "accept", ConvDims(shape["D"], shape["W"], _span(shape, drafts)), shape["dtype"], T=0)


def _pool(shape, batch, drafts, gen, device):
    import torch

    dt = getattr(torch, shape["dtype"])
    state = torch.randn(batch, shape["D"], _span(shape, drafts), generator=gen, device=device).to(dt)
    slots = torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)
    return state, slots


def _update_inputs(T: int | None):
    def inputs(shape, batch, chunk_size, device, gen, drafts=0) -> dict:
        import torch

        tokens = drafts + 1 if T is None else (T or PREFILL_CHECK_TOKENS)
        dt, wdt = getattr(torch, shape["dtype"]), getattr(torch, shape["w_dtype"])
        x = torch.randn(batch, tokens, shape["D"], generator=gen, device=device).to(dt)
        state, slots = _pool(shape, batch, drafts, gen, device)
        weight = (0.5 * torch.randn(shape["D"], shape["W"], generator=gen, device=device)).to(wdt)
        bias = torch.randn(shape["D"], generator=gen, device=device).to(wdt) if shape["bias"] else weight.view(-1)[:1]
        return dict(x=x, conv_state=state, slots=slots, weight=weight, bias=bias, out=torch.empty_like(x))
    return inputs


def _update_reference(row_function: str):
    def reference(shape, chunk_size, args: Mapping) -> dict:
        from kvbuffer.reference import conv

        x, state = args["x"], args["conv_state"].clone()
        bias = args["bias"] if shape["bias"] else None
        fn = getattr(conv, row_function)
        row = (x[:, 0], state, args["slots"], args["weight"], bias) if row_function == "step_rows" else \
            (x, state, args["slots"], args["weight"], bias)
        out = fn(*row)
        return {"conv_state": state, "out": out[:, None] if row_function == "step_rows" else out}
    return reference


def _accept_inputs(shape, batch, chunk_size, device, gen, drafts=0) -> dict:
    import torch

    state, slots = _pool(shape, batch, drafts, gen, device)
    accepted = torch.randint(0, drafts + 2, (batch,), generator=gen, device=device, dtype=torch.int32)
    return dict(conv_state=state, slots=slots, accepted=accepted)


def _accept_reference(shape, chunk_size, args: Mapping) -> dict:
    from kvbuffer.reference import conv

    state = args["conv_state"].clone()
    conv.accept_rows(state, args["slots"], args["accepted"], shape["W"])
    return {"conv_state": state}


def conv_templates() -> list[Template]:
    if importlib.util.find_spec(CONV_TILES) is None:
        return []
    advance, verify, accept = (SPECS[("conv1d", op)] for op in ("advance", "verify", "accept"))
    common = dict(uses_chunk=False, layouts=True)
    return [
        from_spec(advance, "conv1d_step", "conv1d", _update_key("advance", 1), _update_inputs(1),
                  _update_reference("step_rows"), **common),
        from_spec(advance, "conv1d_prefill", "conv1d", _update_key("advance", 0), _update_inputs(0),
                  _update_reference("prefill_rows"), **common),
        from_spec(verify, "conv1d_verify", "conv1d", _update_key("verify", None), _update_inputs(None),
                  _update_reference("verify_rows"), min_drafts=1, **common),
        from_spec(accept, "conv1d_accept", "conv1d", _accept_key, _accept_inputs, _accept_reference, min_drafts=1,
                  **common),
    ]
