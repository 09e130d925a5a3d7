"""Greedy generation is token-identical to transformers', with logits within 1e-4 at every step."""

import pytest
import torch

from tests.support.hf_models import hf_greedy, saved_hf_model
from kvbuffer import LLM

C = 6  # buffer chunk: prompt lengths straddle it
PROMPT_LENGTHS = [1, C - 1, C, C + 1, 3 * C + 5]
NEW_TOKENS = 64


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def checkpoint(request, tmp_path_factory):
    hf, path = saved_hf_model(request.param, tmp_path_factory)
    return request.param, hf, path, {}


def _prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(n)]
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lengths]


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_greedy_matches_transformers(checkpoint, mode, batch):
    model_type, hf, path, memo = checkpoint
    llm = LLM(str(path), device="cpu", mode=mode, chunk_size=C, max_batch=batch)
    # batch 1 runs every prompt length one request at a time; larger batches mix them
    prompts = _prompts(len(PROMPT_LENGTHS) if batch == 1 else batch, hf.config.vocab_size, seed=batch % 2)
    outs = llm.generate(prompts, max_new_tokens=NEW_TOKENS, return_logits=True, stop_token_ids=[])
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        key = tuple(prompt)
        if key not in memo:  # transformers' reference is shared by both modes
            memo[key] = hf_greedy(hf, prompt, NEW_TOKENS)
        ref_tokens, ref_logits = memo[key]
        ours = torch.stack(out.logits)
        worst = max(worst, float((ours - ref_logits).abs().max()))
        assert out.token_ids == ref_tokens, f"{model_type} {mode}: prompt of {len(prompt)} diverged"
    print(f"{model_type} {mode} batch={batch}: max |logit diff| = {worst:.2e}")
    assert worst < 1e-4
