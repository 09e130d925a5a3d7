"""The prompt path's leaner elementwise forms give the bits of the plain formulas they replace: the gated
norm's product rounded as it is stored (no fp32 copy of it), rotary embedding written into the norm's own
output (no copy of the channels that pass through)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbuffer.models.layers import GatedRMSNorm, apply_rotary, rms_normalize, rotary_cos_sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gated_norm_matches_the_plain_formula_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = GatedRMSNorm(40, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(40, generator=gen).to(dtype))
    x = torch.randn(2, 7, 3, 40, generator=gen).to(dtype)
    gate = torch.randn(2, 7, 3 * 40 + 5, generator=gen).to(dtype)[..., 5:].view(2, 7, 3, 40)  # strided, as a split
    h = norm.weight * rms_normalize(x, 1e-6)
    want = (h * F.silu(gate.float())).to(dtype)
    got = norm(x, gate)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("rotary_dim", [16, 64], ids=["partial", "whole"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rotary_in_place_gives_the_same_bits_and_the_same_tensor(rotary_dim, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 4, 64, generator=gen).to(dtype)
    cos, sin = rotary_cos_sin(torch.arange(18).view(2, 9) + 100, rotary_dim, 10000.0, dtype)
    want = apply_rotary(x, cos, sin)
    mine = x.clone()
    got = apply_rotary(mine, cos, sin, in_place=True)
    assert torch.equal(got, want)
    if rotary_dim < 64:
        assert got is mine
