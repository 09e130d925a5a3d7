"""Input validation shared by the reference ops, the kernel launchers and the pools.

Every check runs before anything is written, so a rejected call leaves pools untouched.
Messages say which argument is wrong, what was expected and what was given.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .errors import BufferOverflowError, DeviceError, DTypeError, ShapeError, SlotError

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
