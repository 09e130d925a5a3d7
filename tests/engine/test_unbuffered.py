"""Unbuffered decode steps (ModelRunner's unbuffered_rows): a kvbuffer-mode decode step of few rows
folds its rows' buffers into their states and steps the recurrence in place. Its outputs must be
the buffered steps' through every transition: buffered steps before and after (the batch shrinks as
requests end, and grows as waiting ones are admitted), short contexts that have no state yet, and a
state pool too small to give every row one (the step then stays buffered)."""

import pytest
import torch

from kvbuffer import LLM
from kvbuffer.engine.sampling import SamplingParams
from tests.support.tiny_models import tiny_model

C = 4
PROMPTS = [[1 + i % 50, 2, 3, 4 + i % 7][: 1 + i % 4] * (1 + i % 3) for i in range(7)]  # 1..12 tokens, some < C
LENGTHS = [3, 25, 9, 14, 2, 20, 6]  # requests end at different steps: batches of 4 down to 1


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def model(request):
    return tiny_model(request.param).to(torch.float64)


def _llm(model, mode="kvbuffer", unbuffered_rows=0, graphs=False, **kw):
    llm = LLM(model, device="cpu", dtype=torch.float64, mode=mode, max_batch=kw.pop("max_batch", 4), max_len=64,
              chunk_size=C, kernels=False, overlap=kw.pop("overlap", False), unbuffered_rows=unbuffered_rows, **kw)
    if graphs:  # the padded, bucketed forwards a CUDA graph replays (keyed by the step's kind), run eagerly
        llm.runner.use_graphs(True, capture=False)
    return llm


def _run(llm):
    """Token ids and their log-probabilities per request, and how many decode steps ran unbuffered."""
    runner, unbuffered = llm.runner, []
    decide = runner._unbuffered
    runner._unbuffered = lambda reqs: unbuffered.append(decide(reqs)) or unbuffered[-1]
    rids = [llm.add_request(p, SamplingParams(n, stop_token_ids=(), logprobs=True))
            for p, n in zip(PROMPTS, LENGTHS)]
    got = {rid: ([], []) for rid in rids}
    while llm.has_work():
        for out in llm.step():
            got[out.rid][0].extend(out.token_ids)
            got[out.rid][1].extend(out.logprobs)
    return [got[r] for r in rids], sum(unbuffered)


def _same(a, b):
    for (ids_a, logprobs_a), (ids_b, logprobs_b) in zip(a, b):
        assert ids_a == ids_b
        assert logprobs_a == pytest.approx(logprobs_b, rel=0, abs=1e-5)  # log-probabilities are fp32


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-forwards"])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_unbuffered_steps_give_the_buffered_outputs(model, rows, graphs):
    buffered, none = _run(_llm(model))
    assert none == 0
    got, unbuffered = _run(_llm(model, unbuffered_rows=rows, graphs=graphs))
    assert unbuffered > 0
    _same(got, buffered)
    recurrent, _ = _run(_llm(model, mode="recurrent"))
    _same(got, recurrent)


def test_an_unbuffered_step_leaves_empty_buffers_and_a_state_per_row(model):
    llm = _llm(model, unbuffered_rows=1)
    prompt = [5, 9]  # shorter than C
    rid = llm.add_request(prompt, SamplingParams(5, stop_token_ids=()))
    (req,) = [r for r in llm.scheduler.waiting if r.rid == rid]
    runner, seen = llm.runner, []
    for name in ("prefill", "decode"):  # each forward, then the request's state slot and buffer fill
        def after(*a, _run=getattr(runner, name), **k):
            out = _run(*a, **k)
            seen.append((req.state_slot, runner._fill(req)))
            return out
        setattr(runner, name, after)
    while llm.has_work():
        llm.step()
    assert seen[0] == (-1, len(prompt))  # the short prompt waits in the buffer, with no state
    assert len(seen) == 5 and all(slot >= 0 and fill == 0 for slot, fill in seen[1:])  # 4 unbuffered steps


def test_a_step_whose_rows_cannot_all_get_a_state_stays_buffered(model):
    """Two states for four request slots: rows without a state cannot all be given one, so those steps
    run buffered (nothing allocated, nothing folded), and the outputs do not change."""
    buffered, _ = _run(_llm(model, max_states=2))
    got, unbuffered = _run(_llm(model, unbuffered_rows=4, max_states=2))
    _same(got, buffered)
    assert unbuffered > 0  # the steps whose rows all had or could get a state


@pytest.mark.parametrize("bad, error", [(-1, ValueError), ("many", TypeError), (1.5, TypeError)])
def test_bad_unbuffered_rows_are_named(model, bad, error):
    with pytest.raises(error, match="unbuffered_rows"):
        _llm(model, unbuffered_rows=bad)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-forwards"])
def test_a_batch_that_grows_after_unbuffered_steps_buffers_again(model, graphs, overlap):
    """One request decodes alone (unbuffered), then two more join (buffered from empty buffers), they
    end, one is left alone again, and another joins: the outputs are the buffered steps' throughout,
    with overlapped steps (tokens fed on the device) as with synchronous ones."""
    def run(unbuffered_rows):
        llm = _llm(model, unbuffered_rows=unbuffered_rows, graphs=graphs, overlap=overlap)
        got, kinds = {}, []
        decide = llm.runner._unbuffered
        llm.runner._unbuffered = lambda reqs: kinds.append((len(reqs), decide(reqs))) or kinds[-1][1]
        joins = {0: [(PROMPTS[1], 30)], 4: [(PROMPTS[2], 6), (PROMPTS[5], 8)], 16: [(PROMPTS[6], 5)]}
        for step in range(80):
            for prompt, n in joins.get(step, []):
                got[llm.add_request(prompt, SamplingParams(n, stop_token_ids=(), logprobs=True))] = ([], [])
            if not llm.has_work():
                break
            for out in llm.step():
                got[out.rid][0].extend(out.token_ids)
                got[out.rid][1].extend(out.logprobs)
        return list(got.values()), kinds

    want, _ = run(0)
    got, kinds = run(1)
    _same(got, want)
    seen = [unbuffered for _, unbuffered in kinds]
    turns = set(zip(seen, seen[1:]))
    assert (True, False) in turns and (False, True) in turns  # unbuffered, buffered, unbuffered again
