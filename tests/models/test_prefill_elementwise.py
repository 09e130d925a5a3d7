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


# the prompt's fused regions (kvbuffer.models.fused), compiled here on the CPU, against the layers' eager code:
# the same math, so within a few roundings of bf16 (8 significant bits): a region may keep in fp32 an
# intermediate the eager code rounds, and the gated norm rounds twice
BF16_TOL = 2 ** -5


def _close(got, want, dtype):
    tol = BF16_TOL if dtype == torch.bfloat16 else 1e-5
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_fused_regions_match_the_eager_layers(dtype=torch.bfloat16):
    """In bf16, as they run on the GPU (the fp32 math is checked to 1e-4 by the engine test below)."""
    from kvbuffer.models import fused
    from kvbuffer.models.layers import RMSNorm
    from kvbuffer.models.nemotron_h import GroupedGatedRMSNorm, _relu2

    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(48, 1e-6, zero_centered=True).to(dtype)
    gated = GatedRMSNorm(32, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(48, generator=gen).to(dtype))
        gated.weight.add_(0.3 * torch.randn(32, generator=gen).to(dtype))
    for T in (7, 33):  # one compilation serves every token count (the token dim is dynamic)
        x = torch.randn(2, T, 48, generator=gen).to(dtype)
        y = torch.randn(2, T, 48, generator=gen).to(dtype)
        _close(fused.rms_norm(x, norm.scale(), norm.eps), norm(x), dtype)
        s, h = fused.add_rms_norm(x, y, norm.scale(), norm.eps)
        assert torch.equal(s, x + y)
        _close(h, norm(x + y), dtype)
        packed = torch.randn(2, T, 2 * 40, generator=gen).to(dtype)
        gate, up = packed.split(40, dim=-1)  # strided views, as the packed GEMM's split gives
        _close(fused.silu_mul(gate, up), F.silu(gate) * up, dtype)
        o = torch.randn(2, T, 3, 32, generator=gen)  # the recurrence's fp32 output
        z = torch.randn(2, T, 3 * 32 + 8, generator=gen).to(dtype)[..., 8:].view(2, T, 3, 32)
        _close(fused.gated_norm(o, z, gated.weight, gated.eps, dtype), gated(o.to(dtype), z), dtype)
        heads = torch.randn(2, T, 3, 2 * 48, generator=gen).to(dtype)[..., :48]  # q beside its gate, as split
        for r in (16, 48):  # partial and whole rotary
            cos, sin = rotary_cos_sin(torch.arange(2 * T).view(2, T) + 5, r, 10000.0, dtype)
            _close(fused.norm_rope(heads, norm.scale(), norm.eps, cos, sin),
                   apply_rotary(norm(heads), cos, sin), dtype)
        o, gate = heads.contiguous(), torch.randn(2, T, 3, 2 * 48, generator=gen).to(dtype)[..., 48:]
        _close(fused.sigmoid_mul(o, gate), o * torch.sigmoid(gate), dtype)
        grouped = GroupedGatedRMSNorm(64, 16, 1e-5).to(dtype)
        with torch.no_grad():
            grouped.weight.add_(0.3 * torch.randn(64, generator=gen).to(dtype))
        y = torch.randn(2, T, 64, generator=gen).to(dtype)
        gate = torch.randn(2, T, 64 + 24, generator=gen).to(dtype)[..., 24:]  # strided, as the projection's split
        _close(fused.grouped_gated_norm(y.view(2, T, 4, 16), gate, grouped.weight, grouped.eps), grouped(y, gate),
               dtype)
        _close(fused.activation(_relu2, gate), _relu2(gate), dtype)
        _check_moe_combine(fused, 2 * T, gen, dtype)


def _check_moe_combine(fused, N: int, gen, dtype, E: int = 5, k: int = 3, H: int = 24):
    """The routed experts' sum, in fp32 (Nemotron-H's weights) and in the model's dtype (Qwen's), against
    route_to_experts' eager combine (rows put back in token order, weighted, summed)."""
    top_idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    order = torch.sort(top_idx.reshape(-1), stable=True)[1]
    y = torch.randn(N * k, H, generator=gen).to(dtype)  # the experts' rows in sorted order
    for acc in (torch.float32, dtype):
        top_w = torch.rand(N, k, generator=gen).to(acc)
        unsorted = y.new_empty(y.shape).index_copy_(0, order, y).view(N, k, H)
        _close(fused.moe_combine(y, order, top_w, acc), (unsorted * top_w[..., None]).sum(1, dtype=acc).to(dtype),
               dtype)


def test_the_gdn_front_region_gives_the_eager_front_and_v_packed():
    """kvbuffer.runtime.regions.gdn_front_region (compiled here on the CPU) against the eager packed front:
    q, k within bf16 rounding, g and beta to fp32 rounding, v copied bit for bit, every output dense; a
    padding row's q zero. None (the caller runs the eager front) where q and k are not side by side in
    memory, or where several rows cut short of their projection would need a copy to flatten."""
    from kvbuffer.reference import gating
    from kvbuffer.runtime import regions

    gen = torch.Generator().manual_seed(11)
    B, T, Hk, Hv, K, V = 3, 37, 2, 6, 24, 10
    width = 2 * Hk * K + Hv * V
    qkv = (torch.randn(B, T, width + 2 * Hv + 5, generator=gen) * 3).to(torch.bfloat16)[..., 3:3 + width + 2 * Hv]
    q, k, v = (qkv[..., i:j] for i, j in ((0, Hk * K), (Hk * K, 2 * Hk * K), (2 * Hk * K, width)))
    q, k, v = q.reshape(B, T, Hk, K), k.reshape(B, T, Hk, K), v.reshape(B, T, Hv, V)
    b, a = qkv[..., width:width + Hv], qkv[..., width + Hv:]
    A_log, dt_bias = torch.randn(Hv, generator=gen), torch.rand(Hv, generator=gen) * 3.5 - 3
    real = torch.tensor([True, False, True])
    got = regions.gdn_front_region(q, k, v, a, b, A_log, dt_bias, torch.bfloat16, torch.float32, real)
    want = gating.gdn_prompt_front(q, k, a, b, A_log, dt_bias, torch.bfloat16, torch.float32, real)
    want = (*want[:2], v.reshape(B * T, Hv, V), *want[2:])
    for name, x, y in zip(("q", "k", "v", "g", "beta"), got, want):
        assert x.is_contiguous() and x.dtype == y.dtype and x.shape == y.shape, name
        tol = BF16_TOL if name in "qk" else 1e-6
        torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol if name in "qk" else 1e-30, msg=name)
    assert torch.equal(got[2], want[2])
    pad = ~real.repeat_interleave(T)
    assert torch.equal(got[0][pad], torch.zeros_like(got[0][pad]))
    apart = k.clone()
    assert regions.gdn_front_region(q, apart, v, a, b, A_log, dt_bias, torch.bfloat16, torch.float32, real) is None
    cut = [t[:, :T - 5] for t in (q, k, v, a, b)]
    assert regions.gdn_front_region(*cut, A_log, dt_bias, torch.bfloat16, torch.float32, real) is None
    assert regions.gdn_front_region(*(t[:1] for t in cut), A_log, dt_bias, torch.bfloat16, torch.float32,
                                    real[:1]) is not None  # one row: any cut flattens


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_a_prompt_with_fused_regions_gives_the_eager_tokens(kind, monkeypatch, capfd):
    """A whole engine with fuse_prompts forced on (the engine sets it on CUDA only): the prompts' logits
    within rounding of the unfused engine's, the same greedy tokens, the family's regions compiled (the
    Nemotron-H model with a routed-experts layer)."""
    from kvbuffer import LLM
    from kvbuffer.models import fused
    from kvbuffer.models.nemotron_h import _relu2
    from kvbuffer.runtime import regions
    from tests.support.tiny_models import tiny_model

    from kvbuffer.engine.graphs import PREFILL_GRAPH_TOKENS

    # a short prompt runs as its graph would (unfused), one too long to graph fuses
    prompts = [[(7 * i + 3) % 97 for i in range(n)] for n in (5, PREFILL_GRAPH_TOKENS + 45)]
    shape = {"nemotron_h": {"layers_block_type": ["mamba", "moe", "attention", "mamba", "mlp"]}}.get(kind, {})
    plain = LLM(tiny_model(kind, seed=3, **shape), device="cpu", max_len=PREFILL_GRAPH_TOKENS + 64)
    want = plain.generate(prompts, max_new_tokens=6, return_logits=True)
    fused_llm = LLM(tiny_model(kind, seed=3, **shape), device="cpu", max_len=PREFILL_GRAPH_TOKENS + 64)
    monkeypatch.setattr(fused_llm.runner, "fuse_prompts", True)
    monkeypatch.setattr(regions, "_COMPILED", {})
    got = fused_llm.generate(prompts, max_new_tokens=6, return_logits=True)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.stack(g.logits), torch.stack(w.logits), rtol=1e-4, atol=1e-4)
    compiled = {"qwen3_5": (fused._rms_norm, fused._add_rms_norm, fused._silu_mul, fused._gated_norm,
                           fused._norm_rope, fused._sigmoid_mul),
               "nemotron_h": (fused._grouped_gated_norm, fused._moe_combine, _relu2)}[kind]
    assert set(regions._COMPILED) == set(compiled) and all(regions._COMPILED.values())
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("kvbuffer: compiling")]
    assert len(said) == 1 and said[0].startswith("kvbuffer: compiling the prompt's fused regions"), said


def test_a_region_that_fails_to_compile_runs_eagerly_with_one_warning(monkeypatch, caplog):
    """No working Triton (say): the compilation's error turns the region eager for good, said once; an error
    of another kind (out of memory) is not taken for a compile failure."""
    from torch._dynamo.exc import TorchDynamoException

    from kvbuffer.models import fused
    from kvbuffer.runtime import regions

    class CompileFailed(TorchDynamoException):  # what Dynamo wraps a backend's failure in
        pass

    def broken(fn, **kw):
        def run(*args):
            raise CompileFailed("Cannot find a working triton installation")
        return run

    monkeypatch.setattr(regions, "_COMPILED", {})
    monkeypatch.setattr(regions.torch, "compile", broken)
    gate, up = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    with caplog.at_level("WARNING", logger="kvbuffer"):
        for _ in range(2):
            assert torch.equal(fused.silu_mul(gate, up), F.silu(gate) * up)
    assert regions._COMPILED[fused._silu_mul] is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "silu_mul failed to compile" in said[0] and "triton" in said[0], said
    monkeypatch.setattr(regions, "_COMPILED", {})
    monkeypatch.setattr(regions.torch, "compile", lambda fn, **kw: lambda *a: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(MemoryError):
        fused.silu_mul(gate, up)
