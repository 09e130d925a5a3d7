"""A prompt's attention on every backend (kvbuffer.runtime.flash_prompt: cuDNN's fused attention, its split
form after a cached prefix, FlashAttention-2) against the tiled fp64 reference
(kvbuffer.reference.prefill_attention), on a CUDA GPU.

Grouped heads as the models have them (Qwen3.5: 16 query heads over 4 KV heads, head dim 256; Nemotron-3:
32 over 2, dim 128), fresh prompts and pieces after cached prefixes of awkward lengths, padding rows, one
token after one cached position. cuDNN's own parts are checked too: its log-sum-exp is the natural log's;
and where FlashAttention-2 applies at all (`flash_prompt.fits`).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvbuffer.reference.prefill_attention import prefill_attention
from kvbuffer.runtime import cudnn_prompt, flash_prompt

pytestmark = [pytest.mark.gpu]

TOL = 2e-2  # bf16 inputs and output, fp32 accumulation: relative error of the output
SHAPES = {"qwen35": (16, 4, 256), "nemotron3": (32, 2, 128)}
CASES = {  # (T, cached per row; None = padding row)
    "fresh_one_token": (1, [0]),
    "fresh_batch": (77, [0, 0, 0]),
    "fresh_long": (4099, [0]),
    "piece_after_prefix": (2048, [6144]),
    "odd_piece_after_odd_prefix": (129, [1001]),
    "odd_piece_after_even_prefix": (129, [1000]),
    "mixed_rows": (64, [0, 63, None, 2049]),
    "after_one_position": (65, [1, 2]),
    "one_token_after": (1, [5000, 1]),
}


def _rel(x, y):
    return float((x.double() - y.double()).norm() / y.double().norm().clamp(min=1e-30))


def _problem(shape, case):
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
    return q, k, v, kc, vc, slots, starts, D ** -0.5


@pytest.mark.parametrize("backend", flash_prompt.BACKENDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_backend_matches_the_fp64_reference(shape, case, backend):
    q, k, v, kc, vc, slots, starts, scale = _problem(shape, case)
    if backend == "cudnn" and not cudnn_prompt.available(q, kc):
        pytest.skip("torch's gate refuses cuDNN attention for this dtype and head shape on this GPU")
    if backend == "flash":
        assert flash_prompt.fits(q, kc)
    B, T, H, D = q.shape
    out = flash_prompt.flash_prompt_attention(q, k, v, kc, vc, slots, starts, scale, backend=backend)
    dev = lambda xs: torch.tensor(xs, device="cuda")  # noqa: E731
    ref = prefill_attention(q.double().reshape(B * T, H, D), kc.double(), vc.double(), dev([0] + [T] * B).cumsum(0),
                            dev(slots), dev(starts), scale).reshape(B, T, H, D)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    for b, s in enumerate(slots):
        if s < 0:
            assert not out[b].any()
        else:
            assert _rel(out[b], ref[b]) < TOL, (b, _rel(out[b], ref[b]))


@pytest.mark.parametrize("causal", [False, True], ids=["unmasked", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_cudnn_part_gives_the_natural_log_sum_exp(shape, causal):
    H, Hkv, D = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(7)
    T, S = (300, 300) if causal else (130, 517)
    q = torch.randn(1, T, H, D, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(1, S, Hkv, D, generator=g, device="cuda").bfloat16() for _ in range(2))
    if not cudnn_prompt.available(q, k):
        pytest.skip("torch's gate refuses cuDNN attention for this dtype and head shape on this GPU")
    o, lse = cudnn_prompt.cudnn_part(q, k, v, D ** -0.5, causal)
    G = H // Hkv
    scores = torch.einsum("thd,shd->hts", q[0].double(), k[0].double().repeat_interleave(G, 1)) * D ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    ref_lse = scores.logsumexp(-1)
    ref_o = torch.einsum("hts,shd->thd", scores.softmax(-1), v[0].double().repeat_interleave(G, 1))
    assert lse.shape == (1, H, T) and lse.dtype == torch.float32
    torch.testing.assert_close(lse[0].double(), ref_lse, rtol=0, atol=2e-2)
    assert _rel(o[0], ref_o) < TOL


def test_hopper_chooses_cudnn_at_the_models_head_shapes():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cuDNN's head dim 256 path is taken on Hopper (SM 9.0)")
    for H, Hkv, D in SHAPES.values():
        q = torch.empty(1, 4, H, D, device="cuda", dtype=torch.bfloat16)
        kc = torch.empty(1, 8, Hkv, D, device="cuda", dtype=torch.bfloat16)
        assert flash_prompt.backend_for(q, kc) == "cudnn", (H, Hkv, D, torch.backends.cudnn.version())


def test_flash_fits_only_half_precision_on_cuda():
    q = torch.zeros(1, 2, 4, 64, device="cuda", dtype=torch.bfloat16)
    kc = torch.zeros(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert flash_prompt.fits(q, kc)
    assert not flash_prompt.fits(q.float(), kc.float())
    assert not flash_prompt.fits(q, kc.half())
    assert not flash_prompt.fits(q.cpu(), kc.cpu())
    assert not flash_prompt.fits(torch.zeros(1, 2, 3, 64, device="cuda", dtype=torch.bfloat16), kc)
