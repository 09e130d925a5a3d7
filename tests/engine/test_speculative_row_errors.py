"""A request whose row fails inside a speculative verify (NaN logits, or its penalties or acceptance
raise) is finished alone with finish_reason "error", as in plain decoding: the other requests of the
same steps get exactly the tokens of a run without the fault, every slot is freed and the engine
goes on. n-gram and MTP drafters, greedy and sampled rows, with and without overlapped plain steps
(n-gram's disable_above_batch decodes the first steps plainly, overlapped, then verifies)."""

import pytest
import torch

from kvbuffer import LLM, demo_checkpoint
from kvbuffer.engine import speculative as engine_speculative
from kvbuffer.engine.sampling import SamplingParams
from tests.engine.test_row_errors import PROMPTS, _poison
from tests.support.pool_slots import all_free

NEW = [6, 12, 14, 12, 7]  # rows 0 and 4 end first: from then on an overlapped engine verifies
GREEDY, SAMPLED = 2, 1  # the victims: rows that are still running when the verifies start
MARK_TOP_K, MARK_PENALTY = 13, 1.07  # the settings that the injected faults fail


def _params(victim_marked: str | None = None) -> list[SamplingParams]:
    """Greedy rows 0, 2, 4 and seeded sampled rows 1, 3 (a seeded row's draws are its own); `victim_marked`
    gives the greedy victim a penalty ("penalty") or the sampled victim a top_k ("top_k") to fail on."""
    greedy = dict(repetition_penalty=MARK_PENALTY) if victim_marked == "penalty" else {}
    top_k = MARK_TOP_K if victim_marked == "top_k" else 20
    return [SamplingParams(NEW[0], stop_token_ids=()),
            SamplingParams(NEW[1], 0.9, top_k=top_k, seed=4, stop_token_ids=()),
            SamplingParams(NEW[2], stop_token_ids=(), **greedy),
            SamplingParams(NEW[3], 1.1, top_p=0.9, seed=8, stop_token_ids=()),
            SamplingParams(NEW[4], stop_token_ids=())]


def _run(llm, params):
    """Every request to its end through add_request/step: per prompt (tokens, finish_reason, error)."""
    rids = [llm.add_request(p, q) for p, q in zip(PROMPTS, params)]
    got = {rid: ([], None, None) for rid in rids}
    while llm.has_work():
        for out in llm.step():
            tokens = got[out.rid][0] + list(out.token_ids)
            got[out.rid] = (tokens, out.finish_reason, out.error)
    return [got[rid] for rid in rids]


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    from tests.support.hf_models import add_mtp_head, make_hf_model  # (transformers: imported where used)

    path = tmp_path_factory.mktemp("mtp")
    make_hf_model("qwen3_5_text").save_pretrained(path)
    add_mtp_head(path)
    return str(path)


ENGINES = {
    "ngram": dict(overlap=False, speculative={"method": "ngram", "num_draft_tokens": 2}),
    "ngram-overlapped": dict(overlap=True, speculative={"method": "ngram", "num_draft_tokens": 2,
                                                       "disable_above_batch": 3}),
    "mtp": dict(overlap=False, speculative={"method": "mtp", "num_draft_tokens": 2}),
    "mtp-overlap-on": dict(overlap=True, speculative={"method": "mtp", "num_draft_tokens": 2}),
}


@pytest.fixture(scope="module", params=list(ENGINES), ids=list(ENGINES))
def engine(request):
    path = request.getfixturevalue("mtp_checkpoint") if request.param.startswith("mtp") else str(demo_checkpoint())
    return LLM(path, device="cpu", max_batch=len(PROMPTS), chunk_size=4, **ENGINES[request.param])


def _fails_alone(engine, clean, faulty, victim, message):
    tokens, reason, error = faulty[victim]
    assert reason == "error" and message in error, faulty[victim]
    assert tokens == clean[victim][0][:len(tokens)] and len(tokens) < NEW[victim]
    assert [o for i, o in enumerate(faulty) if i != victim] == [o for i, o in enumerate(clean) if i != victim]
    assert all_free(engine) and not engine.has_work()
    assert _run(engine, _params()) == _expected_clean(engine)  # and the engine is as it was


_CLEAN = {}


def _expected_clean(engine):
    key = id(engine)
    if key not in _CLEAN:
        _CLEAN[key] = _run(engine, _params())
    return _CLEAN[key]


def _verified(engine) -> int:
    return engine.core.speculative.stats.request_steps


@pytest.mark.parametrize("victim", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_nan_logits_in_a_verify_fail_the_row_alone(engine, victim, monkeypatch):
    clean = _expected_clean(engine)
    assert all(reason == "length" for _, reason, _ in clean)
    monkeypatch.setattr(engine.runner, "_forward", engine.runner._forward)  # undone after the test
    _poison(engine, engine._next_rid + victim, ("verify",), 0)
    before = _verified(engine)
    faulty = _run(engine, _params())
    monkeypatch.undo()
    assert _verified(engine) > before
    _fails_alone(engine, clean, faulty, victim, "NaN or infinite")


def test_inf_logits_in_a_verify_fail_the_row_alone(engine, monkeypatch):
    clean = _expected_clean(engine)
    monkeypatch.setattr(engine.runner, "_forward", engine.runner._forward)
    forward, rid = engine.runner._forward, engine._next_rid + SAMPLED

    def infinite(ids, batch, **kw):
        out = forward(ids, batch, **kw)
        req = next((r for r in engine.scheduler.running if r.rid == rid), None)
        if batch.phase == "verify" and req is not None:
            logits = out[0] if isinstance(out, tuple) else out
            logits[batch.slots == req.slot, :, 3] = float("inf")
        return out

    engine.runner._forward = infinite
    faulty = _run(engine, _params())
    monkeypatch.undo()
    _fails_alone(engine, clean, faulty, SAMPLED, "NaN or infinite")


def raising_acceptance(accept_sampled):
    """accept_sampled, but a batch with the marked top_k draws from its generators and then raises."""
    def faulty(logits, drafts, params, generators):
        if any(p.top_k == MARK_TOP_K for p in params):
            for g in generators:  # draws first, as a fault late in the batch would: the retry must not see them
                if g is not None:
                    torch.rand(3, generator=g, device=g.device)
            raise RuntimeError("injected fault\nsecond line")
        return accept_sampled(logits, drafts, params, generators)
    return faulty


def test_an_acceptance_that_raises_fails_its_row_alone(engine, monkeypatch):
    """A fault inside the batched sampled acceptance: each row is accepted again alone (its generator
    as before the batch), and only the row that raises again fails."""
    clean = _run(engine, _params("top_k"))
    monkeypatch.setattr(engine_speculative, "accept_sampled", raising_acceptance(engine_speculative.accept_sampled))
    before = _verified(engine)
    out = _run(engine, _params("top_k"))
    monkeypatch.undo()
    assert _verified(engine) > before
    _fails_alone(engine, clean, out, SAMPLED, "sampling failed: RuntimeError: injected fault")
    assert "second line" not in out[SAMPLED][2]


def test_penalties_that_raise_in_a_verify_fail_the_row_alone(engine, monkeypatch):
    clean = _run(engine, _params("penalty"))
    penalize = engine_speculative.penalize

    def faulty(logits, params, prompts, outputs):
        if any(p.repetition_penalty == MARK_PENALTY for p in params):
            raise ValueError("injected penalty fault")
        return penalize(logits, params, prompts, outputs)

    monkeypatch.setattr(engine_speculative, "penalize", faulty)
    out = _run(engine, _params("penalty"))
    monkeypatch.undo()
    _fails_alone(engine, clean, out, GREEDY, "sampling failed: ValueError: injected penalty fault")
