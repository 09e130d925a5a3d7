"""Batched sampling on the logits' device (kvbuffer/engine/sampling.py): the filters against a plain
per-row implementation, the exponential race against the distribution it draws from, and seeded rows
that do not depend on the rest of their batch."""

import pytest
import torch

from kvbuffer.engine.sampling import (SamplingParams, draw, filtered_probs, filtered_rows, sample_rows,
                                      seeded_generator)


def _one_row(logits, p):
    """Temperature, then top-k, then top-p, one row at a time (the definition the batch must follow)."""
    x = logits.double() / p.temperature
    if p.top_k:
        kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, 0)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= p.top_p
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
          SamplingParams(temperature=1.3, top_p=0.5), SamplingParams(temperature=0.5, top_k=7, top_p=0.9),
          SamplingParams(temperature=2.0, top_k=500), SamplingParams(temperature=1.0, top_p=0.01)]


def test_batched_filters_match_each_row_alone():
    gen = torch.Generator().manual_seed(0)
    for V in (5, 37, 1000):
        logits = 3 * torch.randn(len(PARAMS), V, generator=gen)
        got = filtered_rows(logits, PARAMS)
        for row, p, want in zip(logits, PARAMS, got):
            assert torch.allclose(want.double(), _one_row(row, p), atol=1e-6), (V, p)
            assert torch.allclose(filtered_probs(row, p), want)
        assert torch.allclose(got.sum(-1), torch.ones(len(PARAMS)))


@pytest.mark.parametrize("scale, top_p", [(0.5, 0.95), (2.0, 0.8)])
def test_top_p_cut_of_a_flat_large_vocabulary_follows_the_definition(scale, top_p):
    """A Qwen3.5-sized vocabulary with flat logits: ~200k tokens in the nucleus, the smallest near the
    cut ~4e-6. The kept tokens are exactly the fp64 definition's (an fp32 running sum, or the fp32
    softmax's normalisation, moved the cut by a token in some rows), the probabilities within 1e-5."""
    gen = torch.Generator().manual_seed(int(10 * scale))
    logits = scale * torch.randn(8, 248_320, generator=gen)
    params = [SamplingParams(temperature=1.0, top_p=top_p)] * len(logits)
    got = filtered_rows(logits, params)
    for row, p, have in zip(logits, params, got):
        want = _one_row(row, p)
        assert torch.equal(have > 0, want > 0)
        assert torch.allclose(have.double(), want, rtol=1e-5, atol=1e-12)


def test_many_rows_are_filtered_in_passes_with_the_same_result(monkeypatch):
    from kvbuffer.engine import sampling

    logits = 3 * torch.randn(len(PARAMS) * 3, 40, generator=torch.Generator().manual_seed(1))
    params = PARAMS * 3
    whole = filtered_rows(logits, params)
    monkeypatch.setattr(sampling, "ROWS_PER_PASS", 4)
    assert torch.equal(filtered_rows(logits, params), whole)


def test_filters_reject_greedy_rows_and_mismatched_lengths():
    with pytest.raises(ValueError, match="greedy"):
        filtered_rows(torch.zeros(1, 4), [SamplingParams()])
    with pytest.raises(ValueError, match="2 sampling params for 1 rows"):
        filtered_rows(torch.zeros(1, 4), PARAMS[:2])
    with pytest.raises(ValueError, match="1 generators for 2 rows"):
        draw(torch.ones(2, 4) / 4, [None])


def test_the_exponential_race_draws_each_index_with_its_probability():
    probs = torch.tensor([0.5, 0.25, 0.0, 0.125, 0.0625, 0.0625, 0.0, 0.0])
    n = 40_000
    torch.manual_seed(1)
    counts = torch.bincount(draw(probs.expand(n, -1), [None] * n), minlength=8).double()
    sigma = (n * probs * (1 - probs)).sqrt()
    assert (counts[probs == 0] == 0).all()
    assert ((counts - n * probs).abs() <= 5 * sigma + 1e-9).all(), counts
    g = seeded_generator(5, "cpu")  # seeded rows alike
    seeded = torch.stack([draw(probs[None], [g])[0] for _ in range(4000)])
    assert abs(float((seeded == 0).double().mean()) - 0.5) < 0.04 and not (seeded == 2).any()


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_step():
    gen = torch.Generator().manual_seed(2)
    logits = 2 * torch.randn(5, 300, generator=gen)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=11), SamplingParams(), PARAMS[1], PARAMS[2],
              SamplingParams(temperature=1.0, seed=3)]

    def tokens(rows, steps=6):
        gens = [seeded_generator(params[i].seed, "cpu") for i in rows]
        return [sample_rows(logits[rows], [params[i] for i in rows], gens) for _ in range(steps)]

    alone = [t[0] for t in tokens([0])]
    assert [t[0] for t in tokens([0, 1, 2, 3, 4])] == alone
    assert [t[1] for t in tokens([2, 0])] == alone
    assert len(set(alone)) > 1  # it samples: six draws from a spread distribution are not all equal
    greedy = torch.argmax(logits[1]).item()
    assert all(t[1] == greedy for t in tokens([0, 1, 2]))
    assert seeded_generator(None, "cpu") is None


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
def test_a_row_without_a_distribution_is_a_clear_error_not_token_0(temperature):
    from kvbuffer.engine.graphs import StepInputs
    from kvbuffer.engine.sampling import NO_TOKEN, check_drawn, pick_rows

    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(5))
    logits[1] = float("nan")
    logits[2] = float("-inf")
    logits[3, 7] = float("inf")
    logits[4, 3] = float("nan")  # one NaN is enough: the argmax of a row with a NaN is that NaN's index
    params = [SamplingParams(temperature=temperature)] * 5
    picks = pick_rows(logits, params, [None] * 5)
    assert picks[1:].tolist() == [NO_TOKEN] * 4 and 0 <= picks[0] < 20
    with pytest.raises(RuntimeError, match="sampling: row 1: the logits are NaN or infinite"):
        sample_rows(logits, params, [None] * 5)
    with pytest.raises(RuntimeError, match="sampling: request 7: "):
        check_drawn(picks.tolist(), ["request 6", "request 7", "request 8", "request 9", "request 10"])
    inputs = StepInputs(5, torch.device("cpu"))
    inputs.hold(picks)
    assert inputs.picked[:5].min() >= 0  # the next step is never fed an id outside the vocabulary


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_sampling_does_not_follow_the_default_dtype(dtype):
    from kvbuffer.engine.acceptance import accept_sampled

    logits = torch.randn(2, 3, 30, generator=torch.Generator().manual_seed(6))
    hot = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, seed=1)]
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        gens = [None, seeded_generator(1, "cpu")]
        assert len(sample_rows(logits[:, 0], hot, gens)) == 2
        kept, nxt = accept_sampled(logits, [[1, 2], [3, None]], hot, gens)
        assert all(0 <= m <= 2 for m in kept) and all(0 <= t < 30 for t in nxt)
    finally:
        torch.set_default_dtype(before)


def test_a_wide_verify_is_filtered_in_passes_with_the_same_outcome(monkeypatch):
    from kvbuffer.engine import acceptance, sampling

    logits = torch.randn(6, 4, 50, generator=torch.Generator().manual_seed(7))
    drafts = [[1, 2, 3], [4, None, 5], [6, 7, 8], [9, 9, 9], [0, 1, 2], [3, 4, None]]
    params = [SamplingParams(temperature=1.0, top_p=0.8, seed=i) for i in range(6)]

    def run():
        return acceptance.accept_sampled(logits, drafts, params, [seeded_generator(i, "cpu") for i in range(6)])

    whole = run()
    monkeypatch.setattr(sampling, "ROWS_PER_PASS", 4)
    monkeypatch.setattr(acceptance, "ROWS_PER_PASS", 4)
    assert run() == whole
