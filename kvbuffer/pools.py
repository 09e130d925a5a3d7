"""Fixed-capacity pools of per-request state, buffer and conv slots, allocated up front.

Servers address request memory by slot index within a batch; kvbuffer does the same. Every pool
holds all linear-attention layers of a model (axis 0 = layer) so one slot index serves every layer,
and `pool.layer(i)` gives the contiguous per-layer tensors that the ops take.

Slot conventions (see kvbuffer.reference.core):
- real slots are 0 .. capacity-1; -1 is the null slot. A batch row whose buffer slot is -1 is
  padding (zero output, nothing written). A row whose state slot is -1 has no state yet: a short
  context served from its buffer alone, S0 read as zero.
- allocate() hands out a slot that is zeroed in every layer (state, buffer entries, fill length,
  conv history), so nothing of a freed request can leak into the next one.
- lengths (the buffer fill of each slot) live on the device for the kernels, with a host mirror
  that the pool keeps in step, so bounds can be checked without a device round trip. The ops
  never advance them: call accept()/advance() once per forward, after every layer has run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import BufferOverflowError, PoolExhaustedError, ShapeError, SlotError


class SlotAllocator:
    """Free-list of integer slots 0..capacity-1 with double-free and range checks."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest slot first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, slot: int | None = None) -> int:
        """Hand out the lowest free slot, or claim `slot` (pools that share a request's index)."""
        if slot is None:
            if not self._free:
                raise PoolExhaustedError(f"all {self.capacity} slots are in use")
            slot = self._free.pop()
        else:
            if not 0 <= slot < self.capacity:
                raise SlotError(f"slot {slot} is outside [0, {self.capacity})")
            if slot in self._used:
                raise SlotError(f"slot {slot} is already allocated")
            self._free.remove(slot)
        self._used.add(slot)
        return slot

    def check_used(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise SlotError(f"slot {slot} is outside [0, {self.capacity})")
        if slot not in self._used:
            raise SlotError(f"slot {slot} is not allocated")

    def free(self, slot: int) -> None:
        self.check_used(slot)
        self._used.remove(slot)
        self._free.append(slot)

    def __contains__(self, slot: int) -> bool:
        return slot in self._used


@dataclass(frozen=True)
class LinearLayerShape:
    """Head geometry of one linear-attention layer in the generic form (K x V state per value head).

    Gated DeltaNet: key heads Hk, value heads Hv, K = head_k_dim, V = head_v_dim, delta_rule=True.
    Mamba-2: Hk = n_groups (B and C are per group), Hv = num_heads, K = ssm_state_size, V = head_dim,
    delta_rule=False. The state is stored key-major (K, V) for both: transformers stores Mamba-2's
    as (P, N) = (V, K), so moving a state to or from transformers transposes it.
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    delta_rule: bool = True

    def __post_init__(self):
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads ({self.num_k_heads})")

    @property
    def state_bytes(self) -> int:
        """fp32 state bytes per request and layer."""
        return 4 * self.num_v_heads * self.head_k_dim * self.head_v_dim


class _TensorPool:
    """One tensor (num_layers, capacity, ...) whose slots are handed out zeroed."""

    def __init__(self, capacity: int, shape: tuple, *, device, dtype):
        self.slots = SlotAllocator(capacity)
        self.state = torch.zeros((shape[0], capacity) + tuple(shape[1:]), dtype=dtype, device=device)

    def allocate(self, slot: int | None = None) -> int:
        slot = self.slots.allocate(slot)
        self.state[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self.slots.free(slot)

    def layer(self, i: int) -> torch.Tensor:
        return self.state[i]


class StatePool(_TensorPool):
    """fp32 (or fp64) recurrent states: tensor (num_layers, capacity, Hv, K, V)."""

    def __init__(self, shape: LinearLayerShape, num_layers: int, capacity: int, *,
                 device=None, dtype=torch.float32):
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"states are kept in float32 (or float64 for tests), got {dtype}")
        self.shape = shape
        super().__init__(capacity, (num_layers, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim),
                         device=device, dtype=dtype)


@dataclass(frozen=True)
class LayerBuffer:
    """One layer's view of the buffer pool, in the argument order of the ops."""

    keys: torch.Tensor  # (capacity, cap, Hk, K)
    values: torch.Tensor  # (capacity, cap, Hv, V): deltas (GDN) or dt*x (Mamba-2)
    log_decay: torch.Tensor  # (capacity, cap, Hv): cumulative G_i since the state

    def tensors(self):
        return self.keys, self.values, self.log_decay


class BufferPool:
    """Per-request buffers of recent (key, delta, G) entries, `entries` long, for every layer.

    `entries` must cover the flush chunk C plus the most drafts verified at once (entries of
    drafts are written past the fill before acceptance is known).
    """

    def __init__(self, shape: LinearLayerShape, num_layers: int, capacity: int, entries: int, *,
                 device=None, dtype=torch.float32, log_decay_dtype=torch.float32):
        if entries < 1:
            raise ValueError(f"entries must be >= 1, got {entries}")
        self.shape, self.entries = shape, entries
        self.slots = SlotAllocator(capacity)
        L, Hk, Hv = num_layers, shape.num_k_heads, shape.num_v_heads
        self.keys = torch.zeros(L, capacity, entries, Hk, shape.head_k_dim, dtype=dtype, device=device)
        self.values = torch.zeros(L, capacity, entries, Hv, shape.head_v_dim, dtype=dtype, device=device)
        self.log_decay = torch.zeros(L, capacity, entries, Hv, dtype=log_decay_dtype, device=device)
        self._device_lengths = torch.zeros(capacity, dtype=torch.int32, device=device)
        self._host_lengths = [0] * capacity
        self._stale = False  # the device copy lags the host's until someone reads `lengths`

    def allocate(self, slot: int | None = None) -> int:
        slot = self.slots.allocate(slot)
        self.keys[:, slot].zero_()
        self.values[:, slot].zero_()
        self.log_decay[:, slot].zero_()
        self._set(slot, 0)
        return slot

    def free(self, slot: int) -> None:
        self.slots.free(slot)
        self._set(slot, 0)

    def layer(self, i: int) -> LayerBuffer:
        return LayerBuffer(self.keys[i], self.values[i], self.log_decay[i])

    def length(self, slot: int) -> int:
        self.slots.check_used(slot)
        return self._host_lengths[slot]

    @property
    def lengths(self) -> torch.Tensor:
        """Every slot's fill, (capacity,) int32 on the pool's device.

        The host's list is the truth; the device copy is refreshed in one transfer when read, so
        the engine's per-request bookkeeping after each forward costs no device writes.
        """
        if self._stale:
            self._device_lengths.copy_(torch.tensor(self._host_lengths, dtype=torch.int32))
            self._stale = False
        return self._device_lengths

    def batch_lengths(self, slots: list[int]) -> torch.Tensor:
        """Fill per batch row (0 for padding rows), on the pool's device, for the ops."""
        return torch.tensor([self._host_lengths[s] if s >= 0 else 0 for s in slots],
                            dtype=torch.int32, device=self._device_lengths.device)

    def accept(self, slot: int, count: int) -> None:
        """Keep `count` more entries: a decode step's one, accepted drafts, or a prefill chunk."""
        self.slots.check_used(slot)
        new = self._host_lengths[slot] + count
        if count < 0 or new > self.entries:
            raise BufferOverflowError(f"slot {slot}: {self._host_lengths[slot]} + {count} entries "
                                      f"do not fit in {self.entries}")
        self._set(slot, new)

    def reset(self, slot: int) -> None:
        """Empty the buffer after a flush folded it into the state."""
        self.slots.check_used(slot)
        self._set(slot, 0)

    def _set(self, slot: int, value: int) -> None:
        self._host_lengths[slot] = value
        self._stale = True


class ConvPool(_TensorPool):
    """Short-conv histories: (num_layers, capacity, conv_dim, width - 1 + max_drafts)."""

    def __init__(self, conv_dim: int, width: int, num_layers: int, capacity: int, *, max_drafts: int = 8,
                 device=None, dtype=torch.float32):
        if width < 2:
            raise ShapeError(f"conv width must be >= 2, got {width}")
        self.width = width
        super().__init__(capacity, (num_layers, conv_dim, width - 1 + max(1, max_drafts)), device=device, dtype=dtype)
