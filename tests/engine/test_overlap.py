"""Overlapped decode steps (kvbuffer.engine.overlap): step n + 1 queued before step n's tokens are
read back. The outputs must be exactly those of synchronous steps, whatever ends a request."""

import pytest
import torch

from kvbuffer import LLM
from kvbuffer.engine.config import EngineConfig
from kvbuffer.engine.graphs import StepInputs
from kvbuffer.engine.overlap import plan_feed, use_overlap
from kvbuffer.engine.request import Request
from kvbuffer.engine.sampling import SamplingParams
from tests.support.tiny_models import tiny_model

PROMPTS = [[1 + i % 50, 2, 3, 4 + i % 7] * (1 + i % 5) for i in range(11)]  # lengths 4..20, uneven


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def model(request):
    return tiny_model(request.param)


def _llm(model, overlap, graphs=False, **kw):
    llm = LLM(model, device="cpu", dtype=torch.float32, max_batch=kw.pop("max_batch", 4), max_len=kw.pop("max_len", 64),
              chunk_size=4, kernels=False, overlap=overlap)
    if graphs:  # the padded, bucketed forwards a CUDA graph replays, run eagerly
        llm.runner.use_graphs(True, capture=False)
    return llm


def _outputs(llm, prompts, **kw):
    return [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, **kw)]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-forwards"])
def test_overlapped_steps_give_the_synchronous_outputs(model, graphs):
    """More prompts than slots (admissions between overlapped steps), lengths ending by max_new_tokens
    and by max_len, and a stop token that ends some requests mid-way."""
    plain = _outputs(_llm(model, False), PROMPTS, max_new_tokens=30, stop_token_ids=[])
    common = max(range(model.config.vocab_size), key=lambda t: sum(ids.count(t) for ids, _ in plain))
    for stops in ([], [common]):
        sync = _outputs(_llm(model, False), PROMPTS, max_new_tokens=30, stop_token_ids=stops)
        llm = _llm(model, True, graphs)
        assert _outputs(llm, PROMPTS, max_new_tokens=30, stop_token_ids=stops) == sync
        assert {reason for _, reason in sync} == ({"length"} if not stops else {"length", "stop"})
        assert llm.runner.caches.requests.num_free == llm.runner.spec.max_requests  # every slot back
        assert llm.core.overlap.inflight is None


def test_sampled_rows_overlap_and_logprob_rows_run_synchronous_steps(model):
    """Sampled rows are drawn on the device, so their steps overlap like greedy ones; a row that wants
    log-probabilities settles the step in flight first. Seeded outputs and greedy rows stay the same."""
    def run(overlap):
        llm = _llm(model, overlap)
        rids = [llm.add_request(p, SamplingParams(12, temperature=1.0 if i in (3, 4) else 0.0, top_p=0.9,
                                                  seed=i if i != 4 else None, stop_token_ids=()))
                for i, p in enumerate(PROMPTS[:6])]
        got = {rid: [] for rid in rids}
        for _ in range(4):
            for out in llm.step():
                got[out.rid] += out.token_ids
        assert (llm.core.overlap.inflight is not None) == overlap  # greedy and sampled rows: an overlapped step
        rids.append(llm.add_request(PROMPTS[7], SamplingParams(9, logprobs=True, stop_token_ids=())))
        got[rids[-1]] = []
        while llm.has_work():
            for out in llm.step():
                got[out.rid] += out.token_ids
        return [got[r] for r in rids]

    with_overlap, without = run(True), run(False)
    unseeded = 4  # drawn from the default generator: its tokens may differ, its length may not
    assert [t for i, t in enumerate(with_overlap) if i != unseeded] == [t for i, t in enumerate(without) if i != unseeded]
    assert len(with_overlap[unseeded]) == len(without[unseeded]) == 12


def test_a_request_aborted_in_flight_frees_its_slots_and_spares_the_others(model):
    sync = _outputs(_llm(model, False), PROMPTS[:4], max_new_tokens=10, stop_token_ids=[])
    llm = _llm(model, True)
    rids = [llm.add_request(p, SamplingParams(10, stop_token_ids=())) for p in PROMPTS[:4]]
    got = {rid: [] for rid in rids}
    for _ in range(3):
        for out in llm.step():
            got[out.rid] += out.token_ids
    assert llm.core.overlap.inflight is not None and llm.abort(rids[1]) is not None
    while llm.has_work():
        for out in llm.step():
            got[out.rid] += out.token_ids
    assert [got[r] for r in (rids[0], rids[2], rids[3])] == [sync[i][0] for i in (0, 2, 3)]
    assert got[rids[1]] == sync[1][0][:len(got[rids[1]])]
    assert llm.runner.caches.requests.num_free == llm.runner.spec.max_requests


def test_feed_takes_tokens_from_the_last_picks():
    inputs = StepInputs(8, torch.device("cpu"))
    inputs.hold(torch.tensor([4, 0, 2]))
    cols = [[7, 0, 0], [0, 1, 2], [3, 4, 5], [-1, -1, -1], [1, 1, 1], [0, 1, 2]]
    view = inputs.upload(cols, 4, feed=[-1, 2, 0])
    assert view[0].tolist() == [7, 2, 4, 0] and view[2].tolist() == [3, 4, 5, -1]
    assert inputs.upload(cols, 3)[0].tolist() == [7, 0, 0]  # no feed: the columns' ids
    with pytest.raises(ValueError, match="feed: one index per row"):
        inputs.upload(cols, 4, feed=[0])
    with pytest.raises(ValueError, match="feed: one index per row"):
        StepInputs(8, torch.device("cpu"), tokens=2).upload([[0]] * 7, 1, feed=[0])
    with pytest.raises(ValueError, match="feed: index 3 past the last hold's 3 rows"):
        inputs.upload(cols, 4, feed=[-1, 3, 0])
    with pytest.raises(ValueError, match="feed: index 0 past the last hold's 0 rows"):
        StepInputs(8, torch.device("cpu")).upload(cols, 3, feed=[0, -1, -1])


def test_rows_ending_by_length_are_not_fed_again():
    a, b = (Request(i, [1, 2], SamplingParams(3)) for i in range(2))
    a.output, b.output = [5, 6], [5]
    inflight = type("Step", (), {"rows": [a, b]})()
    assert plan_feed([a, b], inflight, 64) == ([b], [1])  # a's token in flight is its third and last
    c = Request(2, [1], SamplingParams(9))
    c.output = [4]
    assert plan_feed([c, b], inflight, 64) == ([c, b], [-1, 1])
    assert plan_feed([b], inflight, 4) == ([], [])  # 2 prompt + 2 outputs reach max_len


def test_overlap_option_is_checked():
    assert use_overlap("auto", torch.device("cpu")) is False
    assert use_overlap("auto", torch.device("cuda")) is True
    with pytest.raises(ValueError, match="overlap must be True, False or 'auto', got str 'yes'"):
        EngineConfig(overlap="yes")
