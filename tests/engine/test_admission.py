"""The step-able engine: requests wait for slots instead of failing, nothing leaks when admission
fails, a request that reaches max_len ends alone with "length", and abort() frees slots at once."""

import pytest
from click.testing import CliRunner

from kvbuffer import LLM, demo_checkpoint
from kvbuffer.cli.main import main
from kvbuffer.engine.sampling import SamplingParams
from kvbuffer.errors import PoolExhaustedError

DEMO = str(demo_checkpoint())
NGRAM = {"method": "ngram", "num_draft_tokens": 3}


def _free(llm):
    caches = llm.runner.caches
    return caches.requests.num_free, caches.states.slots.num_free if caches.states is not None else None


def _full(llm):
    spec = llm.runner.spec
    return spec.max_requests, spec.max_states


def _solo(prompt, max_new_tokens, **kw):
    return LLM(DEMO, device="cpu", **kw).generate([prompt], max_new_tokens=max_new_tokens)[0].token_ids


@pytest.mark.parametrize("mode", ["recurrent", "kvbuffer"])
def test_requests_wait_for_a_state_slot(mode):
    """One state slot for three requests: they take turns (issue 17: PoolExhaustedError and 2 leaked
    request slots before). In mode kvbuffer the prompts outgrow the buffer, so each needs a state."""
    prompts = ["a", "b", "c"] if mode == "recurrent" else ["The quick brown fox jumps ", "def main():\n    ", "x" * 20]
    llm = LLM(DEMO, device="cpu", mode=mode, max_batch=3, max_states=1, chunk_size=8)
    outs = llm.generate(prompts, max_new_tokens=12)
    assert _free(llm) == _full(llm)
    for p, out in zip(prompts, outs):
        assert out.token_ids == _solo(p, 12, mode=mode, chunk_size=8)
    assert llm.generate(prompts, max_new_tokens=3)[0].finish_reason == "length"  # again: nothing leaked
    assert _free(llm) == _full(llm)


def test_a_failed_admission_gives_back_the_request_slot(monkeypatch):
    llm = LLM(DEMO, device="cpu", mode="recurrent", max_batch=2)

    def no_state():
        raise PoolExhaustedError("state pool full")

    monkeypatch.setattr(llm.runner.caches, "allocate_state", no_state)
    with pytest.raises(PoolExhaustedError):
        llm.generate(["a", "b"], max_new_tokens=2)
    assert _free(llm) == _full(llm)
    assert not llm.has_work()
    monkeypatch.undo()
    assert len(llm.generate(["a", "b"], max_new_tokens=2)[1].token_ids) == 2


@pytest.mark.parametrize("speculative", [None, NGRAM], ids=["plain", "ngram"])
@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
def test_a_request_at_max_len_ends_alone_with_length(mode, speculative):
    """max_len=64: "y" * 60 stops after 4 tokens with "length"; "hi" is untouched (before: both
    were thrown away with an error)."""
    llm = LLM(DEMO, device="cpu", mode=mode, max_len=64, speculative=speculative)
    short, long = llm.generate(["hi", "y" * 60], max_new_tokens=10)
    assert long.finish_reason == "length" and len(long.token_ids) == 4
    assert short.token_ids == _solo("hi", 10, mode=mode, max_len=64, speculative=speculative)
    assert long.token_ids == _solo("y" * 60, 10, mode=mode)[:4]  # the same tokens as with room to spare
    assert _free(llm) == _full(llm)


def test_a_prompt_longer_than_max_len_is_rejected_up_front():
    llm = LLM(DEMO, device="cpu", max_len=16)
    with pytest.raises(ValueError, match="prompt 1: 20 tokens exceed max_len=16"):
        llm.generate(["ok", "z" * 20], max_new_tokens=2)
    assert _free(llm) == _full(llm) and not llm.has_work()


def test_step_api_admits_requests_as_they_arrive_and_abort_frees_slots():
    llm = LLM(DEMO, device="cpu", max_batch=2)
    tok = llm.tokenizer
    want = {p: _solo(p, 8) for p in ("The ", "def ", "import ")}
    greedy = SamplingParams(max_new_tokens=8)
    a = llm.add_request(tok.encode("The "), greedy)
    victim = llm.add_request(tok.encode("def "), greedy)
    got = {a: [], victim: []}
    for out in llm.step():
        got[out.rid] += out.token_ids
    c = llm.add_request(tok.encode("import "), greedy)  # arrives mid-flight and waits for a slot
    got[c] = []
    assert llm.runner.caches.requests.num_free == 0
    assert llm.abort(victim).finish_reason == "abort"
    assert llm.runner.caches.requests.num_free == 1  # at once, before the next step
    reasons = {}
    for _ in range(50):  # bounded
        if not llm.has_work():
            break
        for out in llm.step():
            assert out.rid != victim
            got[out.rid] += out.token_ids
            reasons[out.rid] = out.finish_reason or reasons.get(out.rid)
    assert got[a] == want["The "] and got[c] == want["import "]
    assert reasons == {a: "length", c: "length"}
    assert _free(llm) == _full(llm)
    assert llm.abort(a) is None  # done requests are gone


def test_generate_cli_max_len_ends_with_the_text_so_far():
    r = CliRunner().invoke(main, ["generate", "--prompt", "The ", "--max-new-tokens", "3000", "--max-len", "40",
                                  "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "[36 tokens from 1 prompt(s)" in r.output
