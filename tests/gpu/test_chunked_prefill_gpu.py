"""Chunked prefill on CUDA (kernels, CUDA graphs, overlapped steps): a long prompt fed over steps of
max_prefill_tokens while two requests decode gives its tokens run alone, up to bf16 near ties; the
overlapped and speculative paths give the synchronous plain tokens. CPU counterparts:
tests/engine/test_chunked_prefill_scheduler.py."""

import pytest
import torch

from kvbuffer import ops

pytestmark = pytest.mark.gpu

C, BUDGET, NEW = 8, 64, 16
SHORT = [[5, 17, 3, 44, 9], [8, 1, 33]]
LONG = [(13 * j) % 90 + 1 for j in range(301)]  # 5 budgets of 64 tokens (the last one 45)


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


def _llm(kind, mode, **kw):
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM

    llm = LLM(tiny_model(kind), device="cuda", dtype=torch.bfloat16, mode=mode, chunk_size=C, max_batch=4,
              max_len=400, kernels=True, cuda_graphs=False, max_prefill_tokens=BUDGET, **kw)
    llm.runner.use_graphs(True)
    return llm


def _run(llm, prompts, return_logits=True):
    return llm.generate(prompts, max_new_tokens=NEW, return_logits=return_logits, stop_token_ids=[])


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_a_long_prompt_beside_decoding_requests_matches_it_alone(kind, mode):
    """generate(SHORT + [LONG]): the short prompts finish their prefill in the first step and decode
    while LONG is fed 64 tokens a step (prefill graphs of 64 tokens replayed); each request's logits
    are within bf16 rounding of its run alone and its greedy tokens equal except at near ties; the
    overlapped steps and speculative decoding give the same tokens as the synchronous plain steps."""
    from tests.gpu.test_ops_and_engine import compare_greedy
    from tests.support.scripted_drafter import ScriptedDrafter

    prompts = SHORT + [LONG]
    llm = _llm(kind, mode, overlap=False)
    fed, prefill = [], llm.runner.prefill

    def spy(reqs, tokens, want_hidden=False):
        fed.append(sum(tokens) if isinstance(tokens, list) else tokens)
        return prefill(reqs, tokens, want_hidden)

    llm.runner.prefill = spy
    together = _run(llm, prompts)
    assert max(fed) <= BUDGET and len(fed) >= len(LONG) // BUDGET
    assert any(g.enabled and g.graphs for (phase, T), (_, g) in llm.runner._multi.items() if phase == "prefill")
    alone = [_run(_llm(kind, mode), [p])[0] for p in prompts]
    compare_greedy(together, alone, tol=0.15)
    sync = [o.token_ids for o in _run(_llm(kind, mode, overlap=False), prompts, return_logits=False)]
    overlapped = [o.token_ids for o in _run(_llm(kind, mode, overlap=True), prompts, return_logits=False)]
    assert overlapped == sync
    spec = _llm(kind, mode, speculative={"method": "ngram", "num_draft_tokens": 3})
    spec.drafter = ScriptedDrafter(list(zip(prompts, sync)), "some", spec.vocab_size, strict=False)
    compare_greedy(_run(spec, prompts), together, tol=0.15)
    assert spec.runner.caches.requests.num_free == spec.runner.spec.max_requests
