"""On CUDA, overlapped decode steps (picks held on the device, read back a step later) and verify steps:
one request's NaN logits, or a sampled acceptance that raises after drawing from the seeded CUDA
generators, finish it alone with finish_reason "error"; the others' tokens equal a run without the
fault. CUDA graphs are off so that the fault can be injected after each forward."""

import pytest

from kvbuffer import LLM, demo_checkpoint
from kvbuffer.engine import speculative as engine_speculative
from tests.engine import test_speculative_row_errors as spec
from tests.engine.test_row_errors import PARAMS, _poison, _run
from tests.support.pool_slots import all_free

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("options", [dict(overlap=True), dict(speculative={"method": "ngram", "num_draft_tokens": 3})],
                         ids=["overlapped", "speculative"])
@pytest.mark.parametrize("victim", [1, 2], ids=["sampled", "greedy"])
def test_a_row_of_nan_logits_fails_alone_on_cuda(options, victim, monkeypatch):
    llm = LLM(str(demo_checkpoint()), device="cuda", max_batch=len(PARAMS), chunk_size=4, cuda_graphs=False, **options)
    clean = _run(llm)
    monkeypatch.setattr(llm.runner, "_forward", llm.runner._forward)
    _poison(llm, llm._next_rid + victim, ("decode", "verify"), 2)
    faulty = _run(llm)
    tokens, reason, error = faulty[victim]
    assert reason == "error" and "NaN or infinite" in error and tokens == clean[victim][0][:len(tokens)]
    assert [o for i, o in enumerate(faulty) if i != victim] == [o for i, o in enumerate(clean) if i != victim]
    assert all_free(llm) and not llm.has_work()


@pytest.mark.parametrize("name", ["ngram", "ngram-overlapped"])
def test_an_acceptance_that_raises_fails_its_row_alone_on_cuda(name, monkeypatch):
    llm = LLM(str(demo_checkpoint()), device="cuda", max_batch=5, chunk_size=4, cuda_graphs=False,
              **spec.ENGINES[name])
    clean = spec._run(llm, spec._params("top_k"))
    faulty = spec.raising_acceptance(engine_speculative.accept_sampled)
    monkeypatch.setattr(engine_speculative, "accept_sampled", faulty)
    out = spec._run(llm, spec._params("top_k"))
    monkeypatch.undo()
    victim = spec.SAMPLED
    assert out[victim][1:] == ("error", "sampling failed: RuntimeError: injected fault")
    assert out[victim][0] == clean[victim][0][:len(out[victim][0])]
    assert [o for i, o in enumerate(out) if i != victim] == [o for i, o in enumerate(clean) if i != victim]
    assert all_free(llm) and not llm.has_work()
