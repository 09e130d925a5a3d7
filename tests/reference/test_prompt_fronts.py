"""The packed prompt fronts (gating.gdn_prompt_front, mamba2_prompt_front) give gdn_front's and mamba2_front's
values packed as the chunked prefill takes them: g, beta and Mamba-2's values bit for bit, the normalised q
and k to within one rounding of their dtype (the normaliser comes from vector_norm), with q and k adjacent in
one projection (the models' layout) or apart, any float dtype in and out; padding rows' q (GDN) and
values and decays (Mamba-2) are zero.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvbuffer.reference import gating

B, T, Hk, Hv, K, V = 3, 37, 2, 6, 24, 10
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def projection(gen, dtype, width):
    """(B, T, width) columns of one projection output, as the models' split views see them."""
    return (torch.randn(B, T, width + 5, generator=gen) * 3).to(dtype)[..., 2:2 + width]


def gdn_inputs(seed: int, dtype, adjacent: bool):
    gen = torch.Generator().manual_seed(seed)
    qkv = projection(gen, dtype, 2 * Hk * K + Hv * V)
    q, k = qkv[..., :Hk * K], qkv[..., Hk * K:2 * Hk * K]
    if not adjacent:
        k = projection(gen, dtype, Hk * K)
    ba = projection(gen, dtype, 2 * Hv)
    params = torch.randn(Hv, generator=gen), torch.rand(Hv, generator=gen) * 3.5 - 3
    return q.reshape(B, T, Hk, K), k.reshape(B, T, Hk, K), ba[..., Hv:], ba[..., :Hv], *params


@pytest.mark.parametrize("adjacent", [True, False], ids=["adjacent", "apart"])
@pytest.mark.parametrize("act", ["bf16", "fp32", "fp64"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp64"])
def test_gdn_prompt_front_is_gdn_front_packed(dtype, act, adjacent):
    q, k, a, b, A_log, dt_bias = gdn_inputs(zlib.crc32(f"{dtype}/{act}/{adjacent}".encode()), DTYPES[dtype], adjacent)
    assert (gating.adjacent_heads(q, k) is not None) == adjacent
    compute = torch.float64 if dtype == "fp64" else torch.float32
    got = gating.gdn_prompt_front(q, k, a, b, A_log, dt_bias, DTYPES[act], compute)
    qn, kn, g, beta = gating.gdn_front(q, k, a, b, A_log, dt_bias, torch.float64)
    rounding = max(torch.finfo(DTYPES[act]).eps, 8 * torch.finfo(compute).eps)
    for name, x, y in zip(("q", "k"), got, (qn, kn)):
        assert x.is_contiguous() and x.dtype == DTYPES[act] and x.shape == (B * T, Hk, K), name
        torch.testing.assert_close(x.double(), y.reshape(B * T, Hk, K), rtol=rounding, atol=1e-30, msg=name)
    _, _, g, beta = gating.gdn_front(q, k, a, b, A_log, dt_bias, compute)
    for name, x, y in zip(("g", "beta"), got[2:], (g, beta)):
        assert x.is_contiguous() and torch.equal(x, y.reshape(B * T, Hv)), name


def test_gdn_prompt_front_computes_in_a_narrower_dtype_too():
    q, k, a, b, A_log, dt_bias = gdn_inputs(4, torch.float64, adjacent=True)
    got = gating.gdn_prompt_front(q, k, a, b, A_log, dt_bias, torch.float32, torch.float32)
    qn, kn, _, _ = gating.gdn_front(q, k, a, b, A_log, dt_bias, torch.float64)
    for x, y in zip(got, (qn, kn)):
        torch.testing.assert_close(x.double(), y.reshape(x.shape), rtol=1e-6, atol=1e-30)


def test_gdn_prompt_front_zeroes_the_q_of_padding_rows():
    q, k, a, b, A_log, dt_bias = gdn_inputs(3, torch.bfloat16, adjacent=True)
    real = torch.tensor([True, False, True])
    masked = gating.gdn_prompt_front(q, k, a, b, A_log, dt_bias, torch.bfloat16, real=real)
    plain = gating.gdn_prompt_front(q, k, a, b, A_log, dt_bias, torch.bfloat16)
    rows = real.repeat_interleave(T)
    assert torch.equal(masked[0][~rows], torch.zeros_like(masked[0][~rows]))
    assert torch.equal(masked[0][rows], plain[0][rows])
    for x, y in zip(masked[1:], plain[1:]):
        assert torch.equal(x, y)


def test_adjacent_heads_needs_one_projection_layout():
    q, k = gdn_inputs(0, torch.float32, adjacent=True)[:2]
    pair = gating.adjacent_heads(q, k)
    assert torch.equal(pair[..., :Hk, :], q) and torch.equal(pair[..., Hk:, :], k)
    assert gating.adjacent_heads(k, q) is None  # k's heads come after q's, not before
    assert gating.adjacent_heads(q, k.to(torch.float64)) is None
    assert gating.adjacent_heads(q.contiguous(), k) is None


@pytest.mark.parametrize("act", ["bf16", "fp32", "fp64"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp64"])
def test_mamba2_prompt_front_is_mamba2_front_packed(dtype, act):
    gen = torch.Generator().manual_seed(7)
    xdt = projection(gen, DTYPES[dtype], Hv * V + Hv)
    x, dt = xdt[..., :Hv * V].reshape(B, T, Hv, V), xdt[..., Hv * V:]
    A_log, dt_bias = torch.randn(Hv, generator=gen), torch.rand(Hv, generator=gen) * 3.5 - 3
    compute = torch.float64 if dtype == "fp64" else torch.float32
    value, g = gating.mamba2_prompt_front(x, dt, A_log, dt_bias, DTYPES[act], compute)
    want_value, want_g, _ = gating.mamba2_front(x, dt, A_log, dt_bias, compute)
    assert value.is_contiguous() and value.dtype == DTYPES[act] and g.dtype == compute
    assert torch.equal(value, want_value.reshape(B * T, Hv, V).to(DTYPES[act]))
    assert torch.equal(g, want_g.reshape(B * T, Hv))


def test_mamba2_prompt_front_zeroes_the_values_and_decays_of_padding_rows():
    gen = torch.Generator().manual_seed(9)
    x, dt = torch.randn(B, T, Hv, V, generator=gen), torch.randn(B, T, Hv, generator=gen)
    A_log, dt_bias = torch.randn(Hv, generator=gen), torch.randn(Hv, generator=gen)
    real = torch.tensor([False, True, True])
    value, g = gating.mamba2_prompt_front(x, dt, A_log, dt_bias, torch.bfloat16, real=real)
    want_value, want_g = gating.mamba2_prompt_front(x, dt, A_log, dt_bias, torch.bfloat16)
    rows = real.repeat_interleave(T)
    assert not value[~rows].any() and not g[~rows].any()
    assert torch.equal(value[rows], want_value[rows]) and torch.equal(g[rows], want_g[rows])


def test_prompt_fronts_refuse_integer_inputs():
    q, k, a, b, A_log, dt_bias = gdn_inputs(1, torch.float32, adjacent=True)
    with pytest.raises(TypeError, match="a"):
        gating.gdn_prompt_front(q, k, a.long(), b, A_log, dt_bias, torch.bfloat16)
    with pytest.raises(TypeError, match="dt"):
        gating.mamba2_prompt_front(q, a.long(), A_log, dt_bias, torch.bfloat16)
