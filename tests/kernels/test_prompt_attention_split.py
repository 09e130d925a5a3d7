"""The prompt attention's split form (kvbuffer.runtime.cudnn_prompt: cached part unmasked + new part causal,
merged by log-sum-exp) and flash_prompt's per-row dispatch, on the CPU against the tiled fp64 reference
(kvbuffer.reference.prefill_attention).

A plain fp64 softmax stands in for each cuDNN call (its causal mask top-left aligned, as cuDNN's), so the
split and the merge are checked exactly; the GPU test (tests/gpu/test_prompt_attention_gpu.py) runs cuDNN.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from kvbuffer.reference.prefill_attention import prefill_attention
from kvbuffer.runtime import cudnn_prompt, flash_prompt

F64 = torch.float64
TOL = 1e-12


def math_part(q, k, v, scale, causal):
    """One attention call in fp64: (o (B, T, H, D), lse (B, H, T)); causal aligned to the top left."""
    G = q.shape[2] // k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.repeat_interleave(G, 2).transpose(1, 2), v.repeat_interleave(G, 2).transpose(1, 2)
    scores = (qt @ kt.transpose(-1, -2)) * scale
    if causal:
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.arange(S)[None, :] > torch.arange(T)[:, None], float("-inf"))
    lse = scores.logsumexp(-1)
    return (torch.exp(scores - lse[..., None]) @ vt).transpose(1, 2).contiguous(), lse  # cuDNN: in q's layout


def bottom_right(q, k, v, scale):
    """FlashAttention-2's call in fp64: causal aligned to the bottom right."""
    T, L = q.shape[1], k.shape[1]
    o, _ = math_part(torch.cat([q.new_zeros(q.shape[0], L - T, *q.shape[2:]), q], 1), k, v, scale, True)
    return o[:, L - T:]


def _case(T, cached, H, Hkv, D, seed):
    gen = torch.Generator().manual_seed(seed)
    B = len(cached)
    positions = max(c or 0 for c in cached) + T + 3
    kc = torch.full((B + 2, positions, Hkv, D), float("nan"), dtype=F64)  # a read past a row's context shows
    vc = kc.clone()
    q, k, v = (torch.randn(B, T, h, D, generator=gen, dtype=F64) for h in (H, Hkv, Hkv))
    slots = [-1 if c is None else b + 1 for b, c in enumerate(cached)]
    starts = [c or 0 for c in cached]
    for b, (s, c) in enumerate(zip(slots, starts)):
        if s >= 0:
            kc[s, :c] = torch.randn(c, Hkv, D, generator=gen, dtype=F64)
            vc[s, :c] = torch.randn(c, Hkv, D, generator=gen, dtype=F64)
            kc[s, c:c + T], vc[s, c:c + T] = k[b], v[b]
    return q, k, v, kc, vc, slots, starts


def _reference(q, kc, vc, slots, starts, scale):
    B, T, H, D = q.shape
    cu = torch.arange(B + 1) * T
    return prefill_attention(q.reshape(B * T, H, D), kc, vc, cu, torch.tensor(slots), torch.tensor(starts),
                             scale).reshape(B, T, H, D)


SPLITS = {"piece_after_nothing": (9, 0), "one_token_after_one": (1, 1), "one_token_after_many": (1, 77), "two_after_two": (2, 2),
          "odd_after_odd": (63, 130), "piece_after_short": (65, 3), "longer_piece_than_prefix": (100, 9)}


@pytest.mark.parametrize("groups", [1, 3], ids=["mha", "gqa3"])
@pytest.mark.parametrize("case", SPLITS)
def test_split_matches_the_reference(case, groups):
    T, cached = SPLITS[case]
    H, Hkv, D = 2 * groups, 2, 24
    q, k, v, kc, vc, slots, starts = _case(T, [cached], H, Hkv, D, zlib.crc32(case.encode()))
    scale = D ** -0.5
    ref = _reference(q, kc, vc, slots, starts, scale)
    def part(q, k, v, scale, causal):
        assert k.shape[1] >= 1, "a call over no keys (cuDNN gives no output)"
        return math_part(q, k, v, scale, causal)

    out = cudnn_prompt.split_attention(q, kc[1:2, :cached + T], vc[1:2, :cached + T], cached, scale, part=part)
    torch.testing.assert_close(out, ref, rtol=0, atol=TOL)
    into = torch.full_like(q, float("nan"))
    assert cudnn_prompt.split_attention(q, kc[1:2, :cached + T], vc[1:2, :cached + T], cached, scale,
                                        part=part, out=into) is into
    torch.testing.assert_close(into, ref, rtol=0, atol=TOL)


def test_merge_of_equal_parts_and_of_a_dominant_part():
    gen = torch.Generator().manual_seed(3)
    o_a, o_b = (torch.randn(1, 5, 4, 8, generator=gen, dtype=F64) for _ in range(2))
    lse = torch.randn(1, 4, 5, generator=gen, dtype=F64)
    torch.testing.assert_close(cudnn_prompt.merge(o_a, lse, o_b, lse), (o_a + o_b) / 2, rtol=0, atol=TOL)
    torch.testing.assert_close(cudnn_prompt.merge(o_a, lse + 800, o_b, lse), o_a, rtol=0, atol=TOL)
    torch.testing.assert_close(cudnn_prompt.merge(o_a, lse, o_b, lse + 800), o_b, rtol=0, atol=TOL)


@pytest.mark.parametrize("T, cached, expected", [(1, 0, False), (1, 1, True), (5, 0, True), (5, 1, False),
                                                 (5, 2, True), (2048, 14336, True)])
def test_takes_only_calls_over_two_keys_or_more(T, cached, expected):
    assert cudnn_prompt.takes(T, cached) is expected


ROWS = {  # (T, cached per row; None = padding row)
    "fresh_batch": (7, [0, 0]),
    "fresh_one_token": (1, [0]),
    "after_prefix": (33, [50]),
    "mixed_rows": (9, [0, 1, None, 20]),
    "one_token_rows": (1, [4, 0, 1]),
}


@pytest.fixture
def cpu_backends(monkeypatch):
    """cuDNN's and FlashAttention-2's calls as fp64 math, counted per backend."""
    calls = {"cudnn": 0, "flash": 0}

    def part(q, k, v, scale, causal):
        calls["cudnn"] += 1
        assert k.shape[1] >= 2, "cuDNN gives no output over fewer than two keys (takes)"
        return math_part(q, k, v, scale, causal)

    def flash(q, k, v, scale):
        calls["flash"] += 1
        return bottom_right(q, k, v, scale)

    monkeypatch.setattr(cudnn_prompt, "cudnn_part", part)
    monkeypatch.setattr(cudnn_prompt, "cudnn_causal", lambda q, k, v, scale: part(q, k, v, scale, True)[0])
    monkeypatch.setattr(flash_prompt, "_flash", flash)
    return calls


@pytest.mark.parametrize("backend", flash_prompt.BACKENDS)
@pytest.mark.parametrize("case", ROWS)
def test_every_backend_matches_the_reference_row_by_row(case, backend, cpu_backends):
    T, cached = ROWS[case]
    q, k, v, kc, vc, slots, starts = _case(T, cached, 6, 2, 16, zlib.crc32(case.encode()))
    scale = 16 ** -0.5
    out = flash_prompt.flash_prompt_attention(q, k, v, kc, vc, slots, starts, scale, backend=backend)
    ref = _reference(q, kc, vc, slots, starts, scale)
    assert out.shape == q.shape and out.is_contiguous()
    for b, s in enumerate(slots):
        if s < 0:
            assert not out[b].any()
        else:
            torch.testing.assert_close(out[b], ref[b], rtol=0, atol=TOL)
    takes = [cudnn_prompt.takes(T, c) for s, c in zip(slots, starts) if s >= 0]
    if backend == "flash":
        assert cpu_backends["cudnn"] == 0
    else:  # cuDNN for every row it takes, FlashAttention-2 for the others
        assert (cpu_backends["cudnn"] > 0) == any(takes)
        assert (cpu_backends["flash"] > 0) == (not all(takes))


def test_on_the_cpu_the_choice_is_flash_and_a_bad_backend_is_refused():
    q = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    kc = torch.zeros(2, 8, 2, 8, dtype=torch.bfloat16)
    assert not cudnn_prompt.available(q, kc)
    assert flash_prompt.backend_for(q, kc) == "flash"
    with pytest.raises(ValueError, match="backend must be one of"):
        flash_prompt.flash_prompt_attention(q, q[:, :, :2], q[:, :, :2], kc, kc, [0], [0], 1.0, backend="sdpa")


def test_the_cudnn_probe_checks_its_numbers(monkeypatch, cpu_backends):
    """The probe that decides cuDNN's use compares both prompt forms with the reference: right math passes,
    a log-sum-exp in the wrong base (the merge's weights off) fails it."""
    assert cudnn_prompt._probe_error(torch.device("cpu"), torch.float32, 4, 2, 16) < 1e-5

    def log2_part(q, k, v, scale, causal):
        o, lse = math_part(q, k, v, scale, causal)
        return o, lse / math.log(2)

    monkeypatch.setattr(cudnn_prompt, "cudnn_part", log2_part)
    assert cudnn_prompt._probe_error(torch.device("cpu"), torch.float32, 4, 2, 16) > cudnn_prompt.PROBE_TOLERANCE
