"""Caches move between kvbuffer and transformers: a prefix computed by one is continued by the other."""

import pytest
import torch

from tests.support.hf_models import hf_greedy, saved_hf_model
from kvbuffer import LLM
from kvbuffer.engine.hf_interop import generate_from_hf, prefill_to_hf

C = 6


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return saved_hf_model("qwen3_5_text", tmp_path_factory)


@pytest.mark.parametrize("prompt_len", [C - 2, 2 * C + 3], ids=["short-context", "with-state"])
def test_kvbuffer_prefix_continued_by_transformers(qwen, prompt_len):
    hf, path = qwen
    llm = LLM(str(path), device="cpu", chunk_size=C)
    prompt = torch.randint(0, hf.config.vocab_size, (prompt_len + 1,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = prefill_to_hf(llm, prompt[:-1])
    assert llm.runner.caches.requests.num_free == llm.runner.spec.max_requests  # nothing leaked
    with torch.no_grad():
        ours = hf(input_ids=torch.tensor([prompt[-1:]]), cache=cache, use_cache=True).logits[0, -1]
        ref = hf(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert float((ours - ref).abs().max()) < 1e-4


@pytest.mark.parametrize("prompt_len", [3, 2 * C + 3])
def test_transformers_prefix_continued_by_kvbuffer(qwen, prompt_len):
    hf, path = qwen
    llm = LLM(str(path), device="cpu", chunk_size=C)
    prompt = torch.randint(0, hf.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        cache = hf(input_ids=torch.tensor([prompt[:-1]]), use_cache=True).past_key_values
    out = generate_from_hf(llm, prompt, cache, max_new_tokens=20, stop_token_ids=[])
    ref_tokens, _ = hf_greedy(hf, prompt, 20)
    assert out.token_ids == ref_tokens


def test_nemotron_caches_round_trip(tmp_path):
    """Mamba-2 states are stored transposed by transformers: a kvbuffer prefix continues there too."""
    from tests.support.hf_models import make_hf_model as make

    hf = make("nemotron_h")
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", chunk_size=C)
    prompt = torch.randint(0, hf.config.vocab_size, (2 * C + 2,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = prefill_to_hf(llm, prompt[:-1])
    with torch.no_grad():
        ours = hf(input_ids=torch.tensor([prompt[-1:]]), cache=cache, use_cache=True).logits[0, -1]
        ref = hf(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert float((ours - ref).abs().max()) < 1e-4
    with torch.no_grad():
        hf_cache = hf(input_ids=torch.tensor([prompt[:-1]]), use_cache=True).past_key_values
    out = generate_from_hf(llm, prompt, hf_cache, max_new_tokens=12, stop_token_ids=[])
    assert out.token_ids == hf_greedy(hf, prompt, 12)[0]
