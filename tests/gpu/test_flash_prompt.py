"""A prompt's attention on FlashAttention-2 (kvbuffer.runtime.flash_prompt, backend "flash") against the tiled
fp64 reference (kvbuffer.reference.prefill_attention), on a CUDA GPU; every backend:
tests/gpu/test_prompt_attention_gpu.py.

Grouped heads as the models have them (Qwen3.5: 16 query heads over 4 KV heads, head dim 256; Nemotron-3:
32 over 2, dim 128), fresh prompts and prompts after a cached prefix of awkward lengths, a padding row,
one-token prompts. The engine path is checked too: a prompt fed in pieces attends over its cached pieces.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvbuffer.reference.prefill_attention import prefill_attention
from kvbuffer.runtime import flash_prompt

pytestmark = [pytest.mark.gpu]

TOL = 2e-2  # bf16 inputs and output, fp32 accumulation: relative error of the output
SHAPES = {"qwen35": (16, 4, 256), "nemotron3": (32, 2, 128)}
CASES = {  # (T, cached per row; None = padding row)
    "fresh_one": (1, [0]),
    "fresh_batch": (77, [0, 0, 0]),
    "fresh_long": (4099, [0]),
    "after_prefix": (129, [1000]),
    "mixed_rows": (64, [0, 63, None, 2049]),
    "one_token_after": (1, [5000, 1]),
}


def _rel(x, y):
    return float((x.double() - y.double()).norm() / y.double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_the_fp64_reference(shape, case):
    H, Hkv, D = SHAPES[shape]
    T, cached = CASES[case]
    B, g = len(cached), torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{shape}/{case}".encode()))
    max_len = max(c or 0 for c in cached) + T + 16
    rn = lambda *s: torch.randn(*s, generator=g, device="cuda").bfloat16()  # noqa: E731
    kc, vc = rn(B + 2, max_len, Hkv, D), rn(B + 2, max_len, Hkv, D)
    q, k, v = rn(B, T, H, D), rn(B, T, Hkv, D), rn(B, T, Hkv, D)
    slots = [-1 if c is None else b + 1 for b, c in enumerate(cached)]
    starts = [c or 0 for c in cached]
    for b, (s, c) in enumerate(zip(slots, starts)):  # the caller writes the new tokens first
        if s >= 0:
            kc[s, c:c + T], vc[s, c:c + T] = k[b], v[b]
    scale = D ** -0.5
    assert flash_prompt.fits(q, kc)
    out = flash_prompt.flash_prompt_attention(q, k, v, kc, vc, slots, starts, scale, backend="flash")
    dev = lambda xs: torch.tensor(xs, device="cuda")  # noqa: E731
    ref = prefill_attention(q.double().reshape(B * T, H, D), kc.double(), vc.double(), dev([0] + [T] * B).cumsum(0),
                            dev(slots), dev(starts), scale).reshape(B, T, H, D)
    assert out.shape == q.shape and out.dtype == q.dtype
    for b, s in enumerate(slots):
        if s < 0:
            assert not out[b].any()
        else:
            assert _rel(out[b], ref[b]) < TOL, (b, _rel(out[b], ref[b]))


def test_fits_only_half_precision_on_cuda():
    q = torch.zeros(1, 2, 4, 64, device="cuda", dtype=torch.bfloat16)
    kc = torch.zeros(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert flash_prompt.fits(q, kc)
    assert not flash_prompt.fits(q.float(), kc.float())
    assert not flash_prompt.fits(q, kc.half())
    assert not flash_prompt.fits(q.cpu(), kc.cpu())
    assert not flash_prompt.fits(torch.zeros(1, 2, 3, 64, device="cuda", dtype=torch.bfloat16), kc)
