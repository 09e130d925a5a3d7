"""Tiled prompt attention (kvbuffer.reference.prefill_attention) against a plain softmax, torch's
scaled_dot_product_attention, the decode kernels' reference and the engine's prompt path.

Caches hold NaN past each row's last position and in slots no row uses: a read there would show.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvbuffer.errors import DTypeError, ShapeError, SlotError
from kvbuffer.kernels.attention import attention_reference
from kvbuffer.reference.prefill_attention import prefill_attention
from kvbuffer.runtime.batch import ForwardBatch
from kvbuffer.runtime.caches import KVCache
from kvbuffer.runtime.mixing import attention

F64 = torch.float64
TOL = 1e-12


def _problem(rows, H=6, Hkv=2, D=9, positions=None, seed=0, dtype=F64):
    """rows: (T new tokens, L cached positions, slot or None for padding). New keys already written."""
    gen = torch.Generator().manual_seed(seed)
    positions = positions or max(T + L for T, L, _ in rows) + 2
    n_slots = len(rows) + 2
    k_cache = torch.full((n_slots, positions, Hkv, D), float("nan"), dtype=F64)
    v_cache = torch.full((n_slots, positions, Hkv, D), float("nan"), dtype=F64)
    slots = []
    for i, (T, L, slot) in enumerate(rows):
        slots.append(-1 if slot is None else slot)
        if slot is not None:
            k_cache[slot, :L + T] = torch.randn(L + T, Hkv, D, generator=gen, dtype=F64)
            v_cache[slot, :L + T] = torch.randn(L + T, Hkv, D, generator=gen, dtype=F64)
    N = sum(T for T, _, _ in rows)
    q = torch.randn(N, H, D, generator=gen, dtype=F64)
    cu = torch.tensor([0] + torch.tensor([T for T, _, _ in rows]).cumsum(0).tolist(), dtype=torch.int32)
    return dict(q=q.to(dtype), k_cache=k_cache.to(dtype), v_cache=v_cache.to(dtype), cu_seqlens=cu,
                slots=torch.tensor(slots, dtype=torch.int32),
                cached=torch.tensor([L for _, L, _ in rows], dtype=torch.int32), scale=D ** -0.5)


def _plain(p, i):
    """Softmax over request i's whole context at once: (T, H, D)."""
    s, e = int(p["cu_seqlens"][i]), int(p["cu_seqlens"][i + 1])
    slot, L = int(p["slots"][i]), int(p["cached"][i])
    q = p["q"][s:e].to(F64)
    H, Hkv = q.shape[1], p["k_cache"].shape[2]
    keys = p["k_cache"][slot, :L + e - s].to(F64).repeat_interleave(H // Hkv, dim=1)
    vals = p["v_cache"][slot, :L + e - s].to(F64).repeat_interleave(H // Hkv, dim=1)
    scores = torch.einsum("thd,nhd->htn", q, keys) * p["scale"]
    visible = torch.arange(L + e - s)[None, :] <= (L + torch.arange(e - s))[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("htn,nhd->thd", probs, vals)


def _check_plain(p, out, tol=TOL):
    for i in range(len(p["slots"])):
        s, e = int(p["cu_seqlens"][i]), int(p["cu_seqlens"][i + 1])
        if int(p["slots"][i]) < 0:
            assert torch.equal(out[s:e], torch.zeros_like(out[s:e]))
        elif e > s:
            torch.testing.assert_close(out[s:e].to(F64), _plain(p, i), rtol=0, atol=tol)


SIZES = {  # (T, L) per row, block_q, block_k
    "T1_L0": ([(1, 0)], 128, 256),
    "T1_long_prefix": ([(1, 300)], 128, 64),
    "T63_64_65": ([(63, 0), (64, 5), (65, 130)], 64, 64),
    "blocks_of_one": ([(7, 3), (2, 0)], 1, 1),
    "odd_blocks": ([(130, 77), (31, 0), (9, 200)], 13, 7),
    "block_over_everything": ([(40, 20)], 512, 1024),
}


@pytest.mark.parametrize("groups", [1, 3], ids=["mha", "gqa3"])
@pytest.mark.parametrize("case", list(SIZES), ids=list(SIZES))
def test_equals_plain_softmax(case, groups):
    rows, bq, bk = SIZES[case]
    p = _problem([(T, L, i) for i, (T, L) in enumerate(rows)], H=2 * groups, Hkv=2, seed=len(case))
    _check_plain(p, prefill_attention(**p, block_q=bq, block_k=bk))


def test_padding_and_empty_rows():
    """A padding row gives exact zeros; a row without new tokens gives nothing; slots out of order."""
    p = _problem([(5, 3, 4), (0, 7, 0), (9, 0, None), (12, 40, 2), (3, 2, None)], seed=2)
    _check_plain(p, prefill_attention(**p, block_q=4, block_k=16))


def test_matches_sdpa():
    """torch's scaled_dot_product_attention with the offset causal mask written out."""
    T, L, H, Hkv, D = 77, 45, 8, 2, 16
    p = _problem([(T, L, 1)], H=H, Hkv=Hkv, D=D, seed=3)
    out = prefill_attention(**p, block_q=32, block_k=48)
    keys = p["k_cache"][1, :L + T].transpose(0, 1)[None]  # (1, Hkv, L+T, D)
    vals = p["v_cache"][1, :L + T].transpose(0, 1)[None]
    visible = torch.arange(L + T)[None, :] <= (L + torch.arange(T))[:, None]
    ref = F.scaled_dot_product_attention(p["q"].transpose(0, 1)[None], keys, vals, attn_mask=visible,
                                         scale=p["scale"], enable_gqa=True)
    torch.testing.assert_close(out, ref[0].transpose(0, 1), rtol=0, atol=TOL)


def test_matches_decode_kernels_reference():
    """Rows of equal length packed: the decode kernels' reference over the same cache layout."""
    rows = [(6, 10, 3), (6, 0, 0), (6, 33, 1)]
    p = _problem(rows, seed=4)
    out = prefill_attention(**p, block_q=4, block_k=8)
    ref = attention_reference(p["q"].view(3, 6, *p["q"].shape[1:]), p["k_cache"], p["v_cache"], p["slots"],
                              p["cached"], p["scale"])
    torch.testing.assert_close(out, ref.reshape(out.shape), rtol=0, atol=TOL)


@pytest.mark.parametrize("cache_dtype", [F64, torch.bfloat16])
def test_new_keys_given_apart(cache_dtype):
    """k, v passed apart give what writing them into the cache first gives (in the cache's dtype)."""
    rows = [(20, 15, 2), (7, 0, 0), (4, 3, None)]
    p = _problem(rows, seed=5)
    p["k_cache"], p["v_cache"] = p["k_cache"].to(cache_dtype), p["v_cache"].to(cache_dtype)
    gen = torch.Generator().manual_seed(6)
    k = torch.randn(31, 2, 9, generator=gen, dtype=F64)
    v = torch.randn(31, 2, 9, generator=gen, dtype=F64)
    out = prefill_attention(**p, k=k, v=v, block_q=8, block_k=6)
    for i, (T, L, slot) in enumerate(rows):
        if slot is not None:
            s = int(p["cu_seqlens"][i])
            p["k_cache"][slot, L:L + T] = k[s:s + T].to(cache_dtype)
            p["v_cache"][slot, L:L + T] = v[s:s + T].to(cache_dtype)
    torch.testing.assert_close(out, prefill_attention(**p, block_q=8, block_k=6), rtol=0, atol=TOL)


def test_same_as_the_engines_prompt_path():
    """runtime.mixing.attention's prompt path (window + full softmax) on the same batch, fp64 inputs. That
    path takes its softmax in fp32 whatever the input dtype, hence the fp32-sized tolerance."""
    B, T, H, Hkv, D, max_len = 3, 11, 4, 2, 8, 64
    gen = torch.Generator().manual_seed(8)
    kv = KVCache(1, 4, max_len, Hkv, D, dtype=F64)
    kv.k.normal_(generator=gen), kv.v.normal_(generator=gen)
    slots, cached = torch.tensor([2, -1, 0], dtype=torch.int32), torch.tensor([5, 0, 30], dtype=torch.int32)
    q = torch.randn(B, T, H, D, generator=gen, dtype=F64)
    k, v = torch.randn(B, T, Hkv, D, generator=gen, dtype=F64), torch.randn(B, T, Hkv, D, generator=gen, dtype=F64)
    batch = ForwardBatch(phase="prefill", mode="kvbuffer", positions=cached.long()[:, None] + torch.arange(T),
                         slots=slots, state_slots=torch.full((B,), -1, dtype=torch.int32),
                         lengths=torch.zeros(B, dtype=torch.int32), cached=cached, flush_at=16)
    ref = attention(q, k, v, batch, SimpleNamespace(kv=kv), 0, D ** -0.5)  # writes k, v into the cache
    k_cache, v_cache = kv.layer(0)
    out = prefill_attention(q.reshape(B * T, H, D), k_cache, v_cache, torch.arange(B + 1, dtype=torch.int32) * T,
                            slots, cached, D ** -0.5, block_q=4, block_k=8)
    torch.testing.assert_close(out.view(B, T, H, D), ref, rtol=0, atol=1e-6)


def test_bf16_accumulates_in_fp32():
    p = _problem([(100, 60, 0), (37, 0, 1)], dtype=torch.bfloat16, seed=9)
    out = prefill_attention(**p, block_q=16, block_k=32)
    assert out.dtype == torch.bfloat16
    _check_plain(p, out, tol=2e-2)  # bf16 output rounding; an fp32-accumulated result is that close


def _bad(change):
    p = _problem([(5, 3, 0), (4, 0, 1)], seed=10)
    change(p)
    return p


BAD = {
    "heads_not_grouped": (lambda p: p.update(q=p["q"][:, :5]), ShapeError),
    "head_dim": (lambda p: p.update(q=p["q"][..., :8]), ShapeError),
    "v_cache_dtype": (lambda p: p.update(v_cache=p["v_cache"].float()), DTypeError),
    "cu_short": (lambda p: p.update(cu_seqlens=torch.tensor([0, 5, 8], dtype=torch.int32)), ShapeError),
    "slot_range": (lambda p: p.update(slots=torch.tensor([0, 9], dtype=torch.int32)), SlotError),
    "past_the_cache": (lambda p: p.update(cached=torch.tensor([0, 100], dtype=torch.int32)), ShapeError),
    "k_without_v": (lambda p: p.update(k=torch.zeros(9, 2, 9, dtype=F64)), ShapeError),
    "block_zero": (lambda p: p.update(block_k=0), ShapeError),
}


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
def test_bad_calls(bad):
    change, error = BAD[bad]
    with pytest.raises(error):
        prefill_attention(**_bad(change))
