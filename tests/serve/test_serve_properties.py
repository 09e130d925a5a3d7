"""Random request bodies thrown at /v1/completions and /v1/chat/completions on the demo model,
in-process: every body gets a 2xx (a stream ending in [DONE], with no 5xx error event) or a 4xx
with OpenAI's error object, never a 5xx; and a normal greedy request after it returns the text it
returned before. Examples are bounded (derandomized, small max_tokens) so the default run stays a
CI test; the `slow` version draws ten times as many."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from kvbuffer import LLM, demo_checkpoint  # noqa: E402
from kvbuffer.serve.app import build_app  # noqa: E402
from kvbuffer.serve.engine_loop import AsyncEngine  # noqa: E402

EXAMPLES = 40
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
NORMAL = {"prompt": "The ", "max_tokens": 6, "temperature": 0}
JSON = {"content-type": "application/json"}

CHARACTER = st.one_of(st.sampled_from("The ab1\n"), st.characters(codec=None, exclude_categories=()),
                      st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=()))
TEXT = st.text(CHARACTER, max_size=12)  # lone surrogates (which json.dumps escapes) included
TOKEN = st.integers(0, 256)
WILD = st.recursive(st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
ROUGH_TOKEN = st.one_of(TOKEN, st.integers(-3, 300), st.sampled_from([2**31, 2**63, 2**70]))
COERCED = st.sampled_from([True, False, "1", 1.0, 0.0, "true", None, [], {}])
# values the engine refuses (temperatures below its minimum) or whose row it fails alone (a repetition
# penalty that makes the logits infinite) are drawn too
TEMPERATURE = st.one_of(st.just(0), st.floats(0, 2), st.sampled_from([5e-324, 1e-40, 1.2e-38, 1e-3]))
REPETITION = st.one_of(st.floats(0, 5, exclude_min=True), st.sampled_from([5e-324, 1e-300, 1e300]))

# Each field's values that the server takes, and values it must refuse (or that sit on an edge).
SAMPLING = {
    "max_tokens": (st.integers(1, 6), st.integers(-2, 0) | st.sampled_from([2**31, 2**63, 2**64])),
    "temperature": (TEMPERATURE, st.floats(-1, 0, exclude_max=True) | st.floats(2, 1e300, exclude_min=True)
                    | st.sampled_from([float("nan"), float("inf")])),
    "top_p": (st.floats(0, 1, exclude_min=True), st.floats(-1, 0) | st.floats(1, 2, exclude_min=True)),
    "top_k": (st.integers(-1, 300) | st.just(2**62), st.integers(-(2**63), -2)),
    "n": (st.integers(1, 3), st.integers(-1, 0) | st.integers(17, 2**40)),
    "seed": (st.integers(0, 2**63 - 1), st.integers(-(2**63), -1) | st.integers(2**63, 2**65)),
    "presence_penalty": (st.floats(-2, 2), st.floats(2, 10, exclude_min=True)),
    "frequency_penalty": (st.floats(-2, 2), st.floats(-10, -2, exclude_max=True)),
    "repetition_penalty": (REPETITION, st.floats(-5, 0)),
    "stop": (st.none() | TEXT | st.lists(TEXT | TOKEN, max_size=3),
             st.lists(ROUGH_TOKEN, min_size=1, max_size=3) | st.lists(TEXT, min_size=17, max_size=18)),
    "stream": (st.booleans(), COERCED),
    "stream_options": (st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}), COERCED),
    "ignore_eos": (st.booleans(), COERCED),
    "skip_special_tokens": (st.booleans(), COERCED),
    "model": (st.none() | st.just("demo"), TEXT),
    "user": (TEXT, COERCED),
}
COMPLETION = dict(SAMPLING, prompt=(
    st.one_of(TEXT.filter(bool), st.lists(TEXT.filter(bool), min_size=1, max_size=3),
              st.lists(TOKEN, min_size=1, max_size=8),
              st.lists(st.lists(TOKEN, min_size=1, max_size=4), min_size=1, max_size=3)),
    st.one_of(st.just(""), st.just([]), st.lists(ROUGH_TOKEN, max_size=8), st.lists(st.lists(ROUGH_TOKEN, max_size=3), max_size=3),
              st.lists(st.floats() | st.booleans(), min_size=1, max_size=3), st.text(min_size=60, max_size=80))),
    logprobs=(st.none() | st.integers(0, 1), st.integers(-3, -1) | st.integers(2, 5)))
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
     "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)},
    optional={"name": TEXT})
BAD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["wizard", "", "USER"]) | COERCED,
     "content": COERCED | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text"]),
                                                          "text": COERCED}), min_size=1, max_size=2)})
CHAT = dict(SAMPLING, messages=(st.lists(MESSAGE, min_size=1, max_size=3),
                                st.just([]) | st.lists(BAD_MESSAGE, min_size=1, max_size=2)),
            logprobs=(st.booleans(), COERCED),
            max_completion_tokens=(st.none() | st.integers(1, 6), st.integers(-1, 0)),
            top_logprobs=(st.none() | st.just(0), st.integers(1, 3) | st.integers(-2, -1)))
REQUIRED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}


def bodies(route: str, fields: dict):
    """Bodies for `route`: well-formed ones (some optional fields drawn from their good values), the same
    with one field spoilt (a refused value or any JSON value, or a field no schema has), and any JSON
    object at all."""
    good = {name: values for name, (values, _) in fields.items()}
    required = REQUIRED[route]
    clean = st.fixed_dictionaries({required: good.pop(required)}, optional=good)
    spoilt = st.sampled_from(sorted(fields) + ["echo", "best_of"]).flatmap(
        lambda f: st.tuples(st.just(f), st.one_of(fields[f][1], WILD) if f in fields else WILD))
    one_bad = st.tuples(clean, spoilt).map(lambda t: dict(t[0], **{t[1][0]: t[1][1]}))
    return st.tuples(st.just(route), st.one_of(clean, clean, one_bad, one_bad, st.dictionaries(TEXT, WILD, max_size=3)))


ROUTES = st.one_of(bodies("/v1/completions", COMPLETION), bodies("/v1/chat/completions", CHAT))


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
    r = client.post(route, content=json.dumps(body), headers=JSON)  # json.dumps escapes lone surrogates as \udXXX
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
