"""`LLM(...)` and `generate(...)` reject wrong types and values with an error naming the argument,
and a rejected call leaves every pool as it was."""

import math

import pytest
import torch

from kvbuffer import LLM, demo_checkpoint
from kvbuffer.engine.config import SpeculativeConfig
from tests.support.pool_slots import free_slots

NO_CUDA = not torch.cuda.is_available()
DEMO = str(demo_checkpoint())

LLM_CASES = {
    "max_batch bool": (dict(max_batch=True), TypeError, "max_batch must be an int, got bool"),
    "max_batch float": (dict(max_batch=2.0), TypeError, "max_batch must be an int, got float"),
    "max_len negative": (dict(max_len=-5), ValueError, "max_len must be >= 1, got -5"),
    "max_prefill_tokens zero": (dict(max_prefill_tokens=0), ValueError, "max_prefill_tokens must be >= 1"),
    "prefill_tokens_while_decoding zero": (dict(prefill_tokens_while_decoding=0), ValueError,
                                           "prefill_tokens_while_decoding must be >= 1, got 0"),
    "prefill_tokens_while_decoding above max_prefill_tokens": (
        dict(max_prefill_tokens=64, prefill_tokens_while_decoding=65), ValueError,
        r"prefill_tokens_while_decoding \(65\) must not exceed max_prefill_tokens \(64\)"),
    "max_states zero": (dict(max_states=0), ValueError, "max_states must be >= 1"),
    "chunk_size float": (dict(chunk_size=4.5), TypeError, "chunk_size must be an int or None"),
    "device banana": (dict(device="banana"), ValueError, "device must be 'cpu', 'cuda' or 'cuda:N', got 'banana'"),
    "device meta": (dict(device="meta"), ValueError, "device must be 'cpu', 'cuda' or 'cuda:N', got 'meta'"),
    "device int": (dict(device=3.5), TypeError, "device must be a str or torch.device"),
    "dtype string": (dict(dtype="bf16"), TypeError, "dtype must be a floating torch.dtype"),
    "dtype int": (dict(dtype=torch.int32), TypeError, "dtype must be a floating torch.dtype"),
    "speculative string": (dict(speculative="ngram"), TypeError, "speculative must be a dict"),
    "speculative float count": (dict(speculative={"method": "ngram", "num_draft_tokens": 2.0}), TypeError,
                                "speculative num_draft_tokens must be an int, got float"),
    "speculative bool count": (dict(speculative={"method": "ngram", "num_draft_tokens": True}), TypeError,
                               "speculative num_draft_tokens must be an int, got bool"),
    "speculative ngram_min > ngram_max": (
        dict(speculative={"method": "ngram", "num_draft_tokens": 2, "ngram_min": 3, "ngram_max": 2}), ValueError,
        "ngram_min <= ngram_max, got ngram_min=3, ngram_max=2"),
    "speculative disable_above_batch 0": (
        dict(speculative={"method": "ngram", "num_draft_tokens": 2, "disable_above_batch": 0}), ValueError,
        "disable_above_batch must be >= 1, got 0"),
    "speculative disable_above_batch float": (
        dict(speculative={"method": "ngram", "num_draft_tokens": 2, "disable_above_batch": 8.0}), TypeError,
        "disable_above_batch must be an int or None, got float"),
    "speculative disable_above_batch with mtp": (
        dict(speculative={"method": "mtp", "num_draft_tokens": 2, "disable_above_batch": 8}), ValueError,
        "disable_above_batch needs method 'ngram'"),
    "speculative without count": (dict(speculative={"method": "ngram"}), ValueError, "lacks \\['num_draft_tokens'\\]"),
    "memory_budget string": (dict(memory_budget="1GiB"), TypeError, "memory_budget must be an int, got str"),
    "memory_budget 1e15 float": (dict(memory_budget=1e15), TypeError, "memory_budget must be an int, got float"),
    "memory_budget beyond the device": (dict(memory_budget=10**18), ValueError, "more than the device has"),
    "kernels 1": (dict(kernels=1), ValueError, "kernels must be True, False or 'auto', got int 1"),
    "cuda_graphs string": (dict(cuda_graphs="yes"), ValueError, "cuda_graphs must be True, False or 'auto'"),
    "model int": (dict(model=42), TypeError, "model must be a checkpoint directory or a kvbuffer model"),
}


@pytest.mark.parametrize("case", LLM_CASES, ids=list(LLM_CASES))
def test_bad_llm_arguments(case):
    kwargs, err, msg = LLM_CASES[case]
    kwargs = dict(kwargs)
    model = kwargs.pop("model", DEMO)
    with pytest.raises(err, match=msg):
        LLM(model, **{"device": "cpu", **kwargs})


@pytest.mark.skipif(not NO_CUDA, reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_cuda(device):
    with pytest.raises(ValueError, match="torch sees no CUDA GPU here"):
        LLM(DEMO, device=device)


@pytest.fixture(scope="module")
def llm():
    return LLM(DEMO, device="cpu", max_batch=3, chunk_size=4)


GENERATE_CASES = {
    "max_new_tokens float": (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an int, got float 2.5"),
    "max_new_tokens bool": (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an int, got bool"),
    "token id float": (dict(prompts=[[5, 3.7]]), TypeError, "prompt 0 has token id float 3.7"),
    "flat token id float": (dict(prompts=[5, 3.7]), TypeError, "prompt 0 has token id float 3.7"),
    "token id bool": (dict(prompts=[[5, True]]), TypeError, "token id bool True"),
    "float tensor prompt": (dict(prompts=[torch.tensor([1.0, 2.0])]), TypeError, "1-D integer tensor"),
    "prompt of the wrong type": (dict(prompts=[{"text": "a"}]), TypeError, "prompt 0 must be a string or a list"),
    "temperature nan": (dict(temperature=math.nan), ValueError, "temperature must be finite, got nan"),
    "temperature inf": (dict(temperature=math.inf), ValueError, "temperature must be finite"),
    "temperature string": (dict(temperature="0.5"), TypeError, "temperature must be a number, got str"),
    "top_p nan": (dict(top_p=math.nan), ValueError, "top_p must be finite"),
    "top_k float": (dict(top_k=1.5), TypeError, "top_k must be an int"),
    "seed float": (dict(seed=1e23), TypeError, "seed must be a Python int or None, got float"),
    "seed numpy": (dict(seed=__import__("numpy").int64(3)), TypeError, "seed must be a Python int or None"),
    "seed too large": (dict(seed=10**23), ValueError, "seed must be in \\[0, "),
    "seed negative": (dict(seed=-1), ValueError, "seed must be in \\[0, "),
    "stop id float": (dict(stop_token_ids=[1.5]), TypeError, "stop_token_ids entry must be an int"),
    "stop id outside vocab": (dict(stop_token_ids=[100000]), ValueError, "stop_token_ids entry must be in \\[0, 256\\]"),
    "stop ids a string": (dict(stop_token_ids="ab"), TypeError, "stop_token_ids must be a list"),
    "return_logits int": (dict(return_logits=1), TypeError, "return_logits must be True or False"),
    "on_token not callable": (dict(on_token=5), TypeError, "on_token must be a callable"),
}


@pytest.mark.parametrize("case", GENERATE_CASES, ids=list(GENERATE_CASES))
def test_bad_generate_arguments_leave_the_pools_free(llm, case):
    kwargs, err, msg = GENERATE_CASES[case]
    kwargs = dict(kwargs)
    prompts = kwargs.pop("prompts", ["ab", "cd"])
    before = free_slots(llm)
    with pytest.raises(err, match=msg):
        llm.generate(prompts, **{"max_new_tokens": 2, **kwargs})
    assert free_slots(llm) == before
    assert llm.generate([[5, 6]], max_new_tokens=2)[0].finish_reason == "length"  # still usable


def test_good_arguments_of_other_int_types_still_work(llm):
    """numpy-style integers are ints; integer tensors are token ids."""
    import numpy as np

    a = llm.generate([[5, np.int64(6)]], max_new_tokens=np.int32(3), seed=1, temperature=1)
    b = llm.generate([torch.tensor([5, 6])], max_new_tokens=3, seed=1, temperature=1.0)
    assert a[0].token_ids == b[0].token_ids and len(a[0].token_ids) == 3


def test_speculative_config_defaults_still_hold():
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_draft_tokens": 3}).ngram_min == 1


def test_stop_ids_from_a_generator_are_refused_not_consumed(llm):
    with pytest.raises(TypeError, match="stop_token_ids must be a list"):
        llm.generate([[5]], max_new_tokens=2, stop_token_ids=(t for t in [1]))
