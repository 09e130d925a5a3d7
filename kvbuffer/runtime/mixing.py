"""The memory-touching parts of a layer: short conv, linear-attention mixers and attention.

Model code computes projections and calls these with a ForwardBatch; they find the rows' slots and
call the batch's Backend (kvbuffer.runtime.backend: reference or kernels, chosen once when the LLM
was built) for the batch's phase and mode. All bookkeeping (advancing buffer fills, flush resets,
KV lengths) is the engine's, done once per forward for every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import check_row_writes
from ..kernels.launch import capturing
from ..reference.prefill_attention import prefill_attention
from ..rows import put_rows
from . import flash_prompt
from .backend import GDNInputs, LinearInputs, Mamba2Inputs, per_token
from .batch import ForwardBatch
from .caches import ModelCaches


def short_conv(x, weight, bias, batch: ForwardBatch, caches: ModelCaches, layer: int):
    """Causal depthwise conv + SiLU over x (B, T, D) with each row's history; verify keeps drafts pending."""
    return batch.backend.short_conv(x, caches.convs.layer(layer), batch.slots, weight, bias, batch.phase)


def gated_delta_mix(q, k, v, a, b, A_log, dt_bias, batch, caches, layer):
    """Gated DeltaNet core for (B, T, ...) inputs: returns o (B, T, Hv, V)."""
    return _linear_mix(GDNInputs(q, k, v, a, b, A_log, dt_bias), batch, caches, layer)


def mamba2_mix(x, dt, B, C, A_log, dt_bias, D, batch, caches, layer):
    """Mamba-2 SSM for (Bt, T, ...) inputs (with D skip): returns y (Bt, T, H, P)."""
    return _linear_mix(Mamba2Inputs(x, dt, A_log, dt_bias, B, C, D), batch, caches, layer)


def _token(i):
    return lambda t: t[:, i]


def _linear_mix(inputs: LinearInputs, batch: ForwardBatch, caches: ModelCaches, layer: int):
    backend, state = batch.backend, caches.states.layer(layer)
    if batch.mode == "recurrent":
        if batch.phase == "verify":
            return _recurrent_verify(inputs, batch, caches, layer)
        steps = [backend.recurrent_step(per_token(inputs, _token(i)), state, batch.state_slots)
                 for i in range(batch.num_tokens)]
        return torch.stack(steps, 1)
    if caches.buffers is None:
        raise ValueError("kvbuffer mode needs caches built with buffers=True")
    buf = caches.buffers.layer(layer).tensors()
    if batch.phase == "prefill":  # folded up to the last flush point, the rest buffered
        return backend.prefill(inputs, state, batch.state_slots, buf, batch.slots, batch.common_fill, batch.flush_at,
                               batch.fuse)
    if batch.phase == "decode":
        o = backend.buffered_step(per_token(inputs, _token(0)), state, batch.state_slots, buf, batch.slots,
                                  batch.lengths, flush_at=batch.flush_at)
        return o[:, None]
    return backend.verify(inputs, state, batch.state_slots, buf, batch.slots, batch.lengths)


def _recurrent_verify(inputs: LinearInputs, batch, caches, layer):
    """The servers' way to verify T drafts: run the recurrence through them, storing the state after
    each one in the request's per-draft states (one launch: Backend.recurrent_drafts); the engine
    copies the accepted one back (engine/commit.py). Padding rows (slot -1) write nothing."""
    if caches.draft_states is None:
        raise ValueError("recurrent-mode verify needs caches built with draft_states=True")
    return batch.backend.recurrent_drafts(inputs, caches.states.layer(layer), batch.state_slots,
                                          caches.draft_states[layer], batch.slots)


def attention(q, k, v, batch: ForwardBatch, caches: ModelCaches, layer: int, scaling: float):
    """Causal attention of new tokens q (B, T, H, D) over each row's cache plus k, v (B, T, Hkv, D).

    New keys and values are written at positions cached .. cached+T-1 of the row's slot; for a
    verify, the engine keeps the accepted prefix by advancing `cached` (rejected ones are overwritten).
    Under torch.compile the windows are read before the write, with the new tokens put into them
    (_window): read after it, the compiled forward keeps a whole copy of the layer's cache to read
    from. Eagerly they are read after it, which saves the two scatters.
    The window is batch.context_len positions (known on the host, so nothing is read back); query
    heads are grouped per KV head in the matmuls instead of repeating the keys. Each row's window
    is gathered once, straight into the (B, Hkv, L, D) layout both matmuls read as they are (an
    index of the cache's (slots, L, Hkv, D) layout would need a second, transposing copy).
    A prompt run eagerly takes _prompt_attention (no score tensor); one run as a CUDA graph's bucket (a
    short chunk: captured, or before its capture, ForwardBatch.graphed) the window path below.
    On the kernel Backend, for decode and verify forwards, when its attention kernel serves the call
    (Backend.attends_in_place; `kvbuffer tune` builds the kernels for the decode and verify token counts),
    the new keys and values are written first and the kernel reads each row's valid positions
    straight from the cache: no window is gathered (also under torch.compile, as a custom op).
    """
    kc, vc = caches.kv.layer(layer)
    if batch.phase != "prefill" and batch.backend.attends_in_place(q, kc):  # tune builds decode and verify T
        return _attention_in_place(q, k, v, kc, vc, caches.kv.max_len, batch, scaling)
    if batch.phase == "prefill" and not batch.graphed and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return _prompt_attention(q, k, v, kc, vc, batch, scaling)
    B, T, H, D = q.shape
    real = batch.slots >= 0
    rows = batch.slots.clamp(min=0).long()
    pos = batch.cached.long()[:, None] + torch.arange(T, device=q.device)[None, :]  # (B, T)
    L = batch.context_len if batch.context_len is not None else int(pos.max()) + 1
    Hkv = kc.shape[2]
    G = H // Hkv
    rows_t = rows[:, None].expand(B, T)
    compiling = torch.compiler.is_compiling()  # then the windows are read first (see the docstring)
    if not compiling:
        put_slot_rows(kc, rows_t, pos, k, real, False)
        put_slot_rows(vc, rows_t, pos, v, real, False)
    keys = _window(kc, rows, L, pos, k if compiling else None).to(q.dtype)  # (B, Hkv, L, D)
    vals = _window(vc, rows, L, pos, v if compiling else None).to(q.dtype)
    if compiling:
        put_slot_rows(kc, rows_t, pos, k, real, False)
        put_slot_rows(vc, rows_t, pos, v, real, False)
    qg = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)  # rows (g, t)
    scores = torch.matmul(qg, keys.transpose(2, 3)) * scaling  # (B, Hkv, G*T, L)
    ahead = torch.arange(L, device=q.device)[None, None, :] > pos[:, :, None]  # (B, T, L): not visible
    scores.masked_fill_(ahead[:, None, None].expand(B, 1, G, T, L).reshape(B, 1, G * T, L), float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, vals).reshape(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)
    return torch.where(real[:, None, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def _prompt_attention(q, k, v, kc, vc, batch: ForwardBatch, scaling: float):
    """A prompt's attention, run eagerly: the new keys and values written at cached .. cached+T-1, then
    torch's fused attention where it fits (kvbuffer.runtime.flash_prompt: CUDA, half precision; cuDNN's
    where torch's gate takes the heads, else FlashAttention-2), else query and key tiles with an online
    softmax (kvbuffer.reference.prefill_attention). Memory stays linear in the context either way: no
    (T x context) score tensor."""
    B, T, H, D = q.shape
    real = batch.slots >= 0
    rows = batch.slots.clamp(min=0).long()[:, None].expand(B, T)
    pos = batch.cached.long()[:, None] + torch.arange(T, device=q.device)[None, :]
    put_slot_rows(kc, rows, pos, k, real, False)
    put_slot_rows(vc, rows, pos, v, real, False)
    if flash_prompt.fits(q, kc):
        if batch.host_slots is not None and batch.host_cached is not None:
            host = [batch.host_slots, batch.host_cached]  # the rows' views are sliced on the host
        else:
            host = torch.stack([batch.slots, batch.cached]).tolist()
        return flash_prompt.flash_prompt_attention(q, k, v, kc, vc, host[0], host[1], scaling)
    cu_seqlens = torch.arange(B + 1, dtype=torch.int64, device=q.device) * T
    out = prefill_attention(q.reshape(B * T, H, D), kc, vc, cu_seqlens, batch.slots, batch.cached, scaling)
    return out.view(B, T, H, D)


def _attention_in_place(q, k, v, kc, vc, max_len: int, batch: ForwardBatch, scaling: float):
    """Write the T new keys and values at cached .. cached+T-1, then attend over the cache in place.
    A padding row's tokens go to the cache's sink (positions max_len .. max_len+T-1, which no row
    reads: KVCache), so the write is one scatter per cache; a cache without that sink takes
    put_slot_rows' padding-safe write."""
    B, T = q.shape[:2]
    real = batch.slots >= 0
    rows = batch.slots.clamp(min=0).long()[:, None].expand(B, T)
    ahead = torch.arange(T, device=q.device)[None, :]
    pos = batch.cached.long()[:, None] + ahead
    if kc.shape[1] - max_len >= T:
        put_kv_rows(kc, vc, rows, torch.where(real[:, None], pos, max_len + ahead), k, v, False)
    else:
        put_slot_rows(kc, rows, pos, k, real, False)
        put_slot_rows(vc, rows, pos, v, real, False)
    return batch.backend.cache_attention(q, kc, vc, batch.slots, batch.cached, scaling, batch.context_len or 0)


@torch.library.custom_op("kvbuffer::put_kv_rows", mutates_args=("k_cache", "v_cache"))
def put_kv_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, checked: bool = True) -> None:
    """k_cache[rows, pos] = k and v_cache[rows, pos] = v: (B, T) indices, (B, T, Hkv, D) values, every
    index a place the caller may write (padding rows pointed at the sink). Several padding rows write
    the same sink positions, in no set order, with different values: unlike put_rows' equal-bytes
    writes, that is harmless only because no row reads the sink. Opaque to torch.compile for the
    reason put_slot_rows is. Every argument is checked before the first write, the indices read back
    too when `checked` (the engine's own calls, whose indices it built, pass False: no host sync) and no
    CUDA graph is being captured: a refused call changes neither cache."""
    check_row_writes({"k_cache": k_cache, "v_cache": v_cache}, rows, pos, {"k": k, "v": v},
                     read_values=checked and not capturing())
    k_cache[rows, pos] = k
    v_cache[rows, pos] = v


@put_kv_rows.register_fake
def _put_kv_rows_fake(k_cache, v_cache, rows, pos, k, v, checked=True) -> None:
    check_row_writes({"k_cache": k_cache, "v_cache": v_cache}, rows, pos, {"k": k, "v": v}, read_values=False)


@torch.library.custom_op("kvbuffer::put_slot_rows", mutates_args=("dst",))
def put_slot_rows(dst: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, values: torch.Tensor,
                  real: torch.Tensor, checked: bool = True) -> None:
    """dst[rows, pos] = values for the real rows: put_rows as one opaque op. Traced as aten ops
    into a pool (a layer's KV cache, its draft states), torch.compile computed the write into a copy
    of the whole pool and copied it back, every step. Checked as put_kv_rows is (dst (slots, positions,
    ...), values of its dtype), the real rows' indices only."""
    check_row_writes({"dst": dst}, rows, pos, {"values": values}, real, read_values=checked and not capturing())
    put_rows(dst, (rows, pos), values, real)


@put_slot_rows.register_fake
def _put_slot_rows_fake(dst, rows, pos, values, real, checked=True) -> None:
    check_row_writes({"dst": dst}, rows, pos, {"values": values}, real, read_values=False)


def _window(cache, rows, L: int, pos, new=None):
    """Each row's first L cache positions (B, Hkv, L, D), gathered once straight into the layout the
    matmuls read; with `new` (B, T, Hkv, D), read before the write, those tokens put in at positions
    pos (B, T) in the cache's dtype: what a read after the write gives."""
    window = torch.index_select(cache[:, :L].transpose(1, 2), 0, rows)
    if new is None:
        return window
    B, T, Hkv, D = new.shape
    at = pos[:, None, :, None].expand(B, Hkv, T, D)
    return window.scatter(2, at, new.to(cache.dtype).transpose(1, 2))
