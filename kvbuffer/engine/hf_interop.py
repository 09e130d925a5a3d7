"""Move a request's caches between kvbuffer's pools and a transformers cache object.

So a prefix computed by one can be continued by the other:

- `prefill_to_hf(llm, ids)`: kvbuffer prefills `ids`; returns a transformers DynamicCache that
  covers them, ready for transformers to decode the next token.
- `generate_from_hf(llm, ids, cache, ...)`: transformers computed `cache` for `ids[:-1]`; kvbuffer
  imports it and generates from the last prompt token on.

kvbuffer's side of a linear layer is (state, buffer, conv history); transformers' is one
materialised state and the last W conv inputs. Exporting folds the buffer into a copy of the state
(the pools are not modified); importing puts the state in a fresh state slot with an empty
buffer. Mamba-2 states are transposed on the way, since transformers stores them (P, N).
"""

from __future__ import annotations

import torch

from ..reference import core
from .request import Request
from .sampling import SamplingParams


def _materialized_state(llm, req: Request, layer: int) -> torch.Tensor:
    """S0 with the request's buffer folded in, as a (Hv, K, V) tensor; the pools stay untouched."""
    caches = llm.runner.caches
    src = caches.states.layer(layer)
    scratch = torch.zeros((1,) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    if req.state_slot >= 0:
        scratch[0] = src[req.state_slot]
    n = caches.buffers.length(req.slot) if caches.buffers is not None else 0
    if n:
        i32 = dict(dtype=torch.int32, device=src.device)
        core.flush(scratch, torch.zeros(1, **i32), *caches.buffers.layer(layer).tensors(),
                   torch.tensor([req.slot], **i32), torch.tensor([n], **i32))
    return scratch[0]


def _transposed(llm) -> bool:
    return not llm.runner.spec.linear_shape.delta_rule  # Mamba-2: transformers stores (P, N)


def prefill_to_hf(llm, token_ids: list[int]):
    """kvbuffer prefills `token_ids`; returns a transformers DynamicCache covering them."""
    from transformers import DynamicCache

    req = Request(-1, list(token_ids), SamplingParams())
    llm.runner.admit(req)
    try:
        while req.pending:
            llm.runner.prefill([req], llm.max_prefill_tokens)
        return _export(llm, req, DynamicCache(config=llm.hf_config()))
    finally:
        llm.runner.release(req)


def _export(llm, req: Request, cache):
    caches, W = llm.runner.caches, llm.runner.spec.conv_width
    for hf_layer, where in enumerate(llm.model.cache_layout()):
        if where is None:
            continue
        kind, i = where
        if kind == "linear":
            hist = caches.convs.layer(i)[req.slot, :, : W - 1]
            conv = torch.cat([torch.zeros_like(hist[:, :1]), hist], dim=-1)  # transformers keeps W inputs
            state = _materialized_state(llm, req, i)
            if _transposed(llm):
                state = state.transpose(-1, -2)
            layer = cache.layers[hf_layer]
            layer.update_conv_state(conv[None].clone())
            layer.update_recurrent_state(state[None].clone())
            if hasattr(layer, "cumulative_length_linear"):  # transformers >= 5.2x counts a layer's tokens
                layer.cumulative_length_linear.fill_(req.cached)  # by its conv inputs: W here, not the prefix
        else:
            kc, vc = caches.kv.layer(i)
            k = kc[req.slot, : req.cached].transpose(0, 1)[None]  # (1, Hkv, L, D)
            v = vc[req.slot, : req.cached].transpose(0, 1)[None]
            cache.update(k.clone(), v.clone(), hf_layer)
    return cache


def _import(llm, req: Request, cache, length: int) -> None:
    caches, W = llm.runner.caches, llm.runner.spec.conv_width
    if llm.runner.has_linear and req.state_slot < 0:
        req.state_slot = caches.allocate_state()
    for hf_layer, where in enumerate(llm.model.cache_layout()):
        if where is None:
            continue
        kind, i = where
        layer = cache.layers[hf_layer]
        if kind == "linear":
            state = layer.recurrent_states[0][0]
            if _transposed(llm):
                state = state.transpose(-1, -2)
            caches.states.layer(i)[req.state_slot] = state.to(caches.states.state.dtype)
            caches.convs.layer(i)[req.slot, :, : W - 1] = layer.conv_states[0][0, :, -(W - 1):]
        else:
            if layer.keys.shape[-2] != length:
                raise ValueError(f"transformers cache layer {hf_layer} holds {layer.keys.shape[-2]} tokens, "
                                 f"expected {length}")
            kc, vc = caches.kv.layer(i)
            kc[req.slot, :length] = layer.keys[0].transpose(0, 1).to(kc.dtype)
            vc[req.slot, :length] = layer.values[0].transpose(0, 1).to(vc.dtype)
    req.cached = length  # the buffer stays empty: the state holds the whole prefix


def generate_from_hf(llm, token_ids: list[int], cache, **sampling):
    """Continue a prompt whose first len(token_ids) - 1 tokens transformers already put in `cache`."""
    if len(token_ids) < 2:
        raise ValueError("generate_from_hf needs at least two tokens: a cached prefix and one to feed")
    return llm.generate([list(token_ids)], _prepare=lambda req: _import(llm, req, cache, len(token_ids) - 1),
                        **sampling)[0]
