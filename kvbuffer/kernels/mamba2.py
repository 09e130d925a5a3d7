"""The Mamba-2 (Nemotron-3) family: its specs (kvbuffer.kernels.linear's, and the chunked prefill's),
compile (`build_mamba2_*`), validated launch, CUDA launches, engine ops (MAMBA2_OPS), custom ops and
tuner inputs.

    torch.ops.kvbuffer.mamba2_recurrent_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, z=None) -> y
    torch.ops.kvbuffer.mamba2_buffered_step / mamba2_verify / mamba2_flush / mamba2_recurrent_drafts  (as GDN's)

The kernels are the decay-only members of the generic family (tiles/linear_decode.py) with the
Mamba-2 front fused: raw x, dt, B, C (and z) in, y = o + D * x (* silu(z)) out, exactly
kvbuffer.reference.mamba2. Dimensions: G groups (key heads), H heads, N state size (K), P head dim (V);
states (slots, H, N, P) fp32. Launchers share the GDN ops' validation (kvbuffer.kernels.compiled).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..checks import check_tensor
from ..errors import ShapeError
from ..reference import core as ref_core
from ..reference import mamba2 as ref_mamba2
from . import prefill
from .calls import EngineOp, capturing, implement, on_torch_stream, token_axis
from .compiled import (ACT_DTYPES, CompiledOp, check_buffer, check_contiguous, check_draft_states,
                       check_fill_rules, check_on_cuda, check_state, expect_kind, out_tensor, prefill_chunks)
from .keys import LINEAR_OPS, Mamba2Dims, KernelKey
from .linear import (BUFFER_MUTATIONS, MAMBA2_FRONT, LinearOps, launch_flush, linear_key, linear_specs,
                     linear_variants, meta_checks)
from .lookup import kernel_for
from .prefill import MAMBA2_CHUNK_PREFILL, MAMBA2_CHUNK_PREFILL_OP
from .specs import Family, register, spec_for


SPECS = linear_specs("mamba2", MAMBA2_FRONT, "y", ref_mamba2)
RECURRENT, BUFFERED, FLUSH, RECURRENT_DRAFTS = SPECS


def _key(op: str, G, H, N, P, tunables: dict, dtypes=("in_dtype", "buf_dtype"), **fields) -> KernelKey:
    """The key of a `build_mamba2_*` call: the `dtypes` it names (bfloat16 unless in `tunables`) and has_z
    are key fields."""
    named = {n: tunables.pop(n, "bfloat16") for n in dtypes}
    has_z = bool(tunables.pop("has_z", False))
    return KernelKey("mamba2", op, Mamba2Dims(G, H, N, P), **named, has_z=has_z, **fields)


def build_mamba2_recurrent(G: int, H: int, N: int = 128, P: int = 64, **tunables) -> CompiledOp:
    """Compile the recurrent step (selective_state_update; the baseline); tunables: BV, threads, in_dtype, has_z."""
    key = _key("recurrent", G, H, N, P, tunables, ("in_dtype",))
    return spec_for(key).build(key, tunables)


def build_mamba2_recurrent_drafts(G: int, H: int, N: int = 128, P: int = 64, *, T_new: int, **tunables) -> CompiledOp:
    """Compile the recurrent verify of T_new fed tokens, one state per token (the servers' scheme)."""
    key = _key("recurrent_drafts", G, H, N, P, tunables, ("in_dtype",), T=T_new)
    return spec_for(key).build(key, tunables)


def build_mamba2_buffered(G: int, H: int, N: int = 128, P: int = 64, *, cap: int, T_new: int = 1,
                          flush_at: int = 0, **tunables) -> CompiledOp:
    """Compile the buffered step (T_new=1) / verify (T_new drafts) / prefill chunk, optional fused flush."""
    key = _key("buffered", G, H, N, P, tunables, cap=cap, T=T_new, C=flush_at)
    return spec_for(key).build(key, tunables)


def build_mamba2_flush(G: int, H: int, N: int = 128, P: int = 64, *, cap: int, **tunables) -> CompiledOp:
    """Compile the stand-alone flush (the same kernel as GDN's flush)."""
    key = _key("flush", G, H, N, P, tunables, ("buf_dtype",), cap=cap)
    return spec_for(key).build(key, tunables)


# ----------------------------------------------------------------------------------------------
# validation


def _check_tokens(op: CompiledOp, x, dt, A_log, dt_bias, Bm, Cm, D, z, lead: tuple) -> torch.device:
    p = op.params
    act = ACT_DTYPES[p.get("in_dtype", "bfloat16")]
    check_tensor("x", x, lead + (p["H"], p["P"]), (act,))
    dev = x.device
    check_on_cuda("x", dev)
    check_tensor("dt", dt, lead + (p["H"],), (act,), dev)
    check_tensor("B", Bm, lead + (p["G"], p["N"]), (act,), dev)
    check_tensor("C", Cm, lead + (p["G"], p["N"]), (act,), dev)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("D", D)):
        check_tensor(name, t, (p["H"],), (torch.float32,), dev)
    if (z is not None) != bool(p.get("has_z", False)):
        raise ShapeError(f"this kernel was built with has_z={p.get('has_z', False)}; z {'missing' if z is None else 'given'}")
    if z is not None:
        check_tensor("z", z, tuple(x.shape), (act,), dev)
        check_contiguous("z", z)
    for name, t in (("x", x), ("dt", dt), ("B", Bm), ("C", Cm), ("A_log", A_log), ("dt_bias", dt_bias), ("D", D)):
        check_contiguous(name, t)
    return dev


def _lead(x, dims: int, what: str) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() != dims:
        raise ShapeError(f"x must be {what}, got {getattr(x, 'shape', x)}")
    return x.shape[0]


# ----------------------------------------------------------------------------------------------
# public ops


def mamba2_recurrent_step(op: CompiledOp, x, dt, A_log, dt_bias, Bm, Cm, D, state, state_slots, z=None, out=None):
    """reference.mamba2.recurrent_step: x (Bt, H, P), dt (Bt, H), B, C (Bt, G, N) -> y (Bt, H, P); updates state."""
    expect_kind(op, "recurrent")
    Bt = _lead(x, 3, "(B, H, P)")
    dev = _check_tokens(op, x, dt, A_log, dt_bias, Bm, Cm, D, z, (Bt,))
    check_state(op, state, state_slots, Bt, dev)
    y = out_tensor(out, tuple(x.shape), x)
    if Bt:
        u = lambda t: t.unsqueeze(1)  # noqa: E731  (token axis of 1; a free view)
        op.fn(u(x), u(dt), A_log, dt_bias, u(Bm), u(Cm), D, u(x if z is None else z), state, state_slots, u(y))
    return y


def mamba2_recurrent_drafts(op: CompiledOp, x, dt, A_log, dt_bias, Bm, Cm, D, state, state_slots, draft_states,
                            draft_rows, z=None, out=None):
    """T = op['T_new'] fed tokens per row on the recurrence (x (B, T, H, P) ... -> y (B, T, H, P)), the state
    after token t written to draft_states[draft_rows[b], t]; `state` is only read."""
    expect_kind(op, "recurrent_drafts")
    T_new = op["T_new"]
    Bt = _lead(x, 4, f"(B, {T_new}, H, P)")
    if x.shape[1] != T_new:
        raise ShapeError(f"x must be (B, {T_new}, H, P) for this kernel, got {tuple(x.shape)}")
    dev = _check_tokens(op, x, dt, A_log, dt_bias, Bm, Cm, D, z, (Bt, T_new))
    check_state(op, state, state_slots, Bt, dev, read_only=True)
    check_draft_states(op, draft_states, draft_rows, state, Bt, T_new)
    y = out_tensor(out, tuple(x.shape), x)
    if Bt:
        op.fn(x, dt, A_log, dt_bias, Bm, Cm, D, x if z is None else z, state, state_slots, draft_states, draft_rows, y)
    return y


def _run_buffered(op, x, dt, A_log, dt_bias, Bm, Cm, D, z, state, state_slots, buf_k, buf_v, buf_g,
                  buffer_slots, lengths, out, T_new):
    Bt = x.shape[0]
    dev = _check_tokens(op, x, dt, A_log, dt_bias, Bm, Cm, D, z, (Bt, T_new))
    check_state(op, state, state_slots, Bt, dev)
    check_buffer(op, buf_k, buf_v, buf_g, buffer_slots, lengths, Bt, dev)
    check_fill_rules(op, state_slots, buffer_slots, lengths, T_new)
    y = out_tensor(out, tuple(x.shape), x)
    if Bt:
        op.fn(x, dt, A_log, dt_bias, Bm, Cm, D, x if z is None else z, state, state_slots,
              buf_k, buf_v, buf_g, buffer_slots, lengths, y)
    return y


def mamba2_buffered_step(op: CompiledOp, x, dt, A_log, dt_bias, Bm, Cm, D, state, state_slots,
                         buf_k, buf_v, buf_g, buffer_slots, lengths, z=None, out=None):
    """reference.mamba2.buffered_step(flush_at=op['flush_at']): x (Bt, H, P) ... -> y (Bt, H, P).

    Appends (B, dt * x, G) at lengths[b]; rows with lengths[b] + 1 == flush_at are folded into their
    state in the same launch (the caller then resets their lengths).
    """
    expect_kind(op, "buffered")
    if op["T_new"] != 1:
        raise ShapeError(f"mamba2_buffered_step needs a kernel built with T_new=1, got {op['T_new']}")
    Bt = _lead(x, 3, "(B, H, P)")
    u = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731
    y = _run_buffered(op, u(x), u(dt), A_log, dt_bias, u(Bm), u(Cm), D, u(z), state, state_slots,
                      buf_k, buf_v, buf_g, buffer_slots, lengths, u(out), 1)
    return y.view(Bt, *y.shape[2:])


def mamba2_verify(op: CompiledOp, x, dt, A_log, dt_bias, Bm, Cm, D, state, state_slots,
                  buf_k, buf_v, buf_g, buffer_slots, lengths, z=None, out=None):
    """reference.mamba2.verify for T = op['T_new'] drafts: x (Bt, T, H, P) ... -> y (Bt, T, H, P).

    Writes the T entries at lengths[b] .. lengths[b]+T-1, leaves lengths alone (accept m: lengths += m).
    """
    expect_kind(op, "buffered")
    if _lead(x, 4, "(B, T, H, P)") and x.shape[1] != op["T_new"]:
        raise ShapeError(f"x must be (B, {op['T_new']}, H, P) for this kernel, got {tuple(x.shape)}")
    return _run_buffered(op, x, dt, A_log, dt_bias, Bm, Cm, D, z, state, state_slots,
                         buf_k, buf_v, buf_g, buffer_slots, lengths, out, op["T_new"])


def mamba2_flush(op: CompiledOp, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths):
    """reference.mamba2.flush: fold each row's lengths[b] entries into its state (caller resets lengths)."""
    from .gdn import gdn_flush

    gdn_flush(op, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)


def mamba2_prefill(ops: dict, x, dt, A_log, dt_bias, Bm, Cm, D, state, state_slot: int, buf_k, buf_v, buf_g,
                   buffer_slot: int, length: int, z=None):
    """Chunked prefill of one request (x: (T, H, P) ...) as reference.mamba2.prefill: (y, new length).

    Verify chunks of the sizes in `ops` (all built with one flush_at = C), never crossing a flush boundary.
    """
    dev = x.device
    row = lambda s: torch.tensor([s], dtype=torch.int32, device=dev)  # noqa: E731
    s_slot, b_slot = row(state_slot), row(buffer_slot)
    outs = []
    for start, take, n in prefill_chunks(ops, x.shape[0], length, state_slot):
        part = lambda t: None if t is None else t[start:start + take].unsqueeze(0).contiguous()  # noqa: E731
        y = mamba2_verify(ops[take], part(x), part(dt), A_log, dt_bias, part(Bm), part(Cm), D, state, s_slot,
                          buf_k, buf_v, buf_g, b_slot, row(n), z=part(z))
        outs.append(y[0])
        length = (n + take) % ops[take]["flush_at"]
    y = torch.cat(outs, 0) if outs else x.new_zeros((0,) + tuple(x.shape[1:]))
    return y, length


# ----------------------------------------------------------------------------------------------
# the CUDA launches: the kernel looked up for the arguments' shapes, then run on torch's stream; checked=False
# (engine-built rows) or a CUDA-graph capture launches directly, skipping the checks that read the device back


def launch_recurrent_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, z=None, *, checked=True):
    op = kernel_for(linear_key(RECURRENT, B, x, z=z), x.shape[0])
    if checked and not capturing():
        return on_torch_stream(mamba2_recurrent_step, op, x, dt, A_log, dt_bias, B, C, D, state,
                                state_slots, z)
    u = token_axis
    y = torch.empty_like(x)
    on_torch_stream(op.fn, u(x), u(dt), A_log, dt_bias, u(B), u(C), D, u(x if z is None else z), state,
                     state_slots, u(y))
    return y


def launch_recurrent_drafts(x, dt, A_log, dt_bias, B, C, D, state, state_slots, draft_states, draft_rows, z=None, *,
                            checked=True):
    op = kernel_for(linear_key(RECURRENT_DRAFTS, B, x, T=x.shape[1], z=z), x.shape[0])
    if checked and not capturing():
        return on_torch_stream(mamba2_recurrent_drafts, op, x, dt, A_log, dt_bias, B, C, D, state,
                                state_slots, draft_states, draft_rows, z)
    y = torch.empty_like(x)
    on_torch_stream(op.fn, x, dt, A_log, dt_bias, B, C, D, x if z is None else z, state, state_slots, draft_states,
                     draft_rows, y)
    return y


def launch_buffered_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                         lengths, flush_at, z=None, *, checked=True):
    op = kernel_for(linear_key(BUFFERED, B, x, buf_k, 1, flush_at, z), x.shape[0])
    pools = (state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if checked and not capturing():
        return on_torch_stream(mamba2_buffered_step, op, x, dt, A_log, dt_bias, B, C, D, *pools, z)
    u = token_axis
    y = torch.empty_like(x)
    on_torch_stream(op.fn, u(x), u(dt), A_log, dt_bias, u(B), u(C), D, u(x if z is None else z), *pools, u(y))
    return y


def launch_verify(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths,
                  flush_at=0, z=None, *, checked=True):
    op = kernel_for(linear_key(BUFFERED, B, x, buf_k, x.shape[1], flush_at, z), x.shape[0])
    pools = (state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if checked and not capturing():
        return on_torch_stream(mamba2_verify, op, x, dt, A_log, dt_bias, B, C, D, *pools, z)
    y = torch.empty_like(x)
    on_torch_stream(op.fn, x, dt, A_log, dt_bias, B, C, D, x if z is None else z, *pools, y)
    return y


def launch_flush_op(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, *, checked=True) -> None:
    """Fold each row's lengths[b] buffer entries into its state."""
    launch_flush(FLUSH, mamba2_flush, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, checked=checked)


# ----------------------------------------------------------------------------------------------
# the custom ops (CPU: the reference, with its checks; CUDA: the launches above) and the engine's calls


@torch.library.custom_op("kvbuffer::mamba2_recurrent_step", mutates_args=("state",), device_types="cpu")
def recurrent_step_op(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                          B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                          state_slots: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference.mamba2.recurrent_step: x (Bt, H, P), dt (Bt, H), B, C (Bt, G, N) -> y (Bt, H, P)."""
    return ref_mamba2.recurrent_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, z)


@torch.library.custom_op("kvbuffer::mamba2_recurrent_drafts", mutates_args=("draft_states",), device_types="cpu")
def recurrent_drafts_op(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                            B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                            state_slots: torch.Tensor, draft_states: torch.Tensor, draft_rows: torch.Tensor,
                            z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference.mamba2.recurrent_drafts: T tokens per row (inputs (Bt, T, ...)) -> y (Bt, T, H, P)."""
    return ref_mamba2.recurrent_drafts(x, dt, A_log, dt_bias, B, C, D, state, state_slots, draft_states, draft_rows,
                                       z)


def _m2_buffered_cpu(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                     lengths, flush_at, z):
    return ref_mamba2.verify(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                             lengths, z, flush_at)


@torch.library.custom_op("kvbuffer::mamba2_buffered_step", mutates_args=BUFFER_MUTATIONS, device_types="cpu")
def buffered_step_op(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                         B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                         state_slots: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor, buf_g: torch.Tensor,
                         buffer_slots: torch.Tensor, lengths: torch.Tensor, flush_at: int,
                         z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference.mamba2.buffered_step(flush_at): x (Bt, H, P) ... -> y (Bt, H, P)."""
    u = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731
    return _m2_buffered_cpu(u(x), u(dt), A_log, dt_bias, u(B), u(C), D, state, state_slots, buf_k, buf_v, buf_g,
                            buffer_slots, lengths, flush_at, u(z))[:, 0]


@torch.library.custom_op("kvbuffer::mamba2_verify", mutates_args=BUFFER_MUTATIONS, device_types="cpu")
def verify_op(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                  B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
                  buf_k: torch.Tensor, buf_v: torch.Tensor, buf_g: torch.Tensor, buffer_slots: torch.Tensor,
                  lengths: torch.Tensor, flush_at: int = 0, z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference.mamba2.verify of T tokens (inputs (Bt, T, ...)) -> y (Bt, T, H, P); flush_at > 0: a prefill chunk."""
    return _m2_buffered_cpu(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                            lengths, flush_at, z)


@torch.library.custom_op("kvbuffer::mamba2_flush", mutates_args=("state",), device_types="cpu")
def flush_op(state: torch.Tensor, state_slots: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor,
                 buf_g: torch.Tensor, buffer_slots: torch.Tensor, lengths: torch.Tensor) -> None:
    """reference.mamba2.flush (the same fold as GDN's)."""
    ref_core.flush(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)


implement(recurrent_step_op, lambda a: meta_checks("mamba2_recurrent_step", a), lambda a: torch.empty_like(a["x"]), launch_recurrent_step)
implement(buffered_step_op, lambda a: meta_checks("mamba2_buffered_step", a), lambda a: torch.empty_like(a["x"]), launch_buffered_step)
implement(verify_op, lambda a: meta_checks("mamba2_verify", a), lambda a: torch.empty_like(a["x"]), launch_verify)
implement(flush_op, lambda a: meta_checks("mamba2_flush", a), lambda a: None, launch_flush_op)
implement(recurrent_drafts_op, lambda a: meta_checks("mamba2_recurrent_drafts", a), lambda a: torch.empty_like(a["x"]), launch_recurrent_drafts)
MAMBA2_OPS = LinearOps(
    EngineOp(launch_recurrent_step, lambda: torch.ops.kvbuffer.mamba2_recurrent_step),
    EngineOp(launch_buffered_step, lambda: torch.ops.kvbuffer.mamba2_buffered_step),
    EngineOp(launch_verify, lambda: torch.ops.kvbuffer.mamba2_verify),
    EngineOp(launch_recurrent_drafts, lambda: torch.ops.kvbuffer.mamba2_recurrent_drafts),
    EngineOp(launch_flush_op, lambda: torch.ops.kvbuffer.mamba2_flush),
    MAMBA2_CHUNK_PREFILL_OP)
LAUNCHES = {"mamba2_recurrent_step": launch_recurrent_step, "mamba2_buffered_step": launch_buffered_step,
            "mamba2_verify": launch_verify, "mamba2_recurrent_drafts": launch_recurrent_drafts, "mamba2_flush": launch_flush_op,
            "mamba2_chunk_prefill": prefill.launch_mamba2}
FAMILY = register(Family("mamba2", Mamba2Dims, LINEAR_OPS, (*SPECS, MAMBA2_CHUNK_PREFILL), LAUNCHES,
                         lambda package: linear_variants("mamba2", {s.op: s for s in SPECS}, package)
                         + [prefill.variant("mamba2", package)]))
