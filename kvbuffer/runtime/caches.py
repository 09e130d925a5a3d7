"""All per-request memory of one model: linear-layer pools and the attention KV cache.

Allocation is two-level, as KVBuffer needs: a request slot (buffer + conv history + KV cache)
for every running request, and a state slot only once the request's context outgrows its buffer.
In "recurrent" mode every request gets a state at once and no buffer exists; with speculative
decoding that mode also keeps one state per fed draft token, as today's servers do.

`CacheSpec.tensor_shapes()` is the single description of what is allocated: ModelCaches
allocates exactly those tensors, and the capacity planner (kvbuffer.plan) sums their bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PoolExhaustedError
from ..pools import BufferPool, ConvPool, LinearLayerShape, SlotAllocator, StatePool

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8}


def fill_after(fill: int, count: int, chunk_size: int, *, whole: bool) -> int:
    """A buffer's fill after `count` more entries. whole=False (a prefill chunk or a decode step): the
    forward flushed at every multiple of C, the remainder stays; whole=True (a verify's commit): the
    commit folds the whole buffer once it reaches C."""
    total = fill + count
    if whole:
        return 0 if total >= chunk_size else total
    return total % chunk_size


class KVCache:
    """Contiguous per-slot attention cache: k, v of shape (layers, slots, max_len + sink, kv_heads, head_dim).

    Positions max_len .. max_len + sink - 1 of every slot are a sink that no row reads: a CUDA graph's
    padding rows write their keys and values there (kvbuffer.runtime.mixing.put_kv_rows), so a
    forward of up to `sink` tokens per row writes the cache with one scatter whatever its rows.
    """

    def __init__(self, num_layers, capacity, max_len, num_kv_heads, head_dim, *, device=None, dtype=torch.float32,
                 sink: int = 0):
        shape = (num_layers, capacity, max_len + sink, num_kv_heads, head_dim)
        self.max_len = max_len
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, i: int):
        return self.k[i], self.v[i]


@dataclass(frozen=True)
class CacheSpec:
    """Sizes that decide the caches' memory."""

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
    max_drafts: int = 1  # tokens one forward may feed per request and keep pending (verify: drafts + 1)
    buffers: bool = True  # kvbuffer mode; the recurrent mode has no buffers
    draft_states: bool = False  # one state per fed draft token (the recurrent baseline's speculation)

    def tensor_shapes(self, dtype=torch.bfloat16, buffer_dtype=None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every tensor the caches hold."""
        out = {}
        L, s = self.num_linear_layers, self.linear_shape
        if L:
            state = (s.num_v_heads, s.head_k_dim, s.head_v_dim)
            out["states"] = ((L, self.max_states) + state, torch.float32)
            out["conv"] = ((L, self.max_requests, self.conv_dim, self.conv_width - 1 + self.max_drafts), dtype)
            if self.buffers:
                entries = self.chunk_size + self.max_drafts
                bdt = buffer_dtype or dtype
                out["buffer_keys"] = ((L, self.max_requests, entries, s.num_k_heads, s.head_k_dim), bdt)
                out["buffer_values"] = ((L, self.max_requests, entries, s.num_v_heads, s.head_v_dim), bdt)
                out["buffer_log_decay"] = ((L, self.max_requests, entries, s.num_v_heads), torch.float32)
            if self.draft_states:
                out["draft_states"] = ((L, self.max_requests, self.max_drafts) + state, torch.float32)
        if self.num_attention_layers:
            # the sink: one forward's tokens (decode, verify) of padding rows land past max_len (KVCache)
            kv = (self.num_attention_layers, self.max_requests, self.max_len + self.max_drafts, self.num_kv_heads,
                  self.head_dim)
            out["kv_keys"] = (kv, dtype)
            out["kv_values"] = (kv, dtype)
        return out

    def nbytes(self, dtype=torch.bfloat16, buffer_dtype=None) -> dict[str, int]:
        """Bytes of each tensor of tensor_shapes()."""
        out = {}
        for name, (shape, dt) in self.tensor_shapes(dtype, buffer_dtype).items():
            n = 1
            for d in shape:
                n *= d
            out[name] = n * _BYTES[dt]
        return out


class ModelCaches:
    """Owns the pools; hands out request and state slots; frees both when a request ends."""

    def __init__(self, spec: CacheSpec, *, device=None, dtype=torch.float32, buffer_dtype=None):
        self.spec = spec
        self.requests = SlotAllocator(spec.max_requests)
        shapes = spec.tensor_shapes(dtype, buffer_dtype)
        L = spec.num_linear_layers
        self.states = self.buffers = self.convs = self.draft_states = None
        if L:
            self.states = StatePool(spec.linear_shape, L, spec.max_states, device=device)
            self.convs = ConvPool(spec.conv_dim, spec.conv_width, L, spec.max_requests,
                                  max_drafts=spec.max_drafts, device=device, dtype=dtype)
            if spec.buffers:
                self.buffers = BufferPool(spec.linear_shape, L, spec.max_requests, spec.chunk_size + spec.max_drafts,
                                          device=device, dtype=shapes["buffer_keys"][1])
            if spec.draft_states:
                self.draft_states = torch.zeros(shapes["draft_states"][0], dtype=torch.float32, device=device)
        self.kv = None
        if spec.num_attention_layers:
            self.kv = KVCache(spec.num_attention_layers, spec.max_requests, spec.max_len, spec.num_kv_heads,
                              spec.head_dim, device=device, dtype=dtype, sink=spec.max_drafts)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The allocated tensors under tensor_shapes()' names (for accounting and tests)."""
        found = {"states": self.states and self.states.state, "conv": self.convs and self.convs.state,
                 "draft_states": self.draft_states,
                 "kv_keys": self.kv and self.kv.k, "kv_values": self.kv and self.kv.v}
        if self.buffers is not None:
            found.update(buffer_keys=self.buffers.keys, buffer_values=self.buffers.values,
                         buffer_log_decay=self.buffers.log_decay)
        return {k: v for k, v in found.items() if v is not None}

    # request slots -------------------------------------------------------------------------
    def allocate_request(self) -> int:
        """A running request's slot: its buffer, conv history and KV cache all use this index."""
        slot = self.requests.allocate()
        if self.buffers is not None:
            self.buffers.allocate(slot)
        if self.convs is not None:
            self.convs.allocate(slot)
        return slot

    def free_request(self, slot: int, state_slot: int) -> None:
        self.requests.free(slot)
        if self.buffers is not None:
            self.buffers.free(slot)
        if self.convs is not None:
            self.convs.free(slot)
        if state_slot >= 0:
            self.states.free(state_slot)

    def advance_buffer(self, slot: int, count: int, *, whole: bool) -> None:
        """Record `count` more entries in request `slot`'s buffer, by fill_after's rule (no buffers: nothing)."""
        if self.buffers is None:
            return
        fill = fill_after(self.buffers.length(slot), count, self.spec.chunk_size, whole=whole)
        self.buffers.reset(slot)
        self.buffers.accept(slot, fill)

    def allocate_state(self) -> int:
        if self.states is None:
            return -1
        try:
            return self.states.allocate()
        except PoolExhaustedError as e:
            raise PoolExhaustedError(f"state pool full ({self.spec.max_states} states): {e}") from None
