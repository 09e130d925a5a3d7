"""Buffered decode forwards for transformers' Gated DeltaNet and Mamba-2 layers.

Each class holds one `forward(self, ...)` written against the transformers layer it replaces
(`self` is that layer: its projections, conv and parameters), the shape of a layer that
transformers' `kernelize` swaps in by `kernel_layer_name`. The decode step (one token, a cache with
a state) runs through `torch.ops.kvbuffer.*_buffered_step` with the flush fused at C; every other
call (prefill, a continued prompt, no cache) first folds the pending buffers into the cache's state
and then runs the layer's own forward, so transformers sees a plain cache there.

Per cache layer, kvbuffer keeps a `LayerBuffers` in `cache.kvbuffer_buffers[layer_idx]`: the
buffered keys, deltas (GDN) or values (Mamba-2), cumulative log decays and fill counts of every row.
GDN states stay in the cache's own tensor when it is fp32 (the same (B, Hv, K, V) layout, updated
in place); transformers stores Mamba-2 states (B, H, P, N), the transpose of kvbuffer's
(B, H, N, P), and a bf16 model may keep bf16 states, so those layers work on an fp32 kvbuffer-layout
copy that a fold writes back.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..kernels.launch import engine_rows
from .transformers_cache import CacheAccess, access_for, cache_keyword

CACHE_ATTRIBUTE = "kvbuffer_buffers"  # where the buffers live on a transformers cache object
CHUNK_ATTRIBUTE = "kvbuffer_chunk_size"  # set on each enabled layer by enable()


@dataclass
class LayerBuffers:
    """One cache layer's buffers for a batch of B rows (row b uses state slot b and buffer slot b)."""

    source: torch.Tensor  # the cache's recurrent state these were built on
    state: torch.Tensor  # kvbuffer layout (B, Hv, K, V): `source` itself, or a copy (`owned`)
    buf_k: torch.Tensor  # (B, C + 1, Hk, K)
    buf_v: torch.Tensor  # (B, C + 1, Hv, V)
    buf_g: torch.Tensor  # (B, C + 1, Hv), in the state's dtype
    slots: torch.Tensor  # arange(B), int32: state and buffer slots
    lengths: torch.Tensor  # (B,) int32 fill counts
    transposed: bool  # Mamba-2: `state` is source.transpose(-1, -2)
    owned: bool  # `state` is a copy, written back to `source` by fold()

    @property
    def pending(self) -> bool:
        return bool((self.lengths > 0).any())

    def fold(self) -> None:
        """Fold the pending entries into the state and write it back to the cache's tensor."""
        if self.pending:
            flush = torch.ops.kvbuffer.mamba2_flush if self.transposed else torch.ops.kvbuffer.gdn_flush
            flush(self.state, self.slots, self.buf_k, self.buf_v, self.buf_g, self.slots, self.lengths)
            self.lengths.zero_()
        if self.owned:
            self.source.copy_(self.state.transpose(-1, -2) if self.transposed else self.state)

    def advance(self, chunk_size: int) -> None:
        """After a decode step: one more entry per row, or none for rows the step folded at C."""
        grown = self.lengths + 1
        self.lengths.copy_(torch.where(grown == chunk_size, torch.zeros_like(grown), grown))


def buffer_bytes(heads: tuple, entry_dtype, chunk_size: int, rows: int = 1) -> int:
    """Bytes of one layer's buffers (_new_buffers) for `rows` sequences: C + 1 entries of keys and values
    in entry_dtype, and of fp32 log decays; heads: (Hk, K, Hv, V)."""
    heads_k, dim_k, heads_v, dim_v = heads
    return rows * (chunk_size + 1) * ((heads_k * dim_k + heads_v * dim_v) * entry_dtype.itemsize + heads_v * 4)


def check_buffer_memory(total: int, chunk_size: int, device) -> None:
    """ValueError naming chunk_size, before anything is allocated, where `total` buffer bytes exceed
    `device`'s free memory (kvbuffer.plan.check_fits)."""
    from ..engine.validate import free_memory
    from ..plan import check_fits

    check_fits({"buffers": total}, free_memory(device), {"buffers": f"chunk_size={chunk_size}"}, str(device))


def _new_buffers(source: torch.Tensor, heads_k: int, dim_k: int, heads_v: int, dim_v: int, entry_dtype,
                 chunk_size: int, transposed: bool) -> LayerBuffers:
    B, dev = source.shape[0], source.device
    check_buffer_memory(buffer_bytes((heads_k, dim_k, heads_v, dim_v), entry_dtype, chunk_size, B), chunk_size, dev)
    cap = chunk_size + 1  # C entries a flush folds plus the step's own: `kvbuffer tune --chunk-sizes C`
    view = source.transpose(-1, -2) if transposed else source
    exact = view.dtype in (torch.float32, torch.float64)  # the ops keep states in fp32 (fp64 in tests)
    state = view if exact and view.is_contiguous() else view.to(view.dtype if exact else torch.float32).contiguous()
    return LayerBuffers(
        source=source, state=state,
        buf_k=torch.zeros(B, cap, heads_k, dim_k, dtype=entry_dtype, device=dev),
        buf_v=torch.zeros(B, cap, heads_v, dim_v, dtype=entry_dtype, device=dev),
        buf_g=torch.zeros(B, cap, heads_v, dtype=state.dtype, device=dev),
        slots=torch.arange(B, dtype=torch.int32, device=dev),
        lengths=torch.zeros(B, dtype=torch.int32, device=dev),
        transposed=transposed, owned=state is not source)


def buffers_of(cache) -> dict:
    """The cache's {layer index: LayerBuffers}, created empty on first use."""
    table = getattr(cache, CACHE_ATTRIBUTE, None)
    if table is None:
        table = {}
        setattr(cache, CACHE_ATTRIBUTE, table)
    return table


def fold_cache(cache) -> None:
    """Fold every layer's pending entries into the cache's states: a plain transformers cache again.
    TypeError for anything but a transformers `Cache` (nothing is set on it)."""
    from transformers.cache_utils import Cache

    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be a transformers Cache (such as generate's past_key_values), "
                        f"got {type(cache).__name__}")
    for layer in buffers_of(cache).values():
        layer.fold()
    buffers_of(cache).clear()


def _decode_buffers(layer, cache, access: CacheAccess, chunk_size: int, make) -> LayerBuffers:
    """This layer's buffers in `cache` for a decode step: the kept ones, or `make(state)` when there
    are none yet, the cache's state tensor was replaced, or `enable` changed the chunk size."""
    idx = layer.layer_idx
    source = access.recurrent_state(cache, idx)
    rec = buffers_of(cache).get(idx)
    if rec is not None and rec.source is not source and rec.pending:
        raise ValueError(f"cache: layer {idx}'s recurrent state was replaced (beam search's "
                         "reorder_cache, offloading or a reset?) while kvbuffer held buffered tokens for it; "
                         "kvbuffer.integrations.transformers supports greedy and sampling generation, and "
                         "fold(cache) makes a cache plain before handing it on")
    if rec is not None and rec.source is source and rec.buf_k.shape[1] == chunk_size + 1:
        return rec
    if rec is not None and rec.source is source:
        rec.fold()  # built for another chunk size
    rec = buffers_of(cache)[idx] = make(source)
    return rec


def _stock(layer, name: str):
    """A function of the layer's own modeling module (its conv update, padding mask): the same code,
    with the same fast path, that the layer's stock forward calls."""
    return getattr(inspect.getmodule(type(layer)), name)


def _decode_access(layer, hidden_states, cache) -> CacheAccess | None:
    """How to read `cache` when this call is a decode step (one token, a cache with states, not
    recording past states); None when it is not."""
    if cache is None or hidden_states.shape[1] != 1:
        return None
    access, idx = access_for(cache), layer.layer_idx
    if (access.is_recording_past(cache, idx) or access.conv_state(cache, idx) is None
            or access.recurrent_state(cache, idx) is None):
        return None
    return access


def _stock_forward(layer, hidden_states, cache, attention_mask, kwargs):
    if cache is not None:
        rec = buffers_of(cache).pop(layer.layer_idx, None)
        if rec is not None and access_for(cache).recurrent_state(cache, layer.layer_idx) is rec.source:
            rec.fold()
    cls = type(layer)
    return cls.forward(layer, hidden_states, attention_mask=attention_mask, **{cache_keyword(cls): cache}, **kwargs)


def _conv_step(layer, mixed, cache, access: CacheAccess):
    """The layer's short conv for one token, (B, 1, D) -> (B, 1, D), advancing the cache's conv state."""
    conv_state = access.conv_state(cache, layer.layer_idx)
    if callable(getattr(cache, "increase_count", None)):  # 5.25 counts a linear layer's tokens (its seq length)
        cache.increase_count(layer.layer_idx, 0)  # as its stock one-token conv step does
    out = _stock(layer, "causal_conv1d_update")(mixed.transpose(1, 2), conv_state, layer.conv1d.weight.squeeze(1),
                                                layer.conv1d.bias, layer.activation)
    return out.transpose(1, 2)


def _fp32(p: torch.Tensor) -> torch.Tensor:
    """Layer parameters go to the ops in at least fp32 (the kernels read fp32 A_log, dt_bias, D)."""
    return p if p.dtype in (torch.float32, torch.float64) else p.float()


def _buffered_step(layer, cache, access: CacheAccess, op: str, args: list, heads: tuple,
                   transposed: bool = False) -> torch.Tensor:
    """One decode step of the custom op named `op` (a `*_buffered_step`) on this layer's buffers in `cache`, flush fused
    at C; `args` are the op's leading (per-token and layer) arguments, `heads` (Hk, K, Hv, V)."""
    C = getattr(layer, CHUNK_ATTRIBUTE)
    rec = _decode_buffers(layer, cache, access, C,
                          lambda source: _new_buffers(source, *heads, args[0].dtype, C, transposed))
    # the slots and fills are built here, so CUDA launches skip the checks that read the device back
    out = engine_rows(op, *args, rec.state, rec.slots, rec.buf_k, rec.buf_v, rec.buf_g, rec.slots, rec.lengths, C)
    rec.advance(C)
    return out


class BufferedGatedDeltaNet:
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next Gated DeltaNet with a buffered decode step."""

    @staticmethod
    def heads(layer) -> tuple:
        """(Hk, K, Hv, V) of the layer's buffers."""
        return layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim

    def forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
        cache = cache if cache is not None else cache_params  # transformers 5.17 names it cache_params
        access = _decode_access(self, hidden_states, cache)
        if access is None:
            return _stock_forward(self, hidden_states, cache, attention_mask, kwargs)
        hidden_states = _stock(self, "apply_mask_to_padding_states")(hidden_states, attention_mask)
        B = hidden_states.shape[0]
        mixed, z, b, a = _gdn_projections(self, hidden_states)
        conv = _conv_step(self, mixed, cache, access)[:, 0]
        q, k, v = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], -1)
        heads = lambda t, d: t.reshape(B, -1, d).contiguous()  # noqa: E731
        q, k, v = heads(q, self.head_k_dim), heads(k, self.head_k_dim), heads(v, self.head_v_dim)
        o = _buffered_step(self, cache, access, "gdn_buffered_step", [
            q, k, v, a.reshape(B, -1).contiguous(), b.reshape(B, -1).contiguous(), _fp32(self.A_log),
            _fp32(self.dt_bias)], BufferedGatedDeltaNet.heads(self))
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(B, 1, -1))


def _gdn_projections(layer, hidden_states):
    """(conv input (B, 1, conv_dim), z, b, a) from Qwen3.5's separate or Qwen3-Next's fused projections."""
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: head-interleaved qkvz and ba
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(hidden_states),
                                                              layer.in_proj_ba(hidden_states))
        flat = lambda t: t.reshape(t.shape[0], t.shape[1], -1)  # noqa: E731
        return torch.cat((flat(q), flat(k), flat(v)), dim=-1), z, b, a
    return (layer.in_proj_qkv(hidden_states), layer.in_proj_z(hidden_states), layer.in_proj_b(hidden_states),
            layer.in_proj_a(hidden_states))


class BufferedMamba2Mixer:
    """Nemotron-H's Mamba-2 mixer with a buffered decode step (key B, query C, value dt * x)."""

    @staticmethod
    def heads(layer) -> tuple:
        """(Hk, K, Hv, V) of the layer's buffers: groups, state size, heads, head size."""
        return layer.n_groups, layer.ssm_state_size, layer.num_heads, layer.head_dim

    def forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
        cache = cache if cache is not None else cache_params
        access = _decode_access(self, hidden_states, cache)
        if access is None:
            return _stock_forward(self, hidden_states, cache, attention_mask, kwargs)
        mask = _stock(self, "apply_mask_to_padding_states")
        dtype, Bt = hidden_states.dtype, hidden_states.shape[0]
        gate, xBC, dt = self.in_proj(mask(hidden_states, attention_mask)).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        xBC = mask(_conv_step(self, xBC, cache, access), attention_mask)[:, 0]
        GN = self.n_groups * self.ssm_state_size
        x, Bm, Cm = torch.split(xBC, [self.intermediate_size, GN, GN], dim=-1)
        x = x.reshape(Bt, self.num_heads, self.head_dim).contiguous()
        Bm = Bm.reshape(Bt, self.n_groups, self.ssm_state_size).contiguous()
        Cm = Cm.reshape(Bt, self.n_groups, self.ssm_state_size).contiguous()
        y = _buffered_step(self, cache, access, "mamba2_buffered_step", [
            x, dt[:, 0].contiguous(), _fp32(self.A_log), _fp32(self.dt_bias), Bm, Cm, _fp32(self.D)],
            BufferedMamba2Mixer.heads(self), transposed=True)
        y = self.norm(y.reshape(Bt, 1, -1), gate)
        return self.out_proj(y.to(dtype))
