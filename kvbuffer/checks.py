"""Input validation shared by the reference ops, the kernel launchers and the pools.

Every check runs before anything is written, so a rejected call leaves pools untouched.
Messages say which argument is wrong, what was expected and what was given.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .errors import BufferOverflowError, DeviceError, DTypeError, ExpertIndexError, ShapeError, SlotError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check one tensor argument; `None` in `shape` accepts any size on that axis."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(e is None or e == a for e, a in zip(shape, t.shape))
        if not ok:
            want = "(" + ", ".join("*" if e is None else str(e) for e in shape) + ")"
            raise ShapeError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise DTypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise DeviceError(f"{name} is on {t.device}, expected {device} (the pool's device)")
    return t


def check_expert_ids(expert: torch.Tensor, num_experts: int) -> None:
    """Every id of `expert` names one of `num_experts` experts (one read of the ids back)."""
    if expert.numel():
        lo, hi = (int(v) for v in torch.aminmax(expert))
        if lo < 0 or hi >= num_experts:
            raise ExpertIndexError(f"expert holds id {lo if lo < 0 else hi}, outside [0, {num_experts}) "
                                   "(the experts weight's first dimension)")


def check_expert_ends(ends: torch.Tensor, rows: int) -> None:
    """Rows sorted by expert: `ends` (E,) are where each expert's rows end, non-decreasing from 0 and
    ending at `rows` (one read of the ends back)."""
    if ends.numel():
        first, last, falls = (int(v) for v in torch.stack([ends[0], ends[-1], (ends[1:] < ends[:-1]).sum()]).tolist())
        if first < 0 or last != rows or falls:
            raise ExpertIndexError(f"ends must be non-decreasing from >= 0 to the rows of x ({rows}): where each "
                                   f"expert's rows end; got {first} .. {last}" + (", decreasing" if falls else ""))
    elif rows:
        raise ExpertIndexError(f"x has {rows} rows but ends names no expert")


def check_slots(name: str, slots: object, batch: int, num_slots: int, device: torch.device) -> torch.Tensor:
    """Slot indices: int32/int64, shape (batch,), each in [-1, num_slots). -1 is the null slot."""
    check_tensor(name, slots, (batch,), INDEX_DTYPES, device)
    if batch:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1 or hi >= num_slots:
            bad = lo if lo < -1 else hi
            raise SlotError(f"{name} holds slot {bad}, outside [-1, {num_slots}) (-1 is the null slot)")
    return slots


def check_unique(name: str, slots: torch.Tensor) -> None:
    """Two batch rows writing one slot would race on the GPU and silently lose one row."""
    real = slots[slots >= 0]
    if real.numel() != torch.unique(real).numel():
        raise SlotError(f"{name} repeats a slot; each real slot may appear once per batch")


def check_capacity(lengths: torch.Tensor, valid: torch.Tensor, adding: int, capacity: int) -> None:
    """Raise if appending `adding` entries to any valid row would overflow its buffer."""
    if not bool(valid.any()):
        return
    worst = int(lengths[valid].max())
    low = int(lengths[valid].min())
    if low < 0:
        raise ShapeError(f"lengths must be >= 0, got {low}")
    if worst + adding > capacity:
        raise BufferOverflowError(
            f"buffer overflow: a row holds {worst} entries and would add {adding}, "
            f"capacity is {capacity}; flush it first"
        )


def same_dtype(pairs: Sequence[tuple[str, torch.Tensor]]) -> torch.dtype:
    """All named tensors must share one floating dtype; return it."""
    first_name, first = pairs[0]
    for name, t in pairs[1:]:
        if t.dtype != first.dtype:
            raise DTypeError(f"{name} has dtype {t.dtype}, but {first_name} has {first.dtype}; they must match")
    if first.dtype not in FLOAT_DTYPES:
        raise DTypeError(f"{first_name} must be a floating tensor, got {first.dtype}")
    return first.dtype


def check_param(name: str, t: object, size: int, device: torch.device) -> torch.Tensor:
    """A per-head layer parameter (A_log, dt_bias, D) or per-channel bias: exactly (size,). A (1,)
    tensor would broadcast silently to every head, so it is refused like any other size."""
    return check_tensor(name, t, (size,), FLOAT_DTYPES, device)


def check_heads(state: object, name: str, t: object) -> tuple[tuple[int, ...], int, torch.device]:
    """The state pool (num_slots, H, K, V) and a per-token tensor (..., H, V) named `name` (v, or
    Mamba-2's x): returns (its leading dims, H, the pool's device) for the per-head gates."""
    check_tensor("state", state, (None, None, None, None), (torch.float32, torch.float64))
    check_tensor(name, t, dtypes=FLOAT_DTYPES)
    lead, (_, H, _, V) = tuple(t.shape[:-2]), state.shape
    check_tensor(name, t, lead + (H, V), device=state.device)
    return lead, H, state.device


def check_same_device(tensors: dict) -> None:
    """Every tensor argument of one op on one device (None entries skipped). A `meta` tensor among
    real ones would route the call to the shape-only fake, which returns uninitialised memory."""
    named = [(n, t) for n, t in tensors.items() if isinstance(t, torch.Tensor)]
    if not named:
        return
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise DeviceError(f"{name} is on {t.device}, but {first_name} is on {first.device}; every tensor of "
                              "the call must be on one device")


def check_no_overlap(name: str, t: torch.Tensor) -> None:
    """A pool tensor the op writes must not alias itself: an expanded (stride-0) or overlapping view
    would make the writes of different slots land on the same memory. Metadata only."""
    reach = 0  # the furthest element offset the smaller-stride axes reach
    for stride, size in sorted((abs(st), sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= reach:
            raise ShapeError(f"{name} has overlapping memory (strides {tuple(t.stride())} for shape "
                             f"{tuple(t.shape)}; an expanded view?): pass a tensor that owns each element, "
                             "e.g. .clone()")
        reach += stride * (size - 1)


def check_disjoint(tensors: dict) -> None:
    """Pool tensors an op writes must each own their memory and not share any with another
    (e.g. buf_k and buf_v two views of one tensor): one write would clobber the other.
    Metadata only (storage identity and offsets), so fake tensors are checked too."""
    seen = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            continue
        check_no_overlap(name, t)
        span = _byte_span(t)
        for other, o, o_span in seen:
            if torch._C._is_alias_of(t, o) and span[0] < o_span[1] and o_span[0] < span[1]:
                raise ShapeError(f"{name} and {other} share memory; each pool tensor must be its own allocation")
        seen.append((name, t, span))


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of t within its storage."""
    start = t.storage_offset() * t.element_size()
    if not t.numel():
        return start, start
    return start, start + t.element_size() * (1 + sum(s * (n - 1) for s, n in zip(t.stride(), t.shape)))


def check_row_writes(dst: dict, rows: object, pos: object, values: dict, real: object = None, *,
                     read_values: bool = True) -> None:
    """The arguments of `pool[rows, pos] = value` for each pool of `dst` (name -> a (slots, positions,
    ...) tensor; several pools match but for their last axis) and its value in `values` (name ->
    tensor, in the same order): rows and pos int32/int64 of one shape (B, ...), each value shaped
    rows.shape + its pool's trailing dims and of its pool's dtype (nothing is cast), one device,
    pools that own their memory. `real` (B,) bool: the rows that write (the others' indices are not
    read). read_values: also read the indices back and refuse any outside [0, slots) x [0, positions),
    in int64 (off under CUDA-graph capture, where nothing may be read)."""
    check_same_device({**dst, "rows": rows, "pos": pos, **values, "real": real})
    (first_name, first), *others = dst.items()
    check_tensor(first_name, first, dtypes=FLOAT_DTYPES)
    if first.dim() < 2:
        raise ShapeError(f"{first_name} must have shape (slots, positions, ...), got {tuple(first.shape)}")
    for name, pool in others:
        check_tensor(name, pool, tuple(first.shape[:-1]) + (None,), (first.dtype,))
    check_disjoint(dst)
    check_tensor("rows", rows, dtypes=INDEX_DTYPES)
    if rows.dim() < 1:
        raise ShapeError(f"rows must have shape (B, ...), got {tuple(rows.shape)}")
    check_tensor("pos", pos, tuple(rows.shape), INDEX_DTYPES)
    for (name, t), pool in zip(values.items(), dst.values()):
        check_tensor(name, t, tuple(rows.shape) + tuple(pool.shape[2:]), (pool.dtype,))
    if real is not None:
        check_tensor("real", real, (rows.shape[0],), (torch.bool,))
    if not read_values or not rows.numel():
        return
    num_slots, length = first.shape[:2]
    at = _first_outside(rows, pos, real, num_slots, length)
    if at is not None:
        at, slot, position = at
        raise SlotError(f"index {at} of rows and pos writes slot {slot}, position {position}: outside the "
                        f"{num_slots} slots x {length} positions of {first_name}")


def _first_outside(rows, pos, real, num_slots: int, length: int):
    """(index, slot, position) of the first writing row's index outside [0, num_slots) x [0, length),
    or None; in int64. CPU tensors are read as arrays, without launching a torch op per test."""
    lead = (-1,) + (1,) * (rows.dim() - 1)
    if rows.device.type == "cpu":
        r, p = rows.numpy().astype(np.int64), pos.numpy().astype(np.int64)
        bad = (r < 0) | (r >= num_slots) | (p < 0) | (p >= length)
        if real is not None:
            bad &= real.numpy().reshape(lead)
        if not bad.any():
            return None
        at = tuple(int(i) for i in np.argwhere(bad)[0])
    else:
        r, p = rows.long(), pos.long()
        bad = (r < 0) | (r >= num_slots) | (p < 0) | (p >= length)
        if real is not None:
            bad &= real.view(lead)
        if not bool(bad.any()):
            return None
        at = tuple(int(i) for i in bad.nonzero()[0])
    return at, int(r[at]), int(p[at])
