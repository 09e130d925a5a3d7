"""Chunked Gated DeltaNet prefill for packed prompts on compiled TileLang kernels (tiles/gdn_prefill.py).

`build_gdn_chunk_prefill` JIT-compiles the four templates for the local GPU (TileLang is imported only
there); `gdn_chunk_prefill` validates its tensors and runs them. Semantics: the plain recurrence of
kvbuffer.reference.core over each sequence of a packed batch (tiles/gdn_prefill.py states the contract):
q, k (N, Hk, K) bf16, already L2-normalised, q scaled by K**-0.5; v (N, Hv, V) bf16; g, beta (N, Hv) fp32;
cu_seqlens (B + 1,) int32; state (num_slots, Hv, K, V) fp32 updated in place at state_slots (B,) int32
(slot -1: start from zero, write no state). Returns o (N, Hv, V) bf16.

Decay-only (`delta_rule=False`, Mamba-2's SSD; beta None): the values are folded as they are, u = v. With
Mamba-2's names: k = B, q = C (N, groups, state size), v = dt x (N, heads, head dim), g = dt A; the D skip
and the z gate stay outside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..checks import check_slots, check_tensor, check_unique
from ..errors import ShapeError
from .compiled import check_contiguous, check_on_cuda

CHUNK = 64  # tiles.gdn_prefill.BT (that module imports TileLang's front end lazily, this one never)


@dataclass(frozen=True)
class GdnChunkPrefill:
    """The compiled kernels of one head shape and the parameters they were built with (no prep kernel in
    the decay-only form)."""

    chunks: Callable[..., Any] = field(repr=False)
    prep: Callable[..., Any] | None = field(repr=False)
    states: Callable[..., Any] = field(repr=False)
    output: Callable[..., Any] = field(repr=False)
    params: dict


def build_gdn_chunk_prefill(Hk: int, Hv: int, K: int = 128, V: int = 128, *, delta_rule: bool = True,
                            states_BV: int = 32, states_stages: int = 0, output_BV: int = 128,
                            threads: int = 128) -> GdnChunkPrefill:
    """Compile the chunked prefill for one head shape for the local GPU (tunables: tiles.gdn_prefill.configs;
    each value tile is capped at V)."""
    from ..gpus import local_target
    from ..tiles import compile_template, gdn_prefill as tiles

    states_BV, output_BV = min(states_BV, V), min(output_BV, V)
    target = local_target()
    build = lambda prim: compile_template(prim, target)  # noqa: E731
    return GdnChunkPrefill(
        chunks=build(tiles.gdn_prefill_chunks(threads=threads)),
        prep=build(tiles.gdn_prefill_prep(Hk, Hv, K, V, threads=threads)) if delta_rule else None,
        states=build(tiles.gdn_prefill_states(Hk, Hv, K, V, BV=states_BV, threads=threads, stages=states_stages,
                                              delta_rule=delta_rule)),
        output=build(tiles.gdn_prefill_output(Hk, Hv, K, V, BV=output_BV, threads=threads)),
        params=dict(Hk=Hk, Hv=Hv, K=K, V=V, delta_rule=delta_rule, states_BV=states_BV,
                    states_stages=states_stages, output_BV=output_BV, threads=threads),
    )


def chunk_slots(num_tokens: int, batch: int) -> int:
    """Rows of the per-chunk workspace: chunk c of sequence i owns row cu_seqlens[i] // CHUNK + i + c, below
    ceil(N / CHUNK) + B (tiles.gdn_prefill's module docstring)."""
    return -(-num_tokens // CHUNK) + batch


def _check(op: GdnChunkPrefill, q, k, v, g, beta, cu_seqlens, state, state_slots, check_values: bool) -> None:
    if not isinstance(op, GdnChunkPrefill):
        raise TypeError(f"op must be a GdnChunkPrefill (build_gdn_chunk_prefill), got {type(op).__name__}")
    p = op.params
    dev = q.device if isinstance(q, torch.Tensor) else None
    check_tensor("q", q, (None, p["Hk"], p["K"]), (torch.bfloat16,), dev)
    check_on_cuda("q", dev)
    N = q.shape[0]
    check_tensor("k", k, (N, p["Hk"], p["K"]), (torch.bfloat16,), dev)
    check_tensor("v", v, (N, p["Hv"], p["V"]), (torch.bfloat16,), dev)
    check_tensor("g", g, (N, p["Hv"]), (torch.float32,), dev)
    if p["delta_rule"]:
        check_tensor("beta", beta, (N, p["Hv"]), (torch.float32,), dev)
    elif beta is not None:
        raise TypeError("beta must be None for a decay-only kernel (built with delta_rule=False)")
    check_tensor("cu_seqlens", cu_seqlens, (None,), (torch.int32,), dev)
    if cu_seqlens.shape[0] < 2:
        raise ShapeError(f"cu_seqlens must hold B + 1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}")
    B = cu_seqlens.shape[0] - 1
    check_tensor("state", state, (None, p["Hv"], p["K"], p["V"]), (torch.float32,), dev)
    check_tensor("state_slots", state_slots, (B,), (torch.int32,), dev)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("cu_seqlens", cu_seqlens),
                    ("state", state), ("state_slots", state_slots)):
        if t is not None:
            check_contiguous(name, t)
    if check_values:  # reads values back to the host: leave it off under CUDA graph capture
        c = cu_seqlens.tolist()
        if c[0] != 0 or c[-1] != N or any(b < a for a, b in zip(c, c[1:])):
            raise ShapeError(f"cu_seqlens must rise from 0 to the {N} packed tokens, got {c}")
        check_slots("state_slots", state_slots, B, state.shape[0], dev)
        check_unique("state_slots", state_slots)


def gdn_chunk_prefill(op: GdnChunkPrefill, q, k, v, g, beta, cu_seqlens, state, state_slots, out=None, *,
                      check_values: bool = True) -> torch.Tensor:
    """o (N, Hv, V) of every packed sequence; each sequence's final state written to its slot in place
    (beta None for a decay-only op).

    `check_values` = False skips the checks that read cu_seqlens and state_slots back (monotone offsets
    from 0 to N, slots in [-1, num_slots) and distinct), for a call captured in a CUDA graph.
    """
    _check(op, q, k, v, g, beta, cu_seqlens, state, state_slots, check_values)
    p = op.params
    N, B = q.shape[0], cu_seqlens.shape[0] - 1
    Hv, K, V = p["Hv"], p["K"], p["V"]
    if out is None:
        out = torch.empty((N, Hv, V), dtype=torch.bfloat16, device=q.device)
    else:
        check_tensor("out", out, (N, Hv, V), (torch.bfloat16,), q.device)
        check_contiguous("out", out)
    if N == 0:
        return out
    empty = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=q.device)  # noqa: E731
    NC = chunk_slots(N, B)
    chunks = empty((NC, 2), torch.int32)
    gcum = empty((N, Hv), torch.float32)
    h = empty((NC, Hv, K, V), torch.bfloat16)
    op.chunks(cu_seqlens, chunks)
    if op.prep is None:  # decay-only: the states kernel forms the decays, the values are the deltas
        op.states(k, v, g, cu_seqlens, state, state_slots, h, gcum)
        op.output(q, k, h, v, gcum, chunks, out)
        return out
    w = empty((N, Hv, K), torch.bfloat16)
    u, delta = empty((N, Hv, V), torch.bfloat16), empty((N, Hv, V), torch.bfloat16)
    op.prep(k, v, g, beta, chunks, w, u, gcum)
    op.states(k, w, u, gcum, cu_seqlens, state, state_slots, h, delta)
    op.output(q, k, h, delta, gcum, chunks, out)
    return out
