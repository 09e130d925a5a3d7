"""Penalties on CUDA (kernels, CUDA graphs, overlapped steps, in-graph greedy acceptance): penalize on
the GPU follows the CPU; a penalized row leaves the device-picked paths for the host one, so the
overlapped and speculative steps give the synchronous tokens, and the rows beside it keep theirs.
CPU counterparts: tests/engine/test_penalties.py."""

import pytest
import torch

from kvbuffer import ops
from kvbuffer.engine.sampling import SamplingParams, penalize

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9], [3, 3, 3], [11, 12, 13, 14, 15, 16, 17]]
MIXED = [{}, dict(repetition_penalty=1.5), dict(frequency_penalty=1.0, presence_penalty=0.5), {}]


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


def test_penalize_on_the_gpu_follows_the_cpu():
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3, repetition_penalty=1.7), SamplingParams(),
              SamplingParams(repetition_penalty=0.6)]
    logits = 3 * torch.randn(3, 4099, generator=g)
    prompts = [torch.randint(4099, (9,), generator=g).tolist() for _ in params]
    outputs = [torch.randint(4099, (30,), generator=g).tolist() for _ in params]
    want = penalize(logits, params, prompts, outputs)
    assert torch.allclose(penalize(logits.cuda(), params, prompts, outputs).cpu(), want, atol=1e-6)


def _llm(kernels=True, **kw):
    """On the kernels with CUDA graphs (bf16), or on the reference ops in fp32 (a verify forward's
    rounding then differs from a decode's too little to flip a greedy token of the tiny model)."""
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM

    llm = LLM(tiny_model("qwen3_5"), device="cuda", dtype=torch.bfloat16 if kernels else torch.float32, chunk_size=8,
              max_batch=4, max_len=128, kernels=kernels, cuda_graphs=False, **kw)
    if kernels:
        llm.runner.use_graphs(True)
    return llm


def _mixed(llm, settings):
    rids = [llm.add_request(p, SamplingParams(24, stop_token_ids=(), **kw)) for p, kw in zip(PROMPTS, settings)]
    got = {rid: [] for rid in rids}
    while llm.has_work():
        for out in llm.step():
            got[out.rid] += out.token_ids
    return [got[r] for r in rids]


def test_penalized_rows_take_the_host_path_on_every_kind_of_step():
    from tests.support.scripted_drafter import ScriptedDrafter

    plain = _mixed(_llm(overlap=False), MIXED)
    assert _mixed(_llm(overlap=True), MIXED) == plain
    fp32 = _mixed(_llm(False, overlap=False), MIXED)
    spec = _llm(False, speculative={"method": "ngram", "num_draft_tokens": 3})
    spec.drafter = ScriptedDrafter(list(zip(PROMPTS, fp32)), "some", spec.vocab_size)
    assert _mixed(spec, MIXED) == fp32
    alone = _mixed(_llm(overlap=True), [{}] * 4)
    assert [plain[0], plain[3]] == [alone[0], alone[3]]
    neutral = [dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)] * 4
    assert _mixed(_llm(overlap=True), neutral) == alone
