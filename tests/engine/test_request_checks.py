"""Every public entry point that takes a request checks its arguments before anything is queued:
SamplingParams in its constructor (one temperature rule, MIN_TEMPERATURE), add_request, generate."""

import math
import threading

import numpy as np
import pytest
import torch

from kvbuffer import LLM, demo_checkpoint
from kvbuffer.engine.sampling import SamplingParams, filtered_rows
from kvbuffer.engine.validate import MIN_TEMPERATURE
from tests.support.pool_slots import all_free

DEMO = str(demo_checkpoint())

PARAMS_CASES = {
    "temperature 5e-324": (dict(temperature=5e-324), ValueError, "temperature must be 0 \\(greedy\\) or a number >="),
    "temperature 1e-40": (dict(temperature=1e-40), ValueError, "temperature must be 0 \\(greedy\\) or"),
    "temperature 1.2e-38": (dict(temperature=1.2e-38), ValueError, "got 1.2e-38"),
    "temperature below the minimum": (dict(temperature=MIN_TEMPERATURE / 2), ValueError, "temperature"),
    "temperature negative": (dict(temperature=-0.5), ValueError, "temperature"),
    "temperature nan": (dict(temperature=math.nan), ValueError, "temperature must be finite, got nan"),
    "temperature inf": (dict(temperature=math.inf), ValueError, "temperature must be finite"),
    "temperature string": (dict(temperature="1"), TypeError, "temperature must be a number, got str"),
    "temperature bool": (dict(temperature=True), TypeError, "temperature must be a number, got bool"),
    "max_new_tokens string": (dict(max_new_tokens="3"), TypeError, "max_new_tokens must be an int, got str"),
    "max_new_tokens float": (dict(max_new_tokens=3.0), TypeError, "max_new_tokens must be an int, got float"),
    "max_new_tokens zero": (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    "top_k float": (dict(top_k=2.5), TypeError, "top_k must be an int"),
    "top_k negative": (dict(top_k=-1), ValueError, "top_k must be >= 0"),
    "top_p nan": (dict(top_p=math.nan), ValueError, "top_p must be finite"),
    "top_p zero": (dict(top_p=0.0), ValueError, "top_p must be in \\(0, 1\\]"),
    "top_p string": (dict(top_p="0.5"), TypeError, "top_p must be a number"),
    "seed float": (dict(seed=1.0), TypeError, "seed must be a Python int or None"),
    "seed negative": (dict(seed=-1), ValueError, "seed must be in \\[0, "),
    "stop ids dict": (dict(stop_token_ids={1: 2}), TypeError, "stop_token_ids must be a list of token ids or None"),
    "stop ids string": (dict(stop_token_ids="12"), TypeError, "stop_token_ids must be a list"),
    "stop id negative": (dict(stop_token_ids=(3, -1)), ValueError, "stop_token_ids entry must be >= 0"),
    "stop id float": (dict(stop_token_ids=[1.0]), TypeError, "stop_token_ids entry must be an int"),
    "logprobs int": (dict(logprobs=1), TypeError, "logprobs must be True or False"),
    "penalty string": (dict(presence_penalty="0"), TypeError, "presence_penalty must be a number"),
    "penalty nan": (dict(frequency_penalty=math.nan), ValueError, "frequency_penalty must be finite"),
}


@pytest.mark.parametrize("case", PARAMS_CASES, ids=list(PARAMS_CASES))
def test_sampling_params_check_every_field_in_their_constructor(case):
    kwargs, err, msg = PARAMS_CASES[case]
    with pytest.raises(err, match=msg):
        SamplingParams(**kwargs)


def test_sampling_params_hold_plain_values():
    p = SamplingParams(np.int64(5), 1, top_k=np.int32(3), seed=7, stop_token_ids=[np.int64(2), 3])
    assert (p.max_new_tokens, p.temperature, p.top_k, p.stop_token_ids) == (5, 1.0, 3, (2, 3))
    assert type(p.max_new_tokens) is int and type(p.temperature) is float and type(p.stop_token_ids[0]) is int
    assert SamplingParams(stop_token_ids={4}).stop_token_ids == (4,)
    assert SamplingParams(temperature=0).temperature == 0.0 and SamplingParams(temperature=MIN_TEMPERATURE)


def test_the_smallest_temperature_keeps_extreme_logits_a_distribution():
    """At MIN_TEMPERATURE, fp32 logits up to 1e36 in size still divide to finite values."""
    logits = torch.tensor([[1e36, -1e36, 0.0, 3e35], [2.0, 1.0, 0.0, -1.0]])
    probs = filtered_rows(logits, [SamplingParams(temperature=MIN_TEMPERATURE)] * 2)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))


@pytest.fixture(scope="module")
def llm():
    return LLM(DEMO, device="cpu", max_batch=2, chunk_size=4, max_len=64)


ADD_CASES = {
    "stop id outside the vocabulary": (dict(params=SamplingParams(stop_token_ids=(10**6,))), ValueError,
                                       "stop_token_ids entry 1000000 is outside the vocabulary \\[0, 257\\)"),
    "stop id one past the vocabulary": (dict(params=SamplingParams(stop_token_ids=(1, 257))), ValueError,
                                        "stop_token_ids entry 257"),
    "float token id": (dict(prompt_ids=[5, 3.7]), TypeError, "prompt_ids has token id float 3.7"),
    "bool token id": (dict(prompt_ids=[True]), TypeError, "prompt_ids has token id bool"),
    "string prompt": (dict(prompt_ids="ab"), TypeError, "prompt_ids must be a list of token ids, got str"),
    "0-d tensor": (dict(prompt_ids=torch.tensor(5)), TypeError, "prompt_ids must be a 1-D integer tensor"),
    "meta tensor": (dict(prompt_ids=torch.tensor([5, 6], device="meta")), TypeError, "meta device"),
    "float tensor": (dict(prompt_ids=torch.tensor([5.0])), TypeError,
                     "1-D integer tensor of token ids, got torch.float32"),
    "2-D tensor": (dict(prompt_ids=torch.tensor([[5, 6]])), TypeError, "1-D integer tensor"),
    "id outside the vocabulary": (dict(prompt_ids=[5, 257]), ValueError, "token id 257 outside the vocabulary"),
    "empty": (dict(prompt_ids=[]), ValueError, "prompt_ids is empty"),
    "params a dict": (dict(params={"temperature": 1.0}), TypeError, "params must be a SamplingParams"),
    "return_logits int": (dict(return_logits=1), TypeError, "return_logits must be True or False"),
}


@pytest.mark.parametrize("case", ADD_CASES, ids=list(ADD_CASES))
def test_add_request_refuses_before_queueing(llm, case):
    kwargs, err, msg = ADD_CASES[case]
    kwargs = {"prompt_ids": [5, 6], "params": SamplingParams(3), **kwargs}
    rid = llm._next_rid
    with pytest.raises(err, match=msg):
        llm.add_request(**kwargs)
    assert not llm.has_work() and llm._next_rid == rid and all_free(llm)


def test_add_request_takes_an_integer_tensor(llm):
    rid = llm.add_request(torch.tensor([5, 6], dtype=torch.int32), SamplingParams(3))
    while llm.has_work():
        llm.step()
    assert llm.abort(rid) is None and all_free(llm)


GENERATE_CASES = {
    "stop ids dict": (dict(stop_token_ids={1: 2}), TypeError,
                      "stop_token_ids must be a list of token ids or None, got dict"),
    "0-d tensor prompt": (dict(prompts=[torch.tensor(5)]), TypeError, "prompt 0 must be a 1-D integer tensor"),
    "meta tensor prompt": (dict(prompts=[[5], torch.tensor([5], device="meta")]), TypeError,
                           "prompt 1 is a tensor on the meta device"),
    "temperature 1e-40": (dict(temperature=1e-40), ValueError, "temperature must be 0 \\(greedy\\) or"),
    "seed past the limit for two prompts": (dict(prompts=[[5], [6]], seed=2**63 - 1), ValueError,
                                            "seed must be at most 9223372036854775806 for 2 prompts"),
    "penalty string": (dict(repetition_penalty="2"), TypeError, "repetition_penalty must be a number"),
}


@pytest.mark.parametrize("case", GENERATE_CASES, ids=list(GENERATE_CASES))
def test_generate_refuses_before_anything_runs(llm, case):
    kwargs, err, msg = GENERATE_CASES[case]
    kwargs = {"prompts": [[5, 6]], "max_new_tokens": 2, **kwargs}
    with pytest.raises(err, match=msg):
        llm.generate(**kwargs)
    assert not llm.has_work() and all_free(llm)


def test_generate_from_four_threads_at_once_gives_each_its_own_outputs():
    """generate() holds the engine's lock: concurrent calls run in turn, each with its own results
    (unserialised, they raced on the idle check and lost both outputs)."""
    llm = LLM(DEMO, device="cpu", max_batch=3, chunk_size=4, max_len=64)
    prompts = [[[5 + t, 6, 7], [9, t + 1]] for t in range(4)]
    want = [[o.token_ids for o in llm.generate(p, max_new_tokens=6, stop_token_ids=[])] for p in prompts]
    start, got, errors = threading.Barrier(4), [None] * 4, []

    def work(t):
        start.wait()
        try:
            for _ in range(2):
                got[t] = [o.token_ids for o in llm.generate(prompts[t], max_new_tokens=6, stop_token_ids=[])]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors and got == want
    assert all_free(llm) and not llm.has_work()


@pytest.mark.parametrize("rid", ["3", 3.0, None, True], ids=["str", "float", "None", "bool"])
def test_abort_takes_a_request_id(llm, rid):
    with pytest.raises(TypeError, match="rid must be a request id"):
        llm.abort(rid)
    assert llm.abort(10**9) is None  # an unknown id: nothing to stop


def test_token_ids_are_plain_python_ints_whatever_integers_come_in():
    """A prompt of exact ints is taken as it is (a copy); numpy integers become ints; a bool or a float
    anywhere in it is refused, as at its first position."""
    from kvbuffer.engine.validate import token_ids

    ids = [3, 1, 4]
    got = token_ids(ids, "prompt_ids")
    assert got == ids and got is not ids
    mixed = token_ids((np.int64(7), 5), "prompt_ids")
    assert mixed == [7, 5] and all(type(t) is int for t in mixed)
    for bad in ([1] * 1000 + [True], [1] * 1000 + [2.0]):
        with pytest.raises(TypeError, match="prompt_ids has token id"):
            token_ids(bad, "prompt_ids")
