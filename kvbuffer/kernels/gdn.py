"""The Gated DeltaNet family: its specs (kvbuffer.kernels.linear's, and the chunked prefill's), compile
(`build_*`), validated launch, CUDA launches, engine ops (GDN_OPS), custom ops and tuner inputs.

    torch.ops.kvbuffer.gdn_recurrent_step(q, k, v, a, b, A_log, dt_bias, state, state_slots) -> o
    torch.ops.kvbuffer.gdn_buffered_step(<as recurrent_step>, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at) -> o
    torch.ops.kvbuffer.gdn_verify(<as gdn_buffered_step, inputs (B, T, ...)>, flush_at=0) -> o (B, T, Hv, V)
    torch.ops.kvbuffer.gdn_flush(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    torch.ops.kvbuffer.gdn_recurrent_drafts(<as recurrent_step>, draft_states, draft_rows) -> o (B, T, Hv, V)

A launcher checks every tensor (shape, dtype, device, contiguity, slot ranges, capacity) with
kvbuffer.checks before the kernel runs, so a bad call raises a typed error and writes nothing.
Semantics are exactly kvbuffer.reference.core's, with the Qwen3.5 gating front fused in:
the kernels take raw q, k (post-conv), v, a, b and A_log, dt_bias (see kvbuffer.reference.gating).
"""

from __future__ import annotations

import torch

from ..checks import check_capacity, check_tensor
from ..errors import ShapeError, SlotError
from ..reference import core as ref_core
from ..reference import gdn as ref_gdn
from . import prefill
from .calls import EngineOp, capturing, implement, on_torch_stream, token_axis
from .compiled import (ACT_DTYPES, CompiledOp, check_buffer, check_contiguous, check_draft_states,
                       check_fill_rules, check_on_cuda, check_state, expect_kind, out_tensor, prefill_chunks)
from .keys import LINEAR_OPS, GDNDims, KernelKey
from .linear import (BUFFER_MUTATIONS, GDN_FRONT, LinearOps, launch_flush, linear_key, linear_specs,
                     linear_variants, meta_checks)
from .lookup import kernel_for
from .prefill import GDN_CHUNK_PREFILL, GDN_CHUNK_PREFILL_OP
from .specs import Family, register, spec_for


SPECS = linear_specs("gdn", GDN_FRONT, "o", ref_gdn)
RECURRENT, BUFFERED, FLUSH, RECURRENT_DRAFTS = SPECS


def _key(op: str, Hk, Hv, K, V, tunables: dict, dtypes=("in_dtype", "buf_dtype"), **fields) -> KernelKey:
    """The key of a `build_gdn_*` call: the `dtypes` it names (bfloat16 unless in `tunables`) are key fields."""
    named = {n: tunables.pop(n, "bfloat16") for n in dtypes}
    return KernelKey("gdn", op, GDNDims(Hk, Hv, K, V), **named, **fields)


def build_gdn_recurrent(Hk: int, Hv: int, K: int = 128, V: int = 128, **tunables) -> CompiledOp:
    """Compile the recurrent step (baseline) for one head shape; tunables: BV, threads, in_dtype."""
    key = _key("recurrent", Hk, Hv, K, V, tunables, ("in_dtype",))
    return spec_for(key).build(key, tunables)


def build_gdn_recurrent_drafts(Hk: int, Hv: int, K: int = 128, V: int = 128, *, T_new: int, **tunables) -> CompiledOp:
    """Compile the recurrent verify of T_new fed tokens, one state per token (the servers' scheme)."""
    key = _key("recurrent_drafts", Hk, Hv, K, V, tunables, ("in_dtype",), T=T_new)
    return spec_for(key).build(key, tunables)


def build_gdn_buffered(Hk: int, Hv: int, K: int = 128, V: int = 128, *, cap: int, T_new: int = 1,
                       flush_at: int = 0, **tunables) -> CompiledOp:
    """Compile the buffered step (T_new=1) / verify (T_new drafts) with an optional fused flush."""
    key = _key("buffered", Hk, Hv, K, V, tunables, cap=cap, T=T_new, C=flush_at)
    return spec_for(key).build(key, tunables)


def build_gdn_flush(Hk: int, Hv: int, K: int = 128, V: int = 128, *, cap: int, **tunables) -> CompiledOp:
    """Compile the stand-alone flush."""
    key = _key("flush", Hk, Hv, K, V, tunables, ("buf_dtype",), cap=cap)
    return spec_for(key).build(key, tunables)


def _check_tokens(op: CompiledOp, q, k, v, a, b, A_log, dt_bias, lead: tuple) -> torch.device:
    p = op.params
    act = ACT_DTYPES[p.get("in_dtype", "bfloat16")]
    dev = q.device if isinstance(q, torch.Tensor) else None
    check_tensor("q", q, lead + (p["Hk"], p["K"]), (act,), dev)
    check_on_cuda("q", dev)
    check_tensor("k", k, lead + (p["Hk"], p["K"]), (act,), dev)
    check_tensor("v", v, lead + (p["Hv"], p["V"]), (act,), dev)
    check_tensor("a", a, lead + (p["Hv"],), (act,), dev)
    check_tensor("b", b, lead + (p["Hv"],), (act,), dev)
    check_tensor("A_log", A_log, (p["Hv"],), (torch.float32,), dev)
    check_tensor("dt_bias", dt_bias, (p["Hv"],), (torch.float32,), dev)
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        check_contiguous(name, t)
    return dev


# ----------------------------------------------------------------------------------------------
# public ops


def gdn_recurrent_step(op: CompiledOp, q, k, v, a, b, A_log, dt_bias, state, state_slots, out=None):
    """Plain recurrent decode step (reference.recurrent_step with the front fused); updates state."""
    expect_kind(op, "recurrent")
    B = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() else -1
    dev = _check_tokens(op, q, k, v, a, b, A_log, dt_bias, (B,))
    check_state(op, state, state_slots, B, dev)
    o = out_tensor(out, tuple(v.shape), v)
    if B:
        u = lambda t: t.unsqueeze(1)  # noqa: E731  (the kernels take a token axis of 1; a free view)
        op.fn(u(q), u(k), u(v), u(a), u(b), A_log, dt_bias, state, state_slots, u(o))
    return o


def gdn_recurrent_drafts(op: CompiledOp, q, k, v, a, b, A_log, dt_bias, state, state_slots, draft_states,
                         draft_rows, out=None):
    """T = op['T_new'] fed tokens per row on the recurrence (q (B, T, Hk, K) ... -> o (B, T, Hv, V)), the state
    after token t written to draft_states[draft_rows[b], t]; `state` is only read."""
    expect_kind(op, "recurrent_drafts")
    T_new = op["T_new"]
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] != T_new:
        raise ShapeError(f"q must be (B, {T_new}, Hk, K) for this kernel, got {getattr(q, 'shape', q)}")
    B = q.shape[0]
    dev = _check_tokens(op, q, k, v, a, b, A_log, dt_bias, (B, T_new))
    check_state(op, state, state_slots, B, dev, read_only=True)
    check_draft_states(op, draft_states, draft_rows, state, B, T_new)
    o = out_tensor(out, tuple(v.shape), v)
    if B:
        op.fn(q, k, v, a, b, A_log, dt_bias, state, state_slots, draft_states, draft_rows, o)
    return o


def _run_buffered(op, q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g,
                  buffer_slots, lengths, out, T_new):
    B = q.shape[0]
    dev = _check_tokens(op, q, k, v, a, b, A_log, dt_bias, (B, T_new))
    check_state(op, state, state_slots, B, dev)
    check_buffer(op, buf_k, buf_v, buf_g, buffer_slots, lengths, B, dev)
    check_fill_rules(op, state_slots, buffer_slots, lengths, T_new)
    o = out_tensor(out, tuple(v.shape), v)
    if B:
        op.fn(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, o)
    return o


def gdn_buffered_step(op: CompiledOp, q, k, v, a, b, A_log, dt_bias, state, state_slots,
                      buf_k, buf_v, buf_g, buffer_slots, lengths, out=None):
    """reference.buffered_step(flush_at=op['flush_at']) with the front fused: q (B, Hk, K) ... -> o (B, Hv, V).

    Appends each row's entry at lengths[b]; rows with lengths[b] + 1 == flush_at are folded into
    their state in the same launch (the caller then resets their lengths, see reference.rows_flushed).
    """
    expect_kind(op, "buffered")
    if op["T_new"] != 1:
        raise ShapeError(f"gdn_buffered_step needs a kernel built with T_new=1, got {op['T_new']}")
    B = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else None
    if B is None:
        raise ShapeError(f"q must be (B, Hk, K), got {getattr(q, 'shape', q)}")
    o = None if out is None else out.view(B, 1, *out.shape[1:])
    u = lambda t: t.unsqueeze(1)  # noqa: E731  (a free view: (B, ...) -> (B, 1, ...))
    res = _run_buffered(op, u(q), u(k), u(v), u(a), u(b), A_log, dt_bias, state, state_slots,
                        buf_k, buf_v, buf_g, buffer_slots, lengths, o, 1)
    return res[:, 0]


def gdn_verify(op: CompiledOp, q, k, v, a, b, A_log, dt_bias, state, state_slots,
               buf_k, buf_v, buf_g, buffer_slots, lengths, out=None):
    """reference.verify for T = op['T_new'] drafts: q (B, T, Hk, K) ... -> o (B, T, Hv, V).

    Writes the T entries at lengths[b] .. lengths[b]+T-1 and leaves lengths alone (accept m drafts
    with lengths += m). With a fused flush (flush_at > 0) rows reaching flush_at are folded.
    """
    expect_kind(op, "buffered")
    T_new = op["T_new"]
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] != T_new:
        raise ShapeError(f"q must be (B, {T_new}, Hk, K) for this kernel, got {getattr(q, 'shape', q)}")
    return _run_buffered(op, q, k, v, a, b, A_log, dt_bias, state, state_slots,
                         buf_k, buf_v, buf_g, buffer_slots, lengths, out, T_new)


def gdn_flush(op: CompiledOp, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths):
    """reference.flush: fold each row's lengths[b] entries into its state (caller resets lengths)."""
    expect_kind(op, "flush")
    if not isinstance(buffer_slots, torch.Tensor):
        raise TypeError(f"buffer_slots must be a torch.Tensor, got {type(buffer_slots).__name__}")
    B, dev = buffer_slots.shape[0], state.device
    check_state(op, state, state_slots, B, dev)
    check_buffer(op, buf_k, buf_v, buf_g, buffer_slots, lengths, B, dev)
    check_capacity(lengths, buffer_slots >= 0, 0, op["cap"])
    if bool(((buffer_slots >= 0) & (lengths > 0) & (state_slots < 0)).any()):
        raise SlotError("flush of a row with buffered entries but no state slot: allocate a state first")
    if B:
        op.fn(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)


def gdn_prefill(ops: dict, q, k, v, a, b, A_log, dt_bias, state, state_slot: int, buf_k, buf_v, buf_g,
                buffer_slot: int, length: int):
    """Chunked prefill of one request (q: (T, Hk, K) ...) as reference.prefill: returns (o, new length).

    `ops` maps chunk sizes to buffered kernels built with flush_at = C (all the same C), e.g.
    {8: ..., 4: ..., 2: ..., 1: ...}; see `prefill_chunks`: each chunk is one verify launch (T-token
    verify + fused flush when it fills the buffer).
    """
    dev = q.device
    row = lambda s: torch.tensor([s], dtype=torch.int32, device=dev)  # noqa: E731
    s_slot, b_slot = row(state_slot), row(buffer_slot)
    outs = []
    for start, take, n in prefill_chunks(ops, q.shape[0], length, state_slot):
        part = lambda t: t[start:start + take].unsqueeze(0).contiguous()  # noqa: E731
        o = gdn_verify(ops[take], part(q), part(k), part(v), part(a), part(b), A_log, dt_bias, state,
                       s_slot, buf_k, buf_v, buf_g, b_slot, row(n))
        outs.append(o[0])
        length = (n + take) % ops[take]["flush_at"]
    o = torch.cat(outs, 0) if outs else v.new_zeros((0,) + tuple(v.shape[1:]))
    return o, length


# ----------------------------------------------------------------------------------------------
# the CUDA launches: the kernel looked up for the arguments' shapes, then run on torch's stream; checked=False
# (engine-built rows) or a CUDA-graph capture launches directly, skipping the checks that read the device back


def launch_recurrent_step(q, k, v, a, b, A_log, dt_bias, state, state_slots, *, checked=True):
    op = kernel_for(linear_key(RECURRENT, k, v), q.shape[0])
    if checked and not capturing():
        return on_torch_stream(gdn_recurrent_step, op, q, k, v, a, b, A_log, dt_bias, state, state_slots)
    o = torch.empty_like(v)
    u = token_axis
    on_torch_stream(op.fn, u(q), u(k), u(v), u(a), u(b), A_log, dt_bias, state, state_slots, u(o))
    return o


def launch_buffered_step(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                      lengths, flush_at, *, checked=True):
    op = kernel_for(linear_key(BUFFERED, k, v, buf_k, 1, flush_at), q.shape[0])
    pools = (state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if checked and not capturing():
        return on_torch_stream(gdn_buffered_step, op, q, k, v, a, b, A_log, dt_bias, *pools)
    u = token_axis
    o = torch.empty_like(v)
    on_torch_stream(op.fn, u(q), u(k), u(v), u(a), u(b), A_log, dt_bias, *pools, u(o))
    return o


def launch_verify(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths,
               flush_at=0, *, checked=True):
    op = kernel_for(linear_key(BUFFERED, k, v, buf_k, q.shape[1], flush_at), q.shape[0])
    args = (q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if checked and not capturing():
        return on_torch_stream(gdn_verify, op, *args)
    o = torch.empty_like(v)
    on_torch_stream(op.fn, *args, o)
    return o


def launch_recurrent_drafts(q, k, v, a, b, A_log, dt_bias, state, state_slots, draft_states, draft_rows, *, checked=True):
    op = kernel_for(linear_key(RECURRENT_DRAFTS, k, v, T=q.shape[1]), q.shape[0])
    args = (q, k, v, a, b, A_log, dt_bias, state, state_slots, draft_states, draft_rows)
    if checked and not capturing():
        return on_torch_stream(gdn_recurrent_drafts, op, *args)
    o = torch.empty_like(v)
    on_torch_stream(op.fn, *args, o)
    return o


def launch_flush_op(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, *, checked=True) -> None:
    """Fold each row's lengths[b] buffer entries into its state."""
    launch_flush(FLUSH, gdn_flush, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, checked=checked)


# ----------------------------------------------------------------------------------------------
# the custom ops (CPU: the reference, with its checks; CUDA: the launches above) and the engine's calls


@torch.library.custom_op("kvbuffer::gdn_recurrent_step", mutates_args=("state",), device_types="cpu")
def recurrent_step_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                       state_slots: torch.Tensor) -> torch.Tensor:
    """reference.gdn.recurrent_step: q, k (B, Hk, K), v (B, Hv, V), a, b (B, Hv) -> o (B, Hv, V)."""
    return ref_gdn.recurrent_step(q, k, v, a, b, A_log, dt_bias, state, state_slots)


def _gdn_buffered_cpu(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                      lengths, flush_at):
    """reference verify of T tokens, folding the buffers that reach flush_at (the kernels' semantics)."""
    return ref_gdn.verify(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                          lengths, flush_at)


_BUFFER_MUTATIONS = ("state", "buf_k", "buf_v", "buf_g")


@torch.library.custom_op("kvbuffer::gdn_buffered_step", mutates_args=BUFFER_MUTATIONS, device_types="cpu")
def buffered_step_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
                      buf_k: torch.Tensor, buf_v: torch.Tensor, buf_g: torch.Tensor, buffer_slots: torch.Tensor,
                      lengths: torch.Tensor, flush_at: int) -> torch.Tensor:
    """reference.gdn.buffered_step(flush_at): q, k (B, Hk, K), v (B, Hv, V), a, b (B, Hv) -> o (B, Hv, V)."""
    u = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731  (None: the reference names it)
    return _gdn_buffered_cpu(u(q), u(k), u(v), u(a), u(b), A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g,
                             buffer_slots, lengths, flush_at)[:, 0]


@torch.library.custom_op("kvbuffer::gdn_verify", mutates_args=BUFFER_MUTATIONS, device_types="cpu")
def verify_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
               buf_k: torch.Tensor, buf_v: torch.Tensor, buf_g: torch.Tensor, buffer_slots: torch.Tensor,
               lengths: torch.Tensor, flush_at: int = 0) -> torch.Tensor:
    """reference.gdn.verify of T tokens (inputs (B, T, ...)) -> o (B, T, Hv, V); flush_at > 0: a prefill chunk."""
    return _gdn_buffered_cpu(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g,
                             buffer_slots, lengths, flush_at)


@torch.library.custom_op("kvbuffer::gdn_flush", mutates_args=("state",), device_types="cpu")
def flush_op(state: torch.Tensor, state_slots: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor,
              buf_g: torch.Tensor, buffer_slots: torch.Tensor, lengths: torch.Tensor) -> None:
    """reference.core.flush: fold each row's lengths[b] entries into its state."""
    ref_core.flush(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)


@torch.library.custom_op("kvbuffer::gdn_recurrent_drafts", mutates_args=("draft_states",), device_types="cpu")
def recurrent_drafts_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
                         draft_states: torch.Tensor, draft_rows: torch.Tensor) -> torch.Tensor:
    """reference.gdn.recurrent_drafts: T tokens per row (inputs (B, T, ...)) -> o (B, T, Hv, V)."""
    return ref_gdn.recurrent_drafts(q, k, v, a, b, A_log, dt_bias, state, state_slots, draft_states, draft_rows)


implement(recurrent_step_op, lambda a: meta_checks("gdn_recurrent_step", a), lambda a: torch.empty_like(a["v"]), launch_recurrent_step)
implement(buffered_step_op, lambda a: meta_checks("gdn_buffered_step", a), lambda a: torch.empty_like(a["v"]), launch_buffered_step)
implement(verify_op, lambda a: meta_checks("gdn_verify", a), lambda a: torch.empty_like(a["v"]), launch_verify)
implement(flush_op, lambda a: meta_checks("gdn_flush", a), lambda a: None, launch_flush_op)
implement(recurrent_drafts_op, lambda a: meta_checks("gdn_recurrent_drafts", a), lambda a: torch.empty_like(a["v"]), launch_recurrent_drafts)
GDN_OPS = LinearOps(
    EngineOp(launch_recurrent_step, lambda: torch.ops.kvbuffer.gdn_recurrent_step),
    EngineOp(launch_buffered_step, lambda: torch.ops.kvbuffer.gdn_buffered_step),
    EngineOp(launch_verify, lambda: torch.ops.kvbuffer.gdn_verify),
    EngineOp(launch_recurrent_drafts, lambda: torch.ops.kvbuffer.gdn_recurrent_drafts),
    EngineOp(launch_flush_op, lambda: torch.ops.kvbuffer.gdn_flush),
    GDN_CHUNK_PREFILL_OP)
LAUNCHES = {"gdn_recurrent_step": launch_recurrent_step, "gdn_buffered_step": launch_buffered_step,
            "gdn_verify": launch_verify, "gdn_recurrent_drafts": launch_recurrent_drafts, "gdn_flush": launch_flush_op,
            "gdn_chunk_prefill": prefill.launch_gdn}
FAMILY = register(Family("gdn", GDNDims, LINEAR_OPS, (*SPECS, GDN_CHUNK_PREFILL), LAUNCHES,
                         lambda package: linear_variants("gdn", {s.op: s for s in SPECS}, package)
                         + [prefill.variant("gdn", package)]))
