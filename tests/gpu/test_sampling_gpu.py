"""Sampling on the GPU: the batched filters and the exponential race on CUDA tensors with CUDA generators,
and the engine's seeded sampled requests (greedy, sampled and speculative rows in one batch)."""

import pytest
import torch

from kvbuffer import LLM, demo_checkpoint
from kvbuffer.engine.sampling import SamplingParams, draw, filtered_rows, sample_rows, seeded_generator

pytestmark = pytest.mark.gpu

DEMO = str(demo_checkpoint())


def test_filters_and_draws_on_the_gpu_follow_the_cpu():
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.3, top_p=0.5),
              SamplingParams(temperature=0.5, top_k=50, top_p=0.9)]
    logits = 3 * torch.randn(3, 4096, generator=gen)
    assert torch.allclose(filtered_rows(logits.cuda(), params).cpu(), filtered_rows(logits, params), atol=1e-6)
    probs = torch.tensor([0.5, 0.25, 0.0, 0.25], device="cuda")
    n = 40_000
    counts = torch.bincount(draw(probs.expand(n, -1), [None] * n), minlength=4).double().cpu()
    want = n * probs.cpu().double()
    assert counts[2] == 0 and ((counts - want).abs() <= 5 * (want * (1 - probs.cpu())).sqrt() + 1e-9).all()
    rows = [0, 1]
    once = sample_rows(logits.cuda()[rows], [params[i] for i in rows], [seeded_generator(9, "cuda"), None])[0]
    again = sample_rows(logits.cuda()[:1], params[:1], [seeded_generator(9, "cuda")])[0]
    assert once == again


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_draft_tokens": 3}])
def test_seeded_sampled_requests_repeat_beside_greedy_ones(speculative):
    llm = LLM(DEMO, device="cuda", speculative=speculative)
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7, 5, 6, 7]]

    def run():
        rids = [llm.add_request(prompts[0], SamplingParams(12, stop_token_ids=())),
                llm.add_request(prompts[1], SamplingParams(12, temperature=1.0, top_p=0.9, seed=4, stop_token_ids=())),
                llm.add_request(prompts[2], SamplingParams(12, temperature=0.8, seed=5, stop_token_ids=()))]
        got = {rid: [] for rid in rids}
        while llm.has_work():
            for out in llm.step():
                got[out.rid] += out.token_ids
        return [got[r] for r in rids]

    first, second = run(), run()
    assert first == second and all(len(t) == 12 for t in first)
    greedy = LLM(DEMO, device="cuda").generate([prompts[0]], max_new_tokens=12, stop_token_ids=[])[0].token_ids
    assert first[0] == greedy


def test_seeded_sampled_rows_draw_the_same_tokens_with_and_without_overlap():
    prompts = [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
    params = [SamplingParams(10, stop_token_ids=()),
              SamplingParams(10, temperature=1.0, top_p=0.9, seed=4, stop_token_ids=()),
              SamplingParams(10, temperature=0.7, top_k=20, seed=5, stop_token_ids=())]

    def run(overlap):
        llm = LLM(DEMO, device="cuda", overlap=overlap)
        rids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        got = {rid: [] for rid in rids}
        while llm.has_work():
            for out in llm.step():
                got[out.rid] += out.token_ids
        return [got[r] for r in rids]

    assert run(True) == run(False)
