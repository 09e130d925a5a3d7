"""Valid calls of every `torch.ops.kvbuffer.*` op at small random sizes, and the reference each one
equals: the raw material the op hardening tests corrupt one argument of."""

from __future__ import annotations

import random

import torch

import kvbuffer.kernels.torch_ops  # noqa: F401  (registers torch.ops.kvbuffer.*)
from kvbuffer.reference import conv as ref_conv
from kvbuffer.reference import core as ref_core
from kvbuffer.reference import gdn as ref_gdn
from kvbuffer.reference import mamba2 as ref_mamba2

LINEAR_OPS = ("recurrent_step", "buffered_step", "verify", "flush", "recurrent_drafts")
OPS = tuple(f"{f}_{op}" for f in ("gdn", "mamba2") for op in LINEAR_OPS) + ("conv1d_update", "conv1d_accept")
POOLS = ("state", "buf_k", "buf_v", "buf_g", "conv_state", "draft_states")  # what the ops write
PARAMS = ("A_log", "dt_bias", "D", "bias")


def _slots(rng: random.Random, B: int, n: int, padding: bool) -> torch.Tensor:
    real = rng.sample(range(n), B)
    if padding and B:
        real[rng.randrange(B)] = -1
    return torch.tensor(real, dtype=torch.int32)


def valid_call(name: str, rng: random.Random, gen: torch.Generator) -> dict:
    """Keyword arguments of one valid call of op `name` (CPU, fp32 activations and pools)."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if name.startswith("conv1d"):
        D, W, drafts, n = rng.randint(1, 4), rng.randint(1, 4), rng.randint(0, 3), rng.randint(1, 4)
        B = rng.randint(0, n)
        span = W - 1 + drafts
        call = dict(conv_state=r(n, D, span), slots=_slots(rng, B, n, rng.random() < 0.3))
        if name == "conv1d_accept":
            accepted = torch.tensor([rng.randint(0, drafts) for _ in range(B)], dtype=torch.int32)
            return dict(call, accepted=accepted, width=W)
        kind = "verify" if drafts and rng.random() < 0.5 else "advance"
        T = rng.randint(1, drafts) if kind == "verify" else rng.randint(1, 3)
        bias = r(D) if rng.random() < 0.5 else None
        return dict(call, x=r(B, T, D), weight=r(D, W), bias=bias, kind=kind, silu=rng.random() < 0.8)
    family, op = name.split("_", 1)
    Hk = rng.randint(1, 2)
    Hv, K, V = Hk * rng.randint(1, 2), rng.randint(1, 4), rng.randint(1, 4)
    n_state, n_buf, cap = rng.randint(1, 4), rng.randint(1, 4), rng.randint(2, 5)
    B = rng.randint(1, min(n_state, n_buf))
    T = rng.randint(1, cap) if op in ("verify", "recurrent_drafts") else 1
    call = dict(state=r(n_state, Hv, K, V), state_slots=_slots(rng, B, n_state, rng.random() < 0.3))
    if op == "recurrent_drafts":  # a per-token state pool with room for T or more tokens per row
        n_draft = rng.randint(B, B + 2)
        call.update(draft_states=r(n_draft, T + rng.randint(0, 1), Hv, K, V),
                    draft_rows=_slots(rng, B, n_draft, rng.random() < 0.3))
    elif op != "recurrent_step":
        lengths = torch.tensor([rng.randint(0, cap - T) for _ in range(B)], dtype=torch.int32)
        call.update(buf_k=r(n_buf, cap, Hk, K), buf_v=r(n_buf, cap, Hv, V), buf_g=-r(n_buf, cap, Hv).abs(),
                    buffer_slots=_slots(rng, B, n_buf, False), lengths=lengths)
    if op == "flush":
        call["state_slots"] = _slots(rng, B, n_state, False)
        return call
    lead = (B, T) if op in ("verify", "recurrent_drafts") else (B,)
    if family == "gdn":
        call.update(q=r(*lead, Hk, K), k=r(*lead, Hk, K), v=r(*lead, Hv, V), a=r(*lead, Hv), b=r(*lead, Hv),
                    A_log=r(Hv), dt_bias=r(Hv))
    else:
        call.update(x=r(*lead, Hv, V), dt=r(*lead, Hv), A_log=r(Hv), dt_bias=r(Hv), B=r(*lead, Hk, K),
                    C=r(*lead, Hk, K), D=r(Hv), z=r(*lead, Hv, V) if rng.random() < 0.5 else None)
    if op in ("buffered_step", "verify"):
        call["flush_at"] = 0
    return call


def _conv_reference(x, conv_state, slots, weight, bias, kind, silu):
    act = "silu" if silu else None
    if kind == "verify":
        return ref_conv.conv_verify(x, conv_state, slots, weight, bias, act)
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return ref_conv.conv_step(x, conv_state, slots, weight, bias, act)  # (rejects x)
    steps = [ref_conv.conv_step(x[:, t], conv_state, slots, weight, bias, act) for t in range(x.shape[1])]
    return torch.stack(steps, 1) if steps else x.new_empty(x.shape)  # advancing by T = T steps


REFERENCE = {
    "gdn_recurrent_step": ref_gdn.recurrent_step, "gdn_buffered_step": ref_gdn.buffered_step,
    "gdn_verify": ref_gdn.verify, "gdn_flush": ref_core.flush,
    "mamba2_recurrent_step": ref_mamba2.recurrent_step, "mamba2_buffered_step": ref_mamba2.buffered_step,
    "mamba2_verify": ref_mamba2.verify, "mamba2_flush": ref_core.flush,
    "gdn_recurrent_drafts": ref_gdn.recurrent_drafts, "mamba2_recurrent_drafts": ref_mamba2.recurrent_drafts,
    "conv1d_update": _conv_reference, "conv1d_accept": ref_conv.conv_accept,
}  # op name -> the kvbuffer.reference function it exposes (called with the op's keyword arguments)


def call_op(name: str, call: dict):
    return getattr(torch.ops.kvbuffer, name)(**call)


def call_reference(name: str, call: dict):
    return REFERENCE[name](**call)


def cloned(call: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in call.items()}


def snapshot(call: dict) -> dict:
    """Copies of the pools a call may write, to compare bit for bit after a rejected call."""
    real = lambda t: isinstance(t, torch.Tensor) and t.device.type != "meta"  # noqa: E731
    return {k: call[k].clone() for k in POOLS if real(call.get(k))}


def unchanged(before: dict, call: dict) -> bool:
    # the bits, in a fresh dense copy (NaN equals NaN; a size-1 axis may carry any stride)
    raw = lambda t: torch.empty(t.shape, dtype=t.dtype).copy_(t).view(-1).view(torch.uint8)  # noqa: E731
    return all(torch.equal(raw(before[k]), raw(call[k])) for k in before)
