"""All per-request memory of one model: linear-layer pools and the attention KV cache.

Allocation is two-level, as KVBuffer needs: a request slot (buffer + conv history + KV cache)
for every running request, and a state slot only once the request's context outgrows its buffer.
In "recurrent" mode every request gets a state at once and its buffer is never used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PoolExhaustedError
from ..pools import BufferPool, ConvPool, LinearLayerShape, SlotAllocator, StatePool


class KVCache:
    """Contiguous per-slot attention cache: k, v of shape (layers, slots, max_len, kv_heads, head_dim)."""

    def __init__(self, num_layers, capacity, max_len, num_kv_heads, head_dim, *, device=None, dtype=torch.float32):
        shape = (max(num_layers, 1), capacity, max_len, num_kv_heads, head_dim)
        self.max_len = max_len
        self.k = torch.zeros(shape, dtype=dtype, device=device) if num_layers else None
        self.v = torch.zeros(shape, dtype=dtype, device=device) if num_layers else None

    def layer(self, i: int):
        return self.k[i], self.v[i]


@dataclass(frozen=True)
class CacheSpec:
    """Sizes that decide the caches' memory; see kvbuffer.plan (later) for the arithmetic."""

    linear_shape: LinearLayerShape | None
    num_linear_layers: int
    conv_dim: int
    conv_width: int
    num_attention_layers: int
    num_kv_heads: int
    head_dim: int
    max_requests: int
    max_states: int
    max_len: int
    chunk_size: int
    max_drafts: int = 8


class ModelCaches:
    """Owns the pools; hands out request and state slots; frees both when a request ends."""

    def __init__(self, spec: CacheSpec, *, device=None, dtype=torch.float32, buffer_dtype=None):
        self.spec = spec
        self.requests = SlotAllocator(spec.max_requests)
        L = spec.num_linear_layers
        if L:
            self.states = StatePool(spec.linear_shape, L, spec.max_states, device=device)
            self.buffers = BufferPool(spec.linear_shape, L, spec.max_requests, spec.chunk_size + spec.max_drafts,
                                      device=device, dtype=buffer_dtype or torch.float32)
            self.convs = ConvPool(spec.conv_dim, spec.conv_width, L, spec.max_requests,
                                  max_drafts=spec.max_drafts, device=device, dtype=torch.float32)
        self.kv = KVCache(spec.num_attention_layers, spec.max_requests, spec.max_len, spec.num_kv_heads,
                          spec.head_dim, device=device, dtype=dtype)

    # request slots -------------------------------------------------------------------------
    def allocate_request(self) -> int:
        """A running request's slot: its buffer, conv history and KV cache all use this index."""
        slot = self.requests.allocate()
        if self.spec.num_linear_layers:
            self.buffers.allocate(slot)
            self.convs.allocate(slot)
        return slot

    def free_request(self, slot: int, state_slot: int) -> None:
        self.requests.free(slot)
        if self.spec.num_linear_layers:
            self.buffers.free(slot)
            self.convs.free(slot)
            if state_slot >= 0:
                self.states.free(state_slot)

    def allocate_state(self) -> int:
        if not self.spec.num_linear_layers:
            return -1
        try:
            return self.states.allocate()
        except PoolExhaustedError as e:
            raise PoolExhaustedError(f"state pool full ({self.spec.max_states} states): {e}") from None
