"""Every size is planned before anything is allocated: sizes whose caches cannot fit in the device's
free memory are a ValueError naming the argument and the bytes needed and free, raised before any
pool (or slot list) is made."""

import pytest

from kvbuffer import LLM, demo_checkpoint
from kvbuffer.engine import llm as llm_module
from kvbuffer.plan import check_fits
from kvbuffer.pools import SlotAllocator

DEMO = str(demo_checkpoint())
TOO_BIG = {
    "chunk_size 10**6": (dict(chunk_size=10**6), "chunk_size=1000000"),
    "chunk_size 10**9": (dict(chunk_size=10**9), "chunk_size=1000000000"),
    "max_batch 10**7": (dict(max_batch=10**7), "max_batch=10000000"),
    "max_batch 10**9": (dict(max_batch=10**9), "max_batch=1000000000"),
    "max_len 10**7": (dict(max_len=10**7, max_batch=64), "max_len=10000000"),
    "max_len 10**9": (dict(max_len=10**9), "max_len=1000000000"),
    "max_states 10**8": (dict(max_states=10**8), "max_states=100000000"),
    "max_states 10**9": (dict(max_states=10**9), "max_states=1000000000"),
    "recurrent max_states 10**9": (dict(max_states=10**9, mode="recurrent"), "max_states=1000000000"),
    "speculative max_len 10**9": (dict(max_len=10**9, speculative={"method": "ngram", "num_draft_tokens": 2}),
                                  "max_len=1000000000"),
}


@pytest.fixture
def nothing_allocated(monkeypatch):
    """Fail the test if the engine starts building its runner or any slot list."""
    def refuse(*args, **kwargs):
        raise AssertionError("a pool was about to be made before the sizes were checked")

    monkeypatch.setattr(llm_module, "ModelRunner", refuse)
    monkeypatch.setattr(SlotAllocator, "__init__", refuse)


@pytest.mark.parametrize("case", TOO_BIG, ids=list(TOO_BIG))
def test_sizes_that_cannot_fit_are_refused_before_any_pool(case, nothing_allocated):
    kwargs, name = TOO_BIG[case]
    with pytest.raises(ValueError, match=rf"{name}.*the caches would need [\d,]+ B \(\w+ [\d,]+ B\), more than "
                                         rf"the [\d,]+ B free on cpu"):
        LLM(DEMO, device="cpu", **kwargs)


def test_a_budget_and_the_free_memory_decide_together(monkeypatch):
    from kvbuffer.engine import validate

    ok = LLM(DEMO, device="cpu", max_batch=4, chunk_size=8)  # small sizes still fit
    need = sum(ok.runner.spec.nbytes(ok.dtype).values())
    monkeypatch.setattr(validate, "free_memory", lambda device: need - 1)
    with pytest.raises(ValueError, match=f"the caches would need {need:,} B .* more than the {need - 1:,} B free"):
        LLM(DEMO, device="cpu", max_batch=4, chunk_size=8)
    with pytest.raises(ValueError, match="memory_budget=100000000"):  # a budget's requests count against it too
        LLM(DEMO, device="cpu", memory_budget=10**8)


def test_check_fits_names_the_largest_part():
    assert check_fits({"a": 3, "b": 4}, 7, {"a": "x=1", "b": "y=2"}, "cpu") == 7
    with pytest.raises(ValueError, match=r"^y=2: the caches would need 8 B \(b 5 B\), more than the 7 B free on cuda:1$"):
        check_fits({"a": 3, "b": 5}, 7, {"a": "x=1", "b": "y=2"}, "cuda:1")
