"""Random values and types thrown at `LLM(...)` and `generate(...)` on the demo checkpoint.

Every call either raises a typed error (a KVBufferError, ValueError or TypeError) or returns a
well-formed result, and a rejected generate leaves every pool slot free. Examples and deadlines
are bounded so the file stays a CI test; sizes are drawn small so that a call that is accepted
allocates little.
"""

import math
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbuffer import LLM, KVBufferError, demo_checkpoint
from tests.support.pool_slots import all_free, free_slots

DEMO = str(demo_checkpoint())
TYPED = (KVBufferError, ValueError, TypeError)
BOUNDED = settings(max_examples=25, deadline=timedelta(seconds=20), derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Values of the wrong type or out of range, mixed with plausible ones.
WILD = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.lists(st.integers(-1, 300), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)


def _maybe(good, wild=WILD):
    """Mostly well-typed values (so accepted calls happen too), sometimes anything."""
    return st.one_of(good, wild)


def _check_outputs(llm, outs, n_prompts, max_new_tokens):
    assert len(outs) == n_prompts
    for o in outs:
        assert 1 <= len(o.token_ids) <= max_new_tokens
        assert all(isinstance(t, int) and 0 <= t < llm.vocab_size for t in o.token_ids)
        assert o.finish_reason in ("stop", "length")
        assert o.finish_reason == "stop" or len(o.token_ids) == max_new_tokens


LLM_ARGS = st.fixed_dictionaries({}, optional={
    "device": st.sampled_from(["cpu", "banana", "cuda", "cuda:7", 3, torch.device("cpu"), "meta"]),
    "dtype": _maybe(st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([torch.int64, "bf16", 16])),
    "mode": _maybe(st.sampled_from(["kvbuffer", "recurrent"])),
    "chunk_size": _maybe(st.integers(1, 8)),
    "max_batch": _maybe(st.integers(1, 4)),
    "max_states": _maybe(st.integers(1, 4)),
    "max_len": _maybe(st.integers(8, 64)),
    "max_prefill_tokens": _maybe(st.integers(1, 32)),
    "speculative": _maybe(st.fixed_dictionaries(
        {"method": st.sampled_from(["ngram", "mtp", "eagle"]), "num_draft_tokens": _maybe(st.integers(1, 4))},
        optional={"ngram_min": _maybe(st.integers(1, 3)), "ngram_max": _maybe(st.integers(1, 3)),
                  "disable_above_batch": _maybe(st.integers(1, 4), st.sampled_from([0, 2.0, "8"]))})),
    "memory_budget": _maybe(st.integers(10**6, 10**8), st.one_of(WILD, st.just(10**18), st.just(1e15))),
    "kernels": _maybe(st.sampled_from([False, "auto"]), st.sampled_from([True, 1, "yes", None])),
    "cuda_graphs": _maybe(st.sampled_from([False, "auto"]), st.sampled_from([True, 0, "no", None])),
})


@BOUNDED
@given(kwargs=LLM_ARGS)
def test_llm_arguments_are_typed_errors_or_a_working_engine(kwargs):
    if torch.cuda.is_available():  # the property is about the checks; keep accepted runs on the CPU
        kwargs["device"] = "cpu"
    kwargs.setdefault("device", "cpu")
    try:
        llm = LLM(DEMO, **kwargs)
    except TYPED as e:
        event(f"LLM rejected: {type(e).__name__}")
        return
    event("LLM accepted")
    outs = llm.generate([[5, 6, 7], "ab"], max_new_tokens=3)
    _check_outputs(llm, outs, 2, 3)
    assert all_free(llm)


@pytest.fixture(scope="module")
def llm():
    return LLM(DEMO, device="cpu", max_batch=2, max_len=64, chunk_size=4)


TOKENS = st.lists(st.integers(0, 256), min_size=1, max_size=6)
PROMPTS = st.one_of(
    st.text(min_size=1, max_size=8), TOKENS, st.lists(st.one_of(st.text(min_size=1, max_size=6), TOKENS), min_size=1,
                                                       max_size=3),
    WILD, st.lists(st.one_of(st.integers(-5, 400), st.floats(), st.booleans()), max_size=3),
)
GENERATE_ARGS = st.fixed_dictionaries({"prompts": PROMPTS}, optional={
    "max_new_tokens": _maybe(st.integers(1, 4)),
    "temperature": _maybe(st.floats(0, 2)),
    "top_k": _maybe(st.integers(0, 5)),
    "top_p": _maybe(st.floats(0.05, 1)),
    "seed": _maybe(st.integers(0, 2**64), st.one_of(WILD, st.just(10**23), st.just(1e23))),
    "stop_token_ids": _maybe(st.lists(st.integers(0, 256), max_size=2)),
    "return_logits": _maybe(st.booleans()),
})


@BOUNDED
@given(kwargs=GENERATE_ARGS)
def test_generate_arguments_are_typed_errors_or_correct_outputs(llm, kwargs):
    prompts = kwargs.pop("prompts")
    kwargs.setdefault("max_new_tokens", 3)
    assert all_free(llm)
    before = free_slots(llm)
    try:
        outs = llm.generate(prompts, **kwargs)
    except TYPED as e:
        event(f"generate rejected: {type(e).__name__}")
        assert free_slots(llm) == before  # a rejected call took nothing
        return
    event("generate accepted")
    n = 1 if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else len(prompts)
    _check_outputs(llm, outs, n, kwargs["max_new_tokens"])
    if kwargs.get("return_logits"):
        assert all(len(o.logits) == len(o.token_ids) and all(math.isfinite(float(x.sum())) for x in o.logits)
                   for o in outs)
    assert free_slots(llm) == before
