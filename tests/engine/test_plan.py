"""Capacity planner: hand-computed bytes, the short-context case, and agreement with the engine."""

import pytest
import torch

from tests.support.hf_models import make_hf_model
from kvbuffer import LLM
from kvbuffer.plan import GEOMETRIES, geometry_of, plan, request_spec

MiB = 2**20


def test_qwen35_9b_bytes_by_hand():
    """Qwen3.5-9B: 24 GDN layers (Hk 16, Hv 32, 128 x 128), 8 attention layers (4 KV heads x 256)."""
    geo = GEOMETRIES["qwen3.5-9b"]
    T, ctx, C = 4, 512, 16
    plans = plan(geo, gpu_memory=141 * 2**30, context=ctx, draft_tokens=T, chunk_size=C)
    kb, rc = plans["kvbuffer"].breakdown, plans["recurrent"].breakdown
    state = 24 * 32 * 128 * 128 * 4  # fp32
    kv = 8 * (ctx + 2 * (T + 1)) * 4 * 256 * 2  # bf16, the context plus one verify's tokens, and the sink's
    assert kb["states"] == rc["states"] == state == 48 * MiB
    assert rc["draft_states"] == (T + 1) * state and "draft_states" not in kb
    assert kb["kv_keys"] == kb["kv_values"] == rc["kv_keys"] == kv
    entries = C + T + 1
    assert kb["buffer_keys"] == 24 * entries * 16 * 128 * 2
    assert kb["buffer_values"] == 24 * entries * 32 * 128 * 2
    assert kb["buffer_log_decay"] == 24 * entries * 32 * 4
    assert kb["conv"] == rc["conv"] == 24 * (2 * 16 * 128 + 32 * 128) * (3 + T + 1) * 2
    free = int(141 * 2**30 * 0.9) - 9 * 10**9 * 2
    assert plans["kvbuffer"].max_requests == free // sum(kb.values())
    assert plans["kvbuffer"].max_requests >= 4 * plans["recurrent"].max_requests


def test_short_contexts_need_no_state():
    plans = plan(GEOMETRIES["nemotron-3-nano"], gpu_memory=141 * 2**30, context=8, chunk_size=16)
    assert "states" in plans["recurrent"].breakdown and plans["kvbuffer"].breakdown["states"] == 0


def test_weights_that_do_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        plan(GEOMETRIES["qwen3.5-122b-a10b"], gpu_memory=80 * 2**30, context=10)


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
def test_engine_admits_what_the_planner_says(tmp_path, mode):
    make_hf_model("qwen3_5_text").save_pretrained(tmp_path)
    max_len, T, C = 64, 3, 6
    probe = LLM(str(tmp_path), device="cpu")
    spec = request_spec(geometry_of(probe.model), scheme=mode, context=max_len - T - 1, draft_tokens=T, chunk_size=C)
    per = sum(spec.nbytes(torch.float32).values())
    budget = 7 * per + per // 2
    llm = LLM(str(tmp_path), device="cpu", mode=mode, chunk_size=C, max_len=max_len, memory_budget=budget,
              speculative={"method": "ngram", "num_draft_tokens": T})
    assert llm.runner.spec.max_requests == 7
    allocated = sum(t.numel() * t.element_size() for t in llm.runner.caches.tensors().values())
    assert allocated == 7 * per <= budget
    batches = []
    verify = llm.runner.verify_greedy  # greedy requests: acceptance and commit on the device
    llm.runner.verify_greedy = lambda reqs, drafts, **kw: (batches.append(len(reqs)), verify(reqs, drafts, **kw))[1]
    llm.generate([[1, 2, 3]] * 9, max_new_tokens=4, stop_token_ids=[])
    assert max(batches) == 7  # seven requests ran at once; the other two waited for slots
