"""Mamba-2 (Nemotron-3) ops on compiled TileLang kernels: compile (`build_mamba2_*`) and validated launch.

The kernels are the decay-only members of the generic family (tiles/linear_decode.py) with the
Mamba-2 front fused: raw x, dt, B, C (and z) in, y = o + D * x (* silu(z)) out, exactly
kvbuffer.reference.mamba2. Dimensions: G groups (key heads), H heads, N state size (K), P head dim (V);
states (slots, H, N, P) fp32. Launchers share the GDN ops' validation (kvbuffer.kernels.compiled).
"""

from __future__ import annotations

import torch

from ..checks import check_tensor
from ..errors import ShapeError
from .compiled import (ACT_DTYPES, CompiledOp, check_buffer, check_contiguous, check_draft_states,
                       check_fill_rules, check_on_cuda, check_state, expect_kind, out_tensor, prefill_chunks)
from .keys import KernelKey, Mamba2Dims
from .specs import spec_for


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
