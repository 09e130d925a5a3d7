"""Faults of one row outside the verify's acceptance: a pick that raises late in the batch (after the
seeded rows drew), the first token after a prompt in a speculative engine, and a token's log-probability
that cannot be computed. Each finishes its request alone with finish_reason "error"; the others get
exactly their tokens of a run without the fault."""

import pytest
import torch

from kvbuffer import LLM, demo_checkpoint
from kvbuffer.engine import core as engine_core
from kvbuffer.engine.sampling import SamplingParams, rows_alone_on_failure
from tests.engine.test_speculative_row_errors import MARK_TOP_K, NEW, SAMPLED, _params, _run
from tests.support.pool_slots import all_free

ENGINES = {
    "plain": dict(overlap=False),
    "overlapped": dict(overlap=True),
    "ngram": dict(overlap=False, speculative={"method": "ngram", "num_draft_tokens": 2}),
}


@pytest.fixture(scope="module", params=list(ENGINES), ids=list(ENGINES))
def engine(request):
    return LLM(str(demo_checkpoint()), device="cpu", max_batch=5, chunk_size=4, **ENGINES[request.param])


def _others_equal(engine, clean, faulty, victim):
    assert [o for i, o in enumerate(faulty) if i != victim] == [o for i, o in enumerate(clean) if i != victim]
    assert all_free(engine) and not engine.has_work()


def test_a_pick_that_raises_after_drawing_fails_its_row_alone(engine, monkeypatch):
    """The batch's draws are undone before each row is picked again alone (the first token of every
    engine, and every plain or overlapped step)."""
    clean = _run(engine, _params("top_k"))
    pick_rows = engine_core.pick_rows

    def faulty(logits, params, generators):
        if any(p.top_k == MARK_TOP_K for p in params):
            for g in generators:
                if g is not None:
                    torch.rand(5, generator=g)
            raise RuntimeError("injected pick fault")
        return pick_rows(logits, params, generators)

    monkeypatch.setattr(engine_core, "pick_rows", faulty)
    out = _run(engine, _params("top_k"))
    assert out[SAMPLED] == ([], "error", "sampling failed: RuntimeError: injected pick fault")
    _others_equal(engine, clean, out, SAMPLED)


def test_a_logprob_that_fails_ends_its_row_alone(engine, monkeypatch):
    params = _params()
    params[SAMPLED] = SamplingParams(NEW[SAMPLED], 0.9, top_k=20, seed=4, stop_token_ids=(), logprobs=True)
    clean = _run(engine, params)
    token_logprob, calls = engine_core.token_logprob, [0]

    def faulty(logits, token):
        calls[0] += 1
        if calls[0] == 3:
            raise FloatingPointError("injected logprob fault")
        return token_logprob(logits, token)

    monkeypatch.setattr(engine_core, "token_logprob", faulty)
    out = _run(engine, params)
    tokens, reason, error = out[SAMPLED]
    assert reason == "error" and error == "recording the token failed: FloatingPointError: injected logprob fault"
    assert tokens == clean[SAMPLED][0][:2]
    _others_equal(engine, clean, out, SAMPLED)


def test_rows_alone_on_failure_restores_the_generators_and_keeps_order():
    gens = [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)]
    want = [float(torch.rand(1, generator=gens[0])), float(torch.rand(1, generator=gens[2]))]
    gens = [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)]

    def run(rows: slice):
        draws = [float(torch.rand(1, generator=g)) if g is not None else 0.0 for g in gens[rows]]
        if rows.stop - rows.start > 1 or rows.start == 1:
            raise ValueError(f"rows {rows.start}..{rows.stop}")
        return draws

    out = rows_alone_on_failure(run, 3, gens, lambda i, e: str(e))
    assert out == [[want[0]], "rows 1..2", [want[1]]]
    assert rows_alone_on_failure(lambda rows: "all", 3, gens, None) == ["all"]
    assert rows_alone_on_failure(lambda rows: 1 / 0, 1, [None], lambda i, e: (i, type(e).__name__)) == \
        [(0, "ZeroDivisionError")]
