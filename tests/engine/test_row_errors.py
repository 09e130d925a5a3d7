"""A request whose row cannot be sampled (NaN or infinite logits, greedy or sampled, or a sampling that
raises) is finished alone with finish_reason "error"; the other requests of the same steps produce
exactly what they produce without it, and every slot is freed."""

import pytest
import torch

from kvbuffer import LLM, demo_checkpoint
from kvbuffer.engine import core as engine_core
from kvbuffer.engine.sampling import SamplingParams
from kvbuffer.errors import RequestError
from tests.support.pool_slots import all_free

DEMO = str(demo_checkpoint())
PROMPTS = [[5, 6, 7], [9, 3], [4, 4, 8, 1, 2], [7], [2, 11, 30]]
N = 9
# greedy and seeded sampled rows (a seeded row's draws are its own, whatever its neighbours)
PARAMS = [SamplingParams(N, stop_token_ids=()), SamplingParams(N, 0.9, top_k=20, seed=4, stop_token_ids=()),
          SamplingParams(N, stop_token_ids=()), SamplingParams(N, 1.1, top_p=0.9, seed=8, stop_token_ids=()),
          SamplingParams(N, stop_token_ids=())]
ENGINES = {
    "plain": dict(overlap=False),
    "overlapped": dict(overlap=True),
    "speculative": dict(overlap=False, speculative={"method": "ngram", "num_draft_tokens": 2}),
}


def _poison(llm, rid: int, phases: tuple[str, ...], after: int):
    """From the forward of `phases` numbered `after` (0: the first) that feeds request `rid` on, its
    logits rows are NaN, as a numerical failure in that request's own state would make them."""
    runner, seen = llm.runner, [0]
    forward = runner._forward

    def poisoned(ids, batch, **kw):
        out = forward(ids, batch, **kw)
        req = next((r for r in llm.scheduler.running if r.rid == rid), None)
        if batch.phase in phases and req is not None and bool((batch.slots == req.slot).any()):
            seen[0] += 1
            if seen[0] > after:
                logits = out[0] if isinstance(out, tuple) else out
                logits[batch.slots == req.slot] = float("nan")
        return out

    runner._forward = poisoned


def _run(llm, params=PARAMS):
    """Every request to its end through add_request/step: rid -> (tokens, finish_reason, error)."""
    rids = [llm.add_request(p, q) for p, q in zip(PROMPTS, params)]
    got = {rid: ([], None, None) for rid in rids}
    while llm.has_work():
        for out in llm.step():
            tokens, _, _ = got[out.rid]
            tokens += out.token_ids
            if out.finish_reason is not None:
                got[out.rid] = (tokens, out.finish_reason, out.error)
    return [got[rid] for rid in rids]


@pytest.fixture(scope="module", params=list(ENGINES), ids=list(ENGINES))
def engine(request):
    return LLM(DEMO, device="cpu", max_batch=len(PROMPTS), chunk_size=4, **ENGINES[request.param])


@pytest.fixture(scope="module")
def clean(engine):
    return _run(engine)


@pytest.mark.parametrize("victim, phases, after", [
    (2, ("decode", "verify"), 3),  # a greedy row, mid-generation
    (1, ("decode", "verify"), 1),  # a sampled row
    (0, ("prefill",), 0),  # the first token
], ids=["greedy-decode", "sampled-decode", "first-token"])
def test_a_row_of_nan_logits_fails_alone(engine, clean, victim, phases, after, monkeypatch):
    assert all(reason == "length" and len(tokens) == N for tokens, reason, _ in clean)
    monkeypatch.setattr(engine.runner, "_forward", engine.runner._forward)  # undone after the test
    _poison(engine, engine._next_rid + victim, phases, after)
    faulty = _run(engine)
    tokens, reason, error = faulty[victim]
    assert reason == "error" and "NaN or infinite" in error
    assert tokens == clean[victim][0][:len(tokens)] and len(tokens) < N  # no made-up token (greedy NaN: 0)
    assert [o for i, o in enumerate(faulty) if i != victim] == [o for i, o in enumerate(clean) if i != victim]
    assert all_free(engine) and not engine.has_work()


def test_a_sampling_that_raises_fails_its_row_alone(engine, clean, monkeypatch):
    """A fault inside the batched pick: each row is picked again alone, and only the row that raises again fails."""
    pick_rows = engine_core.pick_rows

    def faulty(logits, params, generators):
        if any(p.top_k == 13 for p in params):
            raise RuntimeError("injected fault\nsecond line")
        return pick_rows(logits, params, generators)

    monkeypatch.setattr(engine_core, "pick_rows", faulty)
    if engine.core.speculative is not None:
        pytest.skip("verify steps accept on their own path (acceptance.accept_sampled)")
    params = list(PARAMS)
    params[3] = SamplingParams(N, 1.1, top_p=0.9, top_k=13, seed=8, stop_token_ids=())
    out = _run(engine, params)
    assert out[3] == ([], "error", "sampling failed: RuntimeError: injected fault")
    assert out[:3] + out[4:] == clean[:3] + clean[4:]
    assert all_free(engine)


def test_generate_raises_naming_the_prompt_after_the_others_finish(monkeypatch):
    llm = LLM(DEMO, device="cpu", max_batch=3, chunk_size=4, overlap=False)
    want = llm.generate(PROMPTS[:3], max_new_tokens=N, stop_token_ids=[])
    monkeypatch.setattr(llm.runner, "_forward", llm.runner._forward)
    _poison(llm, llm._next_rid + 1, ("decode",), 2)
    streamed = {0: [], 1: [], 2: []}
    with pytest.raises(RequestError, match="prompt 1: sampling: the logits are NaN or infinite"):
        llm.generate(PROMPTS[:3], max_new_tokens=N, stop_token_ids=[], on_token=lambda i, t: streamed[i].append(t))
    assert streamed[0] == want[0].token_ids and streamed[2] == want[2].token_ids  # the others ran to their end
    assert all_free(llm) and not llm.has_work()
    monkeypatch.undo()
    assert llm.generate(PROMPTS[:3], max_new_tokens=N, stop_token_ids=[])[1].token_ids == want[1].token_ids


def test_a_greedy_verify_keeps_no_draft_past_nan_logits(monkeypatch):
    """All rows greedy: acceptance runs inside the verify forward (commit.greedy_accepts), where a NaN
    row's argmax would be token 0; it must keep nothing past the NaN and fail alone."""
    llm = LLM(DEMO, device="cpu", max_batch=len(PROMPTS), chunk_size=4,
              speculative={"method": "ngram", "num_draft_tokens": 3})
    greedy = [SamplingParams(N, stop_token_ids=())] * len(PROMPTS)
    clean = _run(llm, greedy)
    monkeypatch.setattr(llm.runner, "_forward", llm.runner._forward)
    _poison(llm, llm._next_rid + 4, ("verify",), 1)
    faulty = _run(llm, greedy)
    tokens, reason, error = faulty[4]
    assert reason == "error" and "NaN or infinite" in error and tokens == clean[4][0][:len(tokens)]
    assert faulty[:4] == clean[:4] and all_free(llm)


def test_greedy_accepts_never_keeps_a_draft_after_a_nan_position():
    from kvbuffer.engine.commit import greedy_accepts

    logits = torch.zeros(2, 3, 10)
    logits[:, :, 4] = 1.0  # every position picks 4
    logits[1, 1] = float("nan")
    ids = torch.tensor([[1, 4, 4], [1, 4, 4]])
    picks, accepted = greedy_accepts(ids, logits)
    assert accepted.tolist() == [2, 1] and picks[1].tolist() == [4, -1, 4]
    ids[0, 2] = -1  # a padding draft is never kept, even against a NaN position's -1
    logits[0, 1] = float("nan")
    assert greedy_accepts(ids, logits)[1].tolist() == [1, 1]
