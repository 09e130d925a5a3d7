"""Random request bodies thrown at /v1/completions and /v1/chat/completions on the demo model,
in-process: every body gets a 2xx (a stream ending in [DONE], with no 5xx error event) or a 4xx
with OpenAI's error object, never a 5xx; and a normal greedy request after it returns the text it
returned before. Examples are bounded (derandomized, small max_tokens) so the default run stays a
CI test; the `slow` version draws ten times as many."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from kvbuffer import LLM, demo_checkpoint  # noqa: E402
from kvbuffer.engine.outputs import StepOutput  # noqa: E402
from kvbuffer.serve.app import build_app  # noqa: E402
from kvbuffer.serve.engine_loop import AsyncEngine  # noqa: E402

EXAMPLES = 40
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
NORMAL = {"prompt": "The ", "max_tokens": 6, "temperature": 0}

# A value whose row the engine must fail alone (a sampling temperature so small that the logits
# overflow, a repetition penalty that makes them infinite) is drawn only from an engine that does
# so (its StepOutput carries `error`); before that, such a value fails its whole step.
ROWS_FAIL_ALONE = "error" in {f.name for f in dataclasses.fields(StepOutput)}

TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)  # lone surrogates included
TOKEN = st.one_of(st.integers(0, 256), st.integers(-3, 300), st.sampled_from([2**31, 2**63, 2**70]))
WILD = st.recursive(st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
if ROWS_FAIL_ALONE:
    TEMPERATURE = st.one_of(st.just(0), st.floats(-1, 3), st.sampled_from([5e-324, 1e-40, 1.2e-38, 1e-3]))
    REPETITION = st.one_of(st.floats(-1, 5), st.sampled_from([5e-324, 1e-300, 1e300]))
else:
    TEMPERATURE = st.one_of(st.just(0), st.floats(-1, 0), st.floats(1e-3, 3))
    REPETITION = st.one_of(st.floats(-1, 0), st.floats(1e-3, 5), st.just(1e300))

SAMPLING = {
    "max_tokens": st.integers(-1, 6) | st.sampled_from([2**31, 2**63]),
    "temperature": TEMPERATURE,
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 300) | st.just(2**62),
    "n": st.integers(-1, 4),
    "seed": st.integers(-5, 2**64),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": REPETITION,
    "stop": st.none() | TEXT | st.lists(TEXT | TOKEN, max_size=3),
    "stream": st.booleans(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "model": st.none() | st.just("demo") | TEXT,
    "user": TEXT,
}
COMPLETION = dict(SAMPLING, prompt=st.one_of(TEXT, st.lists(TEXT, max_size=3), st.lists(TOKEN, max_size=8),
                                             st.lists(st.lists(TOKEN, max_size=4), max_size=3)),
                  logprobs=st.none() | st.integers(-1, 2))
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"]),
     "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                       "text": TEXT}), max_size=2)},
    optional={"name": TEXT})
CHAT = dict(SAMPLING, messages=st.lists(MESSAGE, max_size=3), logprobs=st.booleans(),
            max_completion_tokens=st.none() | st.integers(-1, 6), top_logprobs=st.none() | st.integers(-1, 1))


def bodies(fields: dict):
    """Dicts of some of `fields` (each mostly drawn from its own strategy, sometimes any JSON value),
    sometimes with a field no schema has."""
    values = {name: st.one_of(strategy, strategy, strategy, WILD) for name, strategy in fields.items()}
    extra = st.dictionaries(st.sampled_from(["echo", "best_of", "suffix", "x"]), WILD, max_size=1)
    return st.tuples(st.fixed_dictionaries({}, optional=values), extra).map(lambda d: {**d[0], **d[1]})


ROUTES = st.one_of(st.tuples(st.just("/v1/completions"), bodies(COMPLETION)),
                   st.tuples(st.just("/v1/chat/completions"), bodies(CHAT)))


@pytest.fixture(scope="module")
def served():
    """(a client of an in-process server on the demo model, the normal request's text)."""
    torch.set_num_threads(1)
    llm = LLM(str(demo_checkpoint()), device="cpu", max_batch=4, max_len=48)
    with TestClient(build_app(AsyncEngine(llm, max_waiting=4), "demo"), raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json=NORMAL)
        assert r.status_code == 200
        yield client, r.json()["choices"][0]["text"]


def check(served, route: str, body: dict) -> None:
    client, normal = served
    r = client.post(route, content=json.dumps(body))  # json.dumps escapes lone surrogates as \udXXX
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["code"] == r.status_code and err["type"], (body, r.text)
    elif body.get("stream") is True:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", (body, r.text)
        errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
        assert all(e["code"] < 500 for e in errors), (body, errors)
    else:
        assert r.json()["choices"], (body, r.text)
    after = client.post("/v1/completions", json=NORMAL)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == normal, (body, after.text)


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(request=ROUTES)
def test_any_body_gets_a_2xx_or_a_json_4xx_and_changes_nothing(served, request):
    check(served, *request)


@pytest.mark.slow
@settings(max_examples=10 * EXAMPLES, **SETTINGS)
@given(request=ROUTES)
def test_any_body_gets_a_2xx_or_a_json_4xx_and_changes_nothing_many(served, request):
    check(served, *request)
