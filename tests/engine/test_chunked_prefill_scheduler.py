"""Chunked prefill in the engine's steps: a step feeds at most max_prefill_tokens prompt tokens, so a
long prompt spreads over steps while the running requests keep decoding; prompts share the budget
max-min fairly (Scheduler.prefill_shares); outputs equal each request run alone."""

import pytest
import torch

from kvbuffer import LLM
from kvbuffer.engine.request import Request
from kvbuffer.engine.sampling import SamplingParams
from kvbuffer.engine.scheduler import Scheduler, fair_shares
from tests.support.pool_slots import all_free
from tests.support.scripted_drafter import ScriptedDrafter
from tests.support.tiny_models import tiny_model

C, BUDGET = 4, 8
SHORT = [[5, 6, 7], [9, 3]]
LONG = [(11 * j) % 90 + 1 for j in range(53)]  # 7 budgets of 8 tokens (the last one 5)


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def model(request):
    return tiny_model(request.param)


def _llm(model, **kw):
    kw = dict(dict(device="cpu", dtype=torch.float32, chunk_size=C, max_batch=4, max_len=128, kernels=False,
                   max_prefill_tokens=BUDGET), **kw)
    return LLM(model, **kw)


def _params(n):
    return SamplingParams(max_new_tokens=n, stop_token_ids=())


def _alone(model, prompt, n, **kw):
    return _llm(model, **kw).generate([prompt], max_new_tokens=n, stop_token_ids=[])[0].token_ids


def _collect(outs, got, reasons=None):
    for out in outs:
        got.setdefault(out.rid, []).extend(out.token_ids)
        if reasons is not None and out.finish_reason is not None:
            reasons[out.rid] = out.finish_reason
    return {out.rid for out in outs if out.token_ids}


def _finish(llm, got, reasons=None, limit=200):
    for _ in range(limit):
        if not llm.has_work():
            return
        _collect(llm.step(), got, reasons)
    raise AssertionError("the engine did not finish")


# the budget's split -----------------------------------------------------------------------------------
@pytest.mark.parametrize("budget, needs, shares", [
    (8, [3, 2], [3, 2]),  # everything fits
    (8, [53], [8]),
    (8, [30, 5, 12], [2, 2, 2]),  # level 2 (3 x 2), the 2 tokens below level 3 go unused
    (16, [1, 3, 6, 5, 17], [1, 3, 4, 4, 4]),  # short prompts finish, the others share the rest
    (10, [7, 100, 100], [3, 3, 3]),
    (12, [2, 100, 100], [2, 5, 5]),
    (1, [5, 2, 9], [1, 0, 0]),  # fewer tokens than prompts: the oldest first
    (2, [5, 2, 9], [1, 1, 0]),
    (3, [5, 2, 9], [1, 1, 1]),
    (7, [], []),
], ids=["fits", "one-long", "level-2", "mixed", "equal-longs", "short-first", "budget-1", "budget-2",
        "budget-3", "none"])
def test_fair_shares_are_max_min(budget, needs, shares):
    got = fair_shares(budget, needs)
    assert got == shares
    assert sum(got) <= budget and all(0 <= s <= n for s, n in zip(got, needs))


def test_fair_shares_reject_an_empty_budget():
    with pytest.raises(ValueError, match="budget must be >= 1, got 0"):
        fair_shares(0, [3])


def test_the_scheduler_shares_prompt_tokens_and_decodes_only_requests_past_their_prompt():
    s = Scheduler()
    decoding = Request(0, [1], _params(4), output=[2], cached=1)
    s.running = [decoding, Request(1, [1] * 30, _params(4), cached=4), Request(2, [1] * 3, _params(4))]
    assert [(r.rid, n) for r, n in s.prefill_shares(8)] == [(1, 5), (2, 3)]
    assert s.runnable(4, 1, lambda r, adding: False) == [decoding]


def test_admission_keeps_the_state_a_prefilling_request_needs_for_its_first_decode():
    """A 7-token prompt with 3 fed (C = 8, no state yet): its prompt and first decode fill the buffer,
    so the one free state is not spare for a long arrival."""
    s = Scheduler()
    s.running = [Request(0, [1] * 7, _params(4), cached=3)]
    s.add(Request(1, [1] * 20, _params(4)))
    assert s.admit(4, 1, lambda r, adding: r.state_slot < 0 and r.cached + adding >= 8) == []
    assert s.admit(4, 2, lambda r, adding: r.state_slot < 0 and r.cached + adding >= 8)[0].rid == 1


# a long prompt beside decoding requests ----------------------------------------------------------------
@pytest.mark.parametrize("engine", [{}, {"overlap": True}, {"speculative": {"method": "ngram", "num_draft_tokens": 3}},
                                    {"mode": "recurrent"}], ids=["plain", "overlap", "speculative", "recurrent"])
def test_a_long_prompt_does_not_stall_the_decoding_requests(model, engine):
    """Two requests decode; a 53-token prompt arrives and takes 7 steps of 8 prompt tokens, in each of
    which both others emit; every request's tokens equal its run alone."""
    same = {k: v for k, v in engine.items() if k == "mode"}
    refs = [(p, _alone(model, p, n, **same)) for p, n in zip((*SHORT, LONG), (40, 40, 6))]
    llm = _llm(model, **engine)
    if "speculative" in engine:
        llm.drafter = ScriptedDrafter(refs, "some", llm.vocab_size)
    rids = [llm.add_request(p, _params(40)) for p in SHORT]
    got = {}
    _collect(llm.step(), got)
    long = llm.add_request(LONG, _params(6))
    steps = 0
    while long not in got:
        emitted = _collect(llm.step(), got)
        steps += 1
        assert set(rids) <= emitted, f"step {steps}: a decoding request got no token"
        assert llm.stats.running == 3
        assert llm.stats.prefilling == (long not in got)
    assert steps == 7
    _finish(llm, got)
    assert [got[r] for r in (*rids, long)] == [t for _, t in refs]
    assert all_free(llm)


def _count_prompt_tokens(llm) -> tuple[list[int], list[int]]:
    """(fed, forwards): the engine's prefill forwards add their token counts to fed's last entry (append a
    0 to start a step's count) and each to forwards, each checked to feed <= BUDGET tokens."""
    fed, forwards, forward = [], [], llm.runner._forward

    def counting(ids, batch, **kw):
        if batch.phase == "prefill":
            fed[-1] += ids.numel()
            forwards.append(ids.numel())
            assert ids.numel() <= BUDGET
        return forward(ids, batch, **kw)

    llm.runner._forward = counting
    return fed, forwards


def test_each_step_feeds_at_most_the_budget_and_a_lone_prompt_runs_to_its_first_token(model):
    """While a request decodes, each step's prefill forwards feed <= BUDGET tokens in all; alone, the
    prompt is fed in one step (its forwards each <= BUDGET), as before chunked prefill."""
    llm = _llm(model)
    fed, forwards = _count_prompt_tokens(llm)
    rid = llm.add_request(LONG, _params(10))
    fed.append(0)
    outs = llm.step()
    assert fed == [len(LONG)] and [o.token_ids for o in outs if o.rid == rid][0]  # its first token
    llm.add_request(LONG[:30], _params(2))
    fed.append(0)
    while llm.has_work():
        llm.step()
        fed.append(0)
    assert fed[1:5] == [8, 8, 8, 6]


@pytest.mark.parametrize("while_decoding", [1, 3], ids=["1-token", "3-tokens"])
def test_a_smaller_budget_while_others_decode_feeds_that_many_and_keeps_the_tokens(model, while_decoding):
    """prefill_tokens_while_decoding: while a request decodes, each step's prefill forwards feed at most
    that many tokens (so the decoding request's gaps stay short); alone, a prompt still runs to its first
    token in one step on rounds of max_prefill_tokens. Every request's tokens equal its run alone."""
    llm = _llm(model, prefill_tokens_while_decoding=while_decoding)
    fed, forwards = _count_prompt_tokens(llm)
    first = llm.add_request(LONG, _params(12))
    got = {}
    fed.append(0)
    assert first in _collect(llm.step(), got) and forwards == [BUDGET] * 6 + [len(LONG) - 6 * BUDGET]
    second = llm.add_request(LONG[:7], _params(3))
    while second not in got:
        fed.append(0)
        assert first in _collect(llm.step(), got)
    assert fed[1:] == [while_decoding] * (7 // while_decoding) + [7 % while_decoding] * (7 % while_decoding > 0)
    _finish(llm, got)
    assert [got[first], got[second]] == [_alone(model, LONG, 12), _alone(model, LONG[:7], 3)]
    assert all_free(llm)


# prompts admitted together ---------------------------------------------------------------------------------
def test_prompts_of_different_lengths_all_progress_and_match_alone(model):
    """A decoding request, then prompts of 5, 23 and 40 tokens admitted in one step: each step every
    unfinished prompt advances and the decoding request emits; tokens equal their runs alone."""
    llm = _llm(model)
    first = llm.add_request(SHORT[0], _params(30))
    got = {}
    _collect(llm.step(), got)
    prompts = [LONG[:5], LONG[10:33], LONG[:40]]
    rids = [llm.add_request(p, _params(4)) for p in prompts]
    _collect(llm.step(), got)
    reqs = {r.rid: r for r in llm.scheduler.running}
    assert [reqs[r].cached for r in rids] == [2, 2, 2]  # the budget's level: 3 x 2 of 8 tokens
    while any(r.prefilling for r in reqs.values()):
        before = {r: reqs[r].cached for r in rids if reqs[r].prefilling}
        assert first in _collect(llm.step(), got)
        for r, cached in before.items():
            assert reqs[r].cached > cached, f"request {r} made no progress"
    _finish(llm, got)
    assert [got[r] for r in rids] == [_alone(model, p, 4) for p in prompts]
    assert got[first] == _alone(model, SHORT[0], 30)


def test_with_no_request_decoding_a_step_feeds_until_a_prompt_is_done(model):
    """Three prompts admitted into an idle engine: the first step feeds rounds of the budget until
    the shortest is done, and only that one emits."""
    llm = _llm(model)
    rids = [llm.add_request(p, _params(3)) for p in (LONG[:40], LONG[:13], LONG[:31])]
    got = {}
    assert _collect(llm.step(), got) == {rids[1]}
    reqs = {r.rid: r for r in llm.scheduler.running}
    assert reqs[rids[0]].prefilling and reqs[rids[2]].prefilling
    _finish(llm, got)
    assert [got[r] for r in rids] == [_alone(model, p, 3) for p in (LONG[:40], LONG[:13], LONG[:31])]


@pytest.mark.parametrize("budget", [1, 3, 1000], ids=["budget-1", "budget-3", "budget-above-prompts"])
def test_any_budget_gives_the_same_tokens(model, budget):
    """generate() over ragged prompts with more prompts than slots: the budget changes when tokens
    come, never which."""
    prompts = [LONG[:n] for n in (1, 17, 6, 53, 2)]
    want = _llm(model, max_prefill_tokens=1024).generate(prompts, max_new_tokens=5, stop_token_ids=[])
    llm = _llm(model, max_prefill_tokens=budget, max_batch=3)
    outs = llm.generate(prompts, max_new_tokens=5, stop_token_ids=[])
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert all_free(llm)


# abort, errors, limits -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
def test_abort_mid_prefill_frees_the_slots_and_the_others_finish(model, mode):
    """A long prompt is aborted after two of its steps: its request and state slots come back at once,
    a waiting request takes the slot, and the others' tokens equal their runs alone."""
    llm = _llm(model, mode=mode, max_batch=2)
    first = llm.add_request(SHORT[0], _params(12))
    got = {}
    _collect(llm.step(), got)
    victim = llm.add_request(LONG, _params(5))
    late = llm.add_request(SHORT[1], _params(6))  # waits: two slots
    _collect(llm.step(), got)
    _collect(llm.step(), got)
    req = next(r for r in llm.scheduler.running if r.rid == victim)
    assert req.prefilling and req.cached == 2 * BUDGET and req.state_slot >= 0
    states_free = llm.runner.caches.states.slots.num_free
    assert llm.abort(victim).finish_reason == "abort"
    assert llm.runner.caches.requests.num_free == 1 and llm.runner.caches.states.slots.num_free == states_free + 1
    assert req.slot == -1 and req.state_slot == -1
    reasons = {}
    _finish(llm, got, reasons)
    assert victim not in got and reasons == {first: "length", late: "length"}
    assert got[first] == _alone(model, SHORT[0], 12, mode=mode)
    assert got[late] == _alone(model, SHORT[1], 6, mode=mode)
    assert all_free(llm)


def test_a_step_that_fails_mid_prefill_aborts_what_it_admitted_and_the_engine_goes_on(model, monkeypatch):
    llm = _llm(model)
    first = llm.add_request(SHORT[0], _params(8))
    got = {}
    _collect(llm.step(), got)
    doomed = llm.add_request(LONG, _params(3))

    def failing(*args, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(llm.runner, "prefill", failing)
    with pytest.raises(RuntimeError, match="injected"):
        llm.step()
    monkeypatch.undo()
    assert [r.rid for r in llm.scheduler.running] == [first] and llm.abort(doomed) is None
    _finish(llm, got)
    assert got[first] == _alone(model, SHORT[0], 8)
    assert all_free(llm)


def test_prompts_near_max_len(model):
    """A prompt fed over several steps that ends 2 tokens short of max_len stops there with 'length';
    one past max_len is rejected up front and the engine stays usable."""
    llm = _llm(model, max_len=48)
    first = llm.add_request(SHORT[0], _params(20))
    got, reasons = {}, {}
    _collect(llm.step(), got)
    with pytest.raises(ValueError, match="49 tokens exceed max_len=48"):
        llm.add_request(LONG[:49], _params(3))
    near = llm.add_request(LONG[:46], _params(10))
    _finish(llm, got, reasons)
    assert reasons[near] == "length" and got[near] == _alone(model, LONG[:46], 10)[:2]
    assert got[first] == _alone(model, SHORT[0], 20, max_len=48)
    assert all_free(llm)


def test_runner_prefill_checks_its_counts_before_any_forward(model):
    llm = _llm(model, max_len=16)
    req = Request(0, LONG[:20], _params(1))
    llm.runner.admit(req)
    try:
        for counts, match in [([21], "tokens=21, expected 1 to 20"), ([0], "tokens=0, expected 1 to 20"),
                              ([1, 1], "2 counts for 1 requests"), ([17], "context of 17 tokens exceeds max_len=16")]:
            with pytest.raises(ValueError, match=match):
                llm.runner.prefill([req], counts)
        assert req.cached == 0
    finally:
        llm.runner.release(req)
    assert all_free(llm)


def test_the_mtp_drafter_learns_each_whole_prompt(tmp_path):
    """With a budget of 8 a 29-token prompt is fed over steps while a 7-token one decodes: on_prefill
    still gets the hidden states of all its positions, as with the whole prompt in one step."""
    from tests.support.hf_models import add_mtp_head, make_hf_model

    make_hf_model("qwen3_5_text").save_pretrained(tmp_path)
    add_mtp_head(tmp_path)
    prompts = [LONG[:29], LONG[:7]]

    def run(budget):
        llm = LLM(str(tmp_path), device="cpu", chunk_size=C, max_batch=4, max_prefill_tokens=budget,
                  speculative={"method": "mtp", "num_draft_tokens": 3})
        seen, learn = {}, llm.drafter.on_prefill

        def spy(req, hidden, next_tokens):
            seen[req.rid] = hidden.clone(), list(next_tokens)
            learn(req, hidden, next_tokens)

        llm.drafter.on_prefill = spy
        outs = llm.generate(prompts, max_new_tokens=8, stop_token_ids=[])
        return [o.token_ids for o in outs], [seen[rid] for rid in sorted(seen)]

    chunked, whole = run(BUDGET), run(1024)
    assert chunked[0] == whole[0]
    for p, out, (h, nxt), (h_whole, nxt_whole) in zip(prompts, chunked[0], chunked[1], whole[1]):
        assert h.shape[0] == len(p) and nxt == p[1:] + out[:1] == nxt_whole
        torch.testing.assert_close(h, h_whole, rtol=1e-4, atol=1e-5)
