"""Gated DeltaNet ops on compiled TileLang kernels: compile (`build_*`) and validated launch.

A launcher checks every tensor (shape, dtype, device, contiguity, slot ranges, capacity) with
kvbuffer.checks before the kernel runs, so a bad call raises a typed error and writes nothing.
Semantics are exactly kvbuffer.reference.core's, with the Qwen3.5 gating front fused in:
the kernels take raw q, k (post-conv), v, a, b and A_log, dt_bias (see kvbuffer.reference.gating).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..checks import check_capacity, check_slots, check_tensor, check_unique
from ..errors import ShapeError, SlotError
from ..gpus import local_target

ACT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class CompiledOp:
    """A compiled kernel plus the compile-time parameters its launcher validates against."""

    fn: Callable[..., Any] = field(repr=False)
    kind: str
    params: dict

    def __getitem__(self, key: str):
        return self.params[key]


def _tiles():
    return importlib.import_module("kvbuffer.tiles")


def _build(kind: str, template: str, params: dict, module: str = "gdn", aliases: dict | None = None) -> CompiledOp:
    """Compile kvbuffer.tiles.<module>.<template>(**params) for the local GPU's arch; `aliases` adds
    the generic dimension names."""
    target = local_target()  # before TileLang loads: an unsupported GPU fails fast with DeviceError
    mod = importlib.import_module(f"kvbuffer.tiles.{module}")
    prim = getattr(mod, template)(**params)
    return CompiledOp(_tiles().compile_template(prim, target), kind, dict(params, **(aliases or {})))


def build_gdn_recurrent(Hk: int, Hv: int, K: int = 128, V: int = 128, **tunables) -> CompiledOp:
    """Compile the recurrent step (baseline) for one head shape; tunables: BV, threads, in_dtype."""
    return _build("recurrent", "gdn_recurrent", dict(Hk=Hk, Hv=Hv, K=K, V=V, **tunables))


def build_gdn_buffered(Hk: int, Hv: int, K: int = 128, V: int = 128, *, cap: int, T_new: int = 1,
                       flush_at: int = 0, **tunables) -> CompiledOp:
    """Compile the buffered step (T_new=1) / verify (T_new drafts) with an optional fused flush."""
    return _build("buffered", "gdn_buffered",
                  dict(Hk=Hk, Hv=Hv, K=K, V=V, cap=cap, T_new=T_new, flush_at=flush_at, **tunables))


def build_gdn_flush(Hk: int, Hv: int, K: int = 128, V: int = 128, *, cap: int, **tunables) -> CompiledOp:
    """Compile the stand-alone flush."""
    return _build("flush", "gdn_flush", dict(Hk=Hk, Hv=Hv, K=K, V=V, cap=cap, **tunables))


# ----------------------------------------------------------------------------------------------
# validation


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ShapeError(f"{name} must be contiguous (the kernels index it densely); call .contiguous()")


def _expect(op: CompiledOp, kind: str) -> None:
    if not isinstance(op, CompiledOp) or op.kind != kind:
        got = getattr(op, "kind", type(op).__name__)
        raise TypeError(f"expected a compiled '{kind}' kernel (build_*_{kind}), got {got}")


def _check_state(op: CompiledOp, state, state_slots, B: int, dev) -> None:
    p = op.params
    check_tensor("state", state, (None, p["Hv"], p["K"], p["V"]), (torch.float32,), dev)
    check_slots("state_slots", state_slots, B, state.shape[0], dev)
    check_tensor("state_slots", state_slots, (B,), (torch.int32,))
    check_unique("state_slots", state_slots)
    _contiguous("state", state)


def _check_buffer(op: CompiledOp, buf_k, buf_v, buf_g, buffer_slots, lengths, B: int, dev) -> None:
    p = op.params
    bd = ACT_DTYPES[p.get("buf_dtype", "bfloat16")]
    check_tensor("buf_k", buf_k, (None, p["cap"], p["Hk"], p["K"]), (bd,), dev)
    nb = buf_k.shape[0]
    check_tensor("buf_v", buf_v, (nb, p["cap"], p["Hv"], p["V"]), (bd,), dev)
    check_tensor("buf_g", buf_g, (nb, p["cap"], p["Hv"]), (torch.float32,), dev)
    check_slots("buffer_slots", buffer_slots, B, nb, dev)
    check_tensor("buffer_slots", buffer_slots, (B,), (torch.int32,))
    check_unique("buffer_slots", buffer_slots)
    check_tensor("lengths", lengths, (B,), (torch.int32,), dev)
    for name, t in (("buf_k", buf_k), ("buf_v", buf_v), ("buf_g", buf_g), ("lengths", lengths)):
        _contiguous(name, t)


def _check_tokens(op: CompiledOp, q, k, v, a, b, A_log, dt_bias, lead: tuple) -> torch.device:
    p = op.params
    act = ACT_DTYPES[p.get("in_dtype", "bfloat16")]
    dev = q.device if isinstance(q, torch.Tensor) else None
    check_tensor("q", q, lead + (p["Hk"], p["K"]), (act,), dev)
    if dev.type != "cuda":
        raise ShapeError(f"the compiled kernels run on CUDA tensors; q is on {dev}")
    check_tensor("k", k, lead + (p["Hk"], p["K"]), (act,), dev)
    check_tensor("v", v, lead + (p["Hv"], p["V"]), (act,), dev)
    check_tensor("a", a, lead + (p["Hv"],), (act,), dev)
    check_tensor("b", b, lead + (p["Hv"],), (act,), dev)
    check_tensor("A_log", A_log, (p["Hv"],), (torch.float32,), dev)
    check_tensor("dt_bias", dt_bias, (p["Hv"],), (torch.float32,), dev)
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _contiguous(name, t)
    return dev


def _out(out, shape, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_tensor("out", out, shape, (like.dtype,), like.device)
    _contiguous("out", out)
    return out


# ----------------------------------------------------------------------------------------------
# public ops


def gdn_recurrent_step(op: CompiledOp, q, k, v, a, b, A_log, dt_bias, state, state_slots, out=None):
    """Plain recurrent decode step (reference.recurrent_step with the front fused); updates state."""
    _expect(op, "recurrent")
    B = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() else -1
    dev = _check_tokens(op, q, k, v, a, b, A_log, dt_bias, (B,))
    _check_state(op, state, state_slots, B, dev)
    o = _out(out, tuple(v.shape), v)
    if B:
        u = lambda t: t.unsqueeze(1)  # noqa: E731  (the kernels take a token axis of 1; a free view)
        op.fn(u(q), u(k), u(v), u(a), u(b), A_log, dt_bias, state, state_slots, u(o))
    return o


def check_fill_rules(op, state_slots, buffer_slots, lengths, T_new: int) -> None:
    """The buffer must hold the new tokens, must not pass the fused flush point, and a row that
    reaches it needs a state to fold into (shared by the GDN and Mamba-2 launchers)."""
    valid = buffer_slots >= 0
    check_capacity(lengths, valid, T_new, op["cap"])
    C = op["flush_at"]
    if C:
        if bool((valid & (lengths + T_new > C)).any()):
            raise ShapeError(f"a row would pass flush_at={C} with {T_new} new token(s): flush it first")
        if bool((valid & (lengths + T_new == C) & (state_slots < 0)).any()):
            raise SlotError("a row fills its buffer in this call but has no state slot: allocate a state first")


def _run_buffered(op, q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g,
                  buffer_slots, lengths, out, T_new):
    B = q.shape[0]
    dev = _check_tokens(op, q, k, v, a, b, A_log, dt_bias, (B, T_new))
    _check_state(op, state, state_slots, B, dev)
    _check_buffer(op, buf_k, buf_v, buf_g, buffer_slots, lengths, B, dev)
    check_fill_rules(op, state_slots, buffer_slots, lengths, T_new)
    o = _out(out, tuple(v.shape), v)
    if B:
        op.fn(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, o)
    return o


def gdn_buffered_step(op: CompiledOp, q, k, v, a, b, A_log, dt_bias, state, state_slots,
                      buf_k, buf_v, buf_g, buffer_slots, lengths, out=None):
    """reference.buffered_step(flush_at=op['flush_at']) with the front fused: q (B, Hk, K) ... -> o (B, Hv, V).

    Appends each row's entry at lengths[b]; rows with lengths[b] + 1 == flush_at are folded into
    their state in the same launch (the caller then resets their lengths, see reference.rows_flushed).
    """
    _expect(op, "buffered")
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
    _expect(op, "buffered")
    T_new = op["T_new"]
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] != T_new:
        raise ShapeError(f"q must be (B, {T_new}, Hk, K) for this kernel, got {getattr(q, 'shape', q)}")
    return _run_buffered(op, q, k, v, a, b, A_log, dt_bias, state, state_slots,
                         buf_k, buf_v, buf_g, buffer_slots, lengths, out, T_new)


def gdn_flush(op: CompiledOp, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths):
    """reference.flush: fold each row's lengths[b] entries into its state (caller resets lengths)."""
    _expect(op, "flush")
    if not isinstance(buffer_slots, torch.Tensor):
        raise TypeError(f"buffer_slots must be a torch.Tensor, got {type(buffer_slots).__name__}")
    B, dev = buffer_slots.shape[0], state.device
    _check_state(op, state, state_slots, B, dev)
    _check_buffer(op, buf_k, buf_v, buf_g, buffer_slots, lengths, B, dev)
    check_capacity(lengths, buffer_slots >= 0, 0, op["cap"])
    if bool(((buffer_slots >= 0) & (lengths > 0) & (state_slots < 0)).any()):
        raise SlotError("flush of a row with buffered entries but no state slot: allocate a state first")
    if B:
        op.fn(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)


def prefill_chunks(ops: dict, T: int, length: int, state_slot: int):
    """Cut a T-token prompt after `length` buffered entries into verify chunks: yields (start, size, n).

    `ops` maps chunk sizes to buffered kernels that share one flush_at = C > 0; chunks never cross a
    flush boundary (the chunk that fills the buffer folds it into the state in the same launch),
    largest size first. Needs a size-1 kernel. n is the buffer fill before the chunk.
    """
    if 1 not in ops:
        raise ValueError("prefill needs a T_new=1 kernel in ops to cut any prompt")
    C = {op["flush_at"] for op in ops.values()}
    if len(C) != 1 or 0 in C:
        raise ValueError(f"all prefill kernels must share one flush_at > 0, got {sorted(C)}")
    C = C.pop()
    if not 0 <= length < C:
        raise ShapeError(f"length must be in [0, flush_at={C}), got {length}")
    if length + T >= C and state_slot < 0:
        raise SlotError(f"a prompt of {T} tokens after {length} buffered ones fills the buffer "
                        f"(flush_at={C}); allocate a state slot first")
    sizes = sorted(ops, reverse=True)
    start = 0
    while start < T:
        take = next(s for s in sizes if s <= min(C - length, T - start))
        yield start, take, length
        length = (length + take) % C
        start += take


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
