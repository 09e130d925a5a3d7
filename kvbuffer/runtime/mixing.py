"""The memory-touching parts of a layer: short conv, linear-attention mixers and attention.

Model code computes projections and calls these with a ForwardBatch; they find the rows' slots,
pick the op for the batch's kind and mode, and leave all bookkeeping (advancing buffer fills,
flush resets, KV lengths) to the engine, which does it once per forward for every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference import conv as conv_ops
from ..reference import gdn as gdn_ops
from ..reference import mamba2 as mamba2_ops
from .batch import ForwardBatch
from .caches import ModelCaches


def short_conv(x, weight, bias, batch: ForwardBatch, caches: ModelCaches, layer: int):
    """Causal depthwise conv + SiLU over x (B, T, D) with each row's history; verify keeps drafts pending."""
    state = caches.convs.layer(layer)
    if batch.kind == "prefill":
        return conv_ops.conv_prefill(x[0], state, int(batch.slots[0]), weight, bias)[None]
    if batch.kind == "decode":
        return conv_ops.conv_step(x[:, 0], state, batch.slots, weight, bias)[:, None]
    return conv_ops.conv_verify(x, state, batch.slots, weight, bias)


def _gdn_args(tokens, params):
    return (*tokens, *params)  # (q, k, v, a, b), (A_log, dt_bias)


def _mamba2_args(tokens, params):
    x, dt, B, C = tokens
    A_log, dt_bias, D = params
    return (x, dt, A_log, dt_bias, B, C, D)


def _backend(reference, caches: ModelCaches):
    """The reference ops, or their compiled-kernel counterparts when the caches were built for kernels."""
    if not caches.kernels:
        return reference
    from .kernel_ops import compiled

    return compiled(reference)


def gated_delta_mix(q, k, v, a, b, A_log, dt_bias, batch, caches, layer):
    """Gated DeltaNet core for (B, T, ...) inputs: returns o (B, T, Hv, V)."""
    return _linear_mix(_backend(gdn_ops, caches), _gdn_args, (q, k, v, a, b), (A_log, dt_bias), batch, caches, layer)


def mamba2_mix(x, dt, B, C, A_log, dt_bias, D, batch, caches, layer):
    """Mamba-2 SSM for (Bt, T, ...) inputs (with D skip): returns y (Bt, T, H, P)."""
    return _linear_mix(_backend(mamba2_ops, caches), _mamba2_args, (x, dt, B, C), (A_log, dt_bias, D), batch, caches, layer)


def _linear_mix(ops, arrange, tokens, params, batch: ForwardBatch, caches: ModelCaches, layer: int):
    state = caches.states.layer(layer)
    if batch.mode == "recurrent":
        if batch.kind == "verify":
            return _recurrent_verify(ops, arrange, tokens, params, batch, caches, layer)
        steps = [ops.recurrent_step(*arrange([t[:, i] for t in tokens], params), state, batch.state_slots)
                 for i in range(batch.num_tokens)]
        return torch.stack(steps, 1)
    if caches.buffers is None:
        raise ValueError("kvbuffer mode needs caches built with buffers=True")
    buf = caches.buffers.layer(layer).tensors()
    if batch.kind == "prefill":
        o, _ = ops.prefill(*arrange([t[0] for t in tokens], params), state, int(batch.state_slots[0]), *buf,
                           int(batch.slots[0]), int(batch.lengths[0]), batch.flush_at)
        return o[None]
    if batch.kind == "decode":
        o = ops.buffered_step(*arrange([t[:, 0] for t in tokens], params), state, batch.state_slots, *buf,
                              batch.slots, batch.lengths, flush_at=batch.flush_at)
        return o[:, None]
    return ops.verify(*arrange(tokens, params), state, batch.state_slots, *buf, batch.slots, batch.lengths)


def _recurrent_verify(ops, arrange, tokens, params, batch, caches, layer):
    """The servers' way to verify T drafts: step through them, storing the state after each one in
    a per-draft state slot; the engine copies the accepted one back (see commit_draft_states)."""
    if caches.draft_states is None:
        raise ValueError("recurrent-mode verify needs caches built with draft_states=True")
    real = batch.slots >= 0
    scratch = caches.states.layer(layer)[batch.state_slots.clamp(min=0).long()].clone()
    rows = torch.where(real, torch.arange(batch.num_rows, dtype=torch.int32, device=scratch.device),
                       torch.full_like(batch.slots, -1))
    outs = []
    for i in range(batch.num_tokens):
        outs.append(ops.recurrent_step(*arrange([t[:, i] for t in tokens], params), scratch, rows))
        caches.draft_states[layer][batch.slots[real].long(), i] = scratch[real]
    return torch.stack(outs, 1)


def attention(q, k, v, batch: ForwardBatch, caches: ModelCaches, layer: int, scaling: float):
    """Causal attention of new tokens q (B, T, H, D) over each row's cache plus k, v (B, T, Hkv, D).

    New keys and values are written at positions cached .. cached+T-1 of the row's slot; for a
    verify, the engine keeps the accepted prefix by advancing `cached` (rejected ones are overwritten).
    """
    kc, vc = caches.kv.layer(layer)
    B, T, H, D = q.shape
    real = batch.slots >= 0
    rows = batch.slots.clamp(min=0).long()
    start = batch.cached.long()
    pos = start[:, None] + torch.arange(T, device=q.device)[None, :]
    kc[rows[real][:, None], pos[real]] = k[real].to(kc.dtype)
    vc[rows[real][:, None], pos[real]] = v[real].to(vc.dtype)
    L = int((start + T).max())
    keys, vals = kc[rows, :L], vc[rows, :L]  # (B, L, Hkv, D)
    groups = H // keys.shape[2]
    keys = keys.repeat_interleave(groups, dim=2).transpose(1, 2).to(q.dtype)
    vals = vals.repeat_interleave(groups, dim=2).transpose(1, 2).to(q.dtype)
    visible = torch.arange(L, device=q.device)[None, None, :] <= pos[:, :, None]  # (B, T, L)
    scores = torch.matmul(q.transpose(1, 2), keys.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, vals).transpose(1, 2)  # (B, T, H, D)
    return torch.where(real[:, None, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
