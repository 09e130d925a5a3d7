"""What every kernel launcher shares: the compiled-kernel type and the checks.

The launchers validate their tensors the same way (shape, dtype, device, contiguity, slot ranges,
buffer room) before a kernel runs, so a bad call raises a typed error and writes nothing.
`build_template` compiles a template outside the specs (another form of a kernel, for tests and
benchmarks); kernels are built through kvbuffer.kernels.specs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..checks import check_capacity, check_slots, check_tensor, check_unique
from ..errors import DeviceError, ShapeError, SlotError
from ..gpus import local_target
from ..reference.core import check_draft_states as check_draft_pool

ACT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class CompiledOp:
    """A compiled kernel plus the compile-time parameters its launcher validates against."""

    fn: Callable[..., Any] = field(repr=False)
    kind: str
    params: dict

    def __getitem__(self, key: str):
        return self.params[key]


def tiles_package():
    return importlib.import_module("kvbuffer.tiles")


def build_template(kind: str, template: str, params: dict, module: str = "gdn", aliases: dict | None = None) -> CompiledOp:
    """Compile kvbuffer.tiles.<module>.<template>(**params) for the local GPU's arch; `aliases` adds
    the generic dimension names."""
    target = local_target()  # before TileLang loads: an unsupported GPU fails fast with DeviceError
    mod = importlib.import_module(f"kvbuffer.tiles.{module}")
    prim = getattr(mod, template)(**params)
    return CompiledOp(tiles_package().compile_template(prim, target), kind, dict(params, **(aliases or {})))


def check_on_cuda(name: str, dev: torch.device) -> None:
    """The launchers' first device check: a compiled kernel cannot read a CPU (or meta) tensor."""
    if dev.type != "cuda":
        raise DeviceError(f"the compiled kernels run on CUDA tensors; {name} is on {dev}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ShapeError(f"{name} must be contiguous (the kernels index it densely); call .contiguous()")


def expect_kind(op: CompiledOp, kind: str) -> None:
    if not isinstance(op, CompiledOp) or op.kind != kind:
        got = getattr(op, "kind", type(op).__name__)
        raise TypeError(f"expected a compiled '{kind}' kernel (build_*_{kind}), got {got}")


def check_state(op: CompiledOp, state, state_slots, B: int, dev, *, read_only: bool = False) -> None:
    """The state pool and the rows' slots; two rows may share a slot only where the kernel never writes
    the state (`read_only`: the recurrent verify, which writes per-token copies instead)."""
    p = op.params
    check_tensor("state", state, (None, p["Hv"], p["K"], p["V"]), (torch.float32,), dev)
    check_slots("state_slots", state_slots, B, state.shape[0], dev)
    check_tensor("state_slots", state_slots, (B,), (torch.int32,))
    if not read_only:
        check_unique("state_slots", state_slots)
    check_contiguous("state", state)


def check_draft_states(op: CompiledOp, draft_states, draft_rows, state, B: int, T: int) -> None:
    """The per-token states a recurrent verify writes (reference.core.check_draft_states), as the kernel
    indexes them: fp32, contiguous, int32 rows."""
    check_draft_pool(draft_states, draft_rows, state, B, T)
    check_tensor("draft_states", draft_states, (None, None, op["Hv"], op["K"], op["V"]), (torch.float32,))
    check_tensor("draft_rows", draft_rows, (B,), (torch.int32,))
    check_contiguous("draft_states", draft_states)


def check_buffer(op: CompiledOp, buf_k, buf_v, buf_g, buffer_slots, lengths, B: int, dev) -> None:
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
        check_contiguous(name, t)


def out_tensor(out, shape, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_tensor("out", out, shape, (like.dtype,), like.device)
    check_contiguous("out", out)
    return out


def check_fill_rules(op, state_slots, buffer_slots, lengths, T_new: int) -> None:
    """The buffer must hold the new tokens, must not pass the fused flush point, and a row that
    reaches it needs a state to fold into (shared by the GDN and Mamba-2 launchers)."""
    valid, end = buffer_slots >= 0, lengths.long() + T_new  # int64: no int32 wrap near 2**31
    check_capacity(lengths, valid, T_new, op["cap"])
    C = op["flush_at"]
    if C:
        if bool((valid & (end > C)).any()):
            raise ShapeError(f"a row would pass flush_at={C} with {T_new} new token(s): flush it first")
        if bool((valid & (end == C) & (state_slots < 0)).any()):
            raise SlotError("a row fills its buffer in this call but has no state slot: allocate a state first")


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
