"""The server in-process on the demo model, against what a hostile or careless client sends: a row
the engine fails answers only its client; lone surrogates, invalid UTF-8, deep nesting and coerced
values are 400s in OpenAI's error format; a body past the limit is a 413; tokenization never holds
up the event loop; an API key guards every route but /health."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from kvbuffer import LLM, demo_checkpoint  # noqa: E402
from kvbuffer.serve import http as http_module  # noqa: E402
from kvbuffer.serve.app import build_app  # noqa: E402
from kvbuffer.serve.engine_loop import AsyncEngine  # noqa: E402
from kvbuffer.serve.metrics import ServerMetrics  # noqa: E402

from .row_errors import ROW_ERROR, fail_rows_of  # noqa: E402

MAX_LEN = 64
GREEDY = {"max_tokens": 8, "temperature": 0}
JSON = {"content-type": "application/json"}  # as clients send (the server parses any body as JSON)


def _llm():
    return LLM(str(demo_checkpoint()), device="cpu", max_batch=4, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def reference():
    """An LLM that no server runs: generate's outputs, to compare the server's with."""
    torch.set_num_threads(1)
    return _llm()


@contextlib.contextmanager
def serving(llm, **kw):
    """A TestClient on a fresh app around `llm` (the engine thread runs while it is open)."""
    metrics = ServerMetrics()
    app = build_app(AsyncEngine(llm, max_waiting=4, metrics=metrics), "demo", metrics, **kw)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.fixture(scope="module")
def client():
    with serving(_llm()) as c:
        yield c


def _error(r, status: int) -> dict:
    """The OpenAI error object of a response of `status` (never FastAPI's {"detail": ...})."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status and body["error"]["message"]
    return body["error"]


def _events(text: str) -> list:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


# a row the engine fails ------------------------------------------------------------------------
def test_a_row_the_engine_fails_answers_only_its_client(reference):
    """The engine finishes "Bad " requests with finish_reason "error": their clients get a 400 (not
    streaming) or an error event then [DONE] (streaming); requests beside them get generate's text."""
    own = _llm()
    fail_rows_of(own, list(b"Bad "))
    want = reference.generate(["The "], max_new_tokens=8)[0].text
    with serving(own) as c, ThreadPoolExecutor(4) as pool:
        bad = pool.submit(c.post, "/v1/completions", json={"prompt": "Bad ", **GREEDY})
        bad_stream = pool.submit(c.post, "/v1/completions", json={"prompt": "Bad ", "stream": True, **GREEDY})
        good = [pool.submit(c.post, "/v1/completions", json={"prompt": "The ", **GREEDY}) for _ in range(2)]
        err = _error(bad.result(60), 400)
        assert err["type"] == "invalid_request_error" and ROW_ERROR in err["message"]
        events = _events(bad_stream.result(60).text)
        assert events[-1] == "[DONE]" and ROW_ERROR in json.loads(events[-2])["error"]["message"]
        assert [g.result(60).json()["choices"][0]["text"] for g in good] == [want, want]
        assert c.get("/health").json()["request_slots_free"] == 4


# lone surrogates, invalid UTF-8, deep nesting ----------------------------------------------------
SURROGATE = '"ab\\ud800cd"'  # JSON text: a lone high surrogate escape
SURROGATE_BODIES = {
    "prompt": ("/v1/completions", '{"prompt": %s}'),
    "prompt-list": ("/v1/completions", '{"prompt": ["ok", %s]}'),
    "low-half": ("/v1/completions", '{"prompt": "x\\udc00"}%.0s'),
    "stop": ("/v1/completions", '{"prompt": "x", "stop": [%s]}'),
    "model": ("/v1/completions", '{"prompt": "x", "model": %s}'),
    "user": ("/v1/completions", '{"prompt": "x", "user": %s}'),
    "chat-content": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}]}'),
    "chat-part": ("/v1/chat/completions",
                  '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}'),
    "chat-name": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": %s}]}'),
}


@pytest.mark.parametrize("where", SURROGATE_BODIES)
def test_a_lone_surrogate_anywhere_is_a_400(client, where):
    route, template = SURROGATE_BODIES[where]
    err = _error(client.post(route, content=template % SURROGATE, headers=JSON), 400)
    assert err["message"].startswith("malformed JSON") and "Unicode" in err["message"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content", [b'{"prompt": "\xff\xfe"}', b'{"messages": [{"role": "user", "content": "\xc3"}]}',
                                     b"[" * 10_000 + b"]" * 10_000,
                                     b'{"prompt": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_001,
                                     b"", b"not json", b'{"prompt": "x"} trailing'],
                         ids=["bad-utf8", "cut-utf8", "deep-list", "deep-object", "empty", "not-json", "trailing"])
def test_unparsable_bodies_get_the_openai_error_object(client, route, content):
    assert _error(client.post(route, content=content, headers=JSON), 400)["message"].startswith("malformed JSON")


def test_unknown_routes_and_methods_get_the_openai_error_object(client):
    assert _error(client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    assert _error(client.get("/v1/completions"), 405)["message"]


# strict fields --------------------------------------------------------------------------------
COERCED = [
    ("max_tokens", True), ("max_tokens", "4"), ("max_tokens", 4.0), ("n", True), ("n", "1"), ("seed", True),
    ("seed", 1.0), ("temperature", True), ("temperature", "0"), ("top_p", True), ("top_k", True), ("top_k", 5.0),
    ("presence_penalty", False), ("repetition_penalty", "1"), ("logprobs", True), ("stream", 1), ("stream", "true"),
    ("ignore_eos", 0), ("skip_special_tokens", 1), ("prompt", [65.0]), ("prompt", [True, False]),
    ("prompt", [[65, 66.0]]), ("prompt", 65), ("stop", [True]), ("stop", [1.0]),
    ("stream_options", {"include_usage": 1}),
]


@pytest.mark.parametrize("field, value", COERCED, ids=[f"{f}={json.dumps(v)}" for f, v in COERCED])
def test_completion_fields_are_never_coerced(client, field, value):
    body = {"prompt": "The ", "max_tokens": 2, field: value}
    if field == "stream_options":
        body["stream"] = True
    err = _error(client.post("/v1/completions", json=body), 400)
    assert err["param"].split(".")[0] == field, err


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "The ", "max_tokens": 2, "stream_options": {}}),
    ("/v1/completions", {"prompt": "The ", "max_tokens": 2, "stream": False,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "stream_options": {"include_usage": False}}),
], ids=["absent", "false", "chat"])
def test_stream_options_without_a_stream_is_a_400(client, route, body):
    """As vLLM: options of a stream that is not one are a client's mistake, not something to ignore."""
    assert "stream_options is only allowed with stream: true" in _error(client.post(route, json=body), 400)["message"]
    assert client.post(route, json=dict(body, stream=True)).status_code == 200


CHAT_COERCED = [("logprobs", 1), ("logprobs", "true"), ("max_completion_tokens", True), ("top_logprobs", False),
                ("messages", [{"role": "user", "content": 5}]), ("messages", [{"role": "user", "content": None}])]


@pytest.mark.parametrize("field, value", CHAT_COERCED, ids=[f"{f}={json.dumps(v)}" for f, v in CHAT_COERCED])
def test_chat_fields_are_never_coerced(client, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    assert _error(client.post("/v1/chat/completions", json=body), 400)["param"].split(".")[0] == field


def test_json_integers_still_fill_float_fields(client, reference):
    want = reference.generate(["The "], max_new_tokens=4)[0].text
    r = client.post("/v1/completions", json={"prompt": "The ", "max_tokens": 4, "temperature": 0, "top_p": 1,
                                             "presence_penalty": 0, "repetition_penalty": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_a_value_the_engine_refuses_is_a_400_naming_the_field(client, monkeypatch):
    """Values that pass the schema are checked again by SamplingParams (the engine's one copy of its
    rules); its refusal names the request's field."""
    from kvbuffer.engine import sampling

    real = sampling.SamplingParams.__post_init__

    def stricter(self):
        real(self)
        if 0 < self.temperature < 0.5:
            raise ValueError(f"temperature must be 0 or >= 0.5, got {self.temperature}")

    monkeypatch.setattr(sampling.SamplingParams, "__post_init__", stricter)
    err = _error(client.post("/v1/completions", json={"prompt": "x", "temperature": 0.25}), 400)
    assert err["param"] == "temperature" and "0.25" in err["message"]


def test_more_choices_than_the_server_holds_is_a_400_not_a_503(client):
    err = _error(client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 5, "max_tokens": 1}), 400)
    assert err["param"] == "n" and "10 completions" in err["message"]


# body size, and the event loop ------------------------------------------------------------------
def test_a_body_past_the_limit_is_a_413_however_it_is_sent(reference):
    with serving(_llm(), max_body_bytes=2000) as c:
        big = json.dumps({"prompt": "x" * 3000}).encode()
        assert "3014 bytes" in _error(c.post("/v1/completions", content=big, headers=JSON), 413)["message"]
        pieces = iter([big[:1500], big[1500:]])  # sent without a Content-Length
        chunked = c.post("/v1/chat/completions", content=pieces, headers=JSON)
        assert "more than 2000 bytes" in _error(chunked, 413)["message"]
        assert c.post("/v1/completions", json={"prompt": "The ", **GREEDY}).status_code == 200
    with pytest.raises(ValueError, match="max_body_bytes"):
        build_app(AsyncEngine(reference), "demo", max_body_bytes=0)


class SlowTokenizer:
    """The demo tokenizer, encoding in `seconds` (as a real tokenizer does a very long prompt)."""

    def __init__(self, tokenizer, seconds: float):
        self.tokenizer, self.seconds, self.started = tokenizer, seconds, threading.Event()

    def encode(self, text):
        self.started.set()
        time.sleep(self.seconds)
        return self.tokenizer.encode(text)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": "The "}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})],
                         ids=["completion", "chat"])
def test_health_answers_while_a_prompt_is_tokenized(route, body):
    own = _llm()
    own.tokenizer = slow = SlowTokenizer(own.tokenizer, 1.5)
    with serving(own) as c, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(c.post, route, json={**body, "max_tokens": 2})
        assert slow.started.wait(30)
        t0 = time.monotonic()
        assert c.get("/health").status_code == 200
        assert time.monotonic() - t0 < 0.5  # the event loop is not the one encoding
        assert pending.result(60).status_code == 200


# the API key ------------------------------------------------------------------------------------
KEY = "sk-test-0123456789"


def test_an_api_key_guards_every_route_but_health(reference, monkeypatch):
    compared = []
    real = http_module.hmac.compare_digest
    monkeypatch.setattr(http_module.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    ok = {"Authorization": f"Bearer {KEY}"}
    with serving(_llm(), api_key=KEY) as c:
        assert c.get("/health").status_code == 200
        for headers in ({}, {"Authorization": KEY}, {"Authorization": "Bearer sk-wrong"},
                        {"Authorization": f"bearer {KEY}"}, {"Authorization": f"Bearer {KEY} "}):
            for method, route in (("GET", "/v1/models"), ("GET", "/v1/models/demo"), ("GET", "/metrics"),
                                  ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                  ("GET", "/v1/nothing"), ("GET", "/docs"), ("GET", "/openapi.json")):
                r = c.request(method, route, headers=headers, json={"prompt": "The ", **GREEDY})
                err = _error(r, 401)
                assert err["type"] == "authentication_error" and KEY not in r.text
                assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.post("/v1/completions", headers=ok, json={"prompt": "The ", **GREEDY}).status_code == 200
        assert c.get("/metrics", headers=ok).status_code == 200
    assert compared  # a constant-time comparison
    with pytest.raises(ValueError, match="api_key"):
        build_app(AsyncEngine(reference), "demo", api_key="")


# the same over real HTTP: `kvbuffer serve` in a subprocess ------------------------------------
@pytest.fixture(scope="module")
def guarded():
    """A server whose API key comes from KVBUFFER_API_KEY, with a 64 KiB body limit, logging at debug."""
    from kvbuffer.serve.launch import ServerProcess

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVBUFFER_API_KEY", KEY)
        s = ServerProcess("--device", "cpu", "--log-level", "debug", "--max-len", str(MAX_LEN), "--max-batch", "2",
                          "--max-body-bytes", str(64 * 1024), timeout=90)
    yield s
    s.kill()


def test_over_http_a_bad_body_keeps_the_connection_and_the_key_is_checked_not_logged(guarded, reference):
    import http.client

    import openai

    want = reference.generate(["The "], max_new_tokens=8)[0].text
    conn = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=60)
    auth = {"Authorization": f"Bearer {KEY}", **JSON}
    socks = []
    for body in ('{"prompt": "ab\\ud800cd"}', '{"prompt": [65.0]}', b'{"prompt": "\xff"}',
                 json.dumps({"prompt": "The ", **GREEDY})):
        conn.request("POST", "/v1/completions", body=body, headers=auth)
        r = conn.getresponse()
        payload = json.loads(r.read())
        assert not r.will_close and r.status in (200, 400), payload
        socks.append(conn.sock)
    assert payload["choices"][0]["text"] == want
    assert all(s is socks[0] for s in socks)  # one connection throughout: keep-alive kept after every 400
    conn.close()

    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
    assert client.completions.create(model="demo", prompt="The ", max_tokens=8, temperature=0).choices[0].text == want
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert guarded.health()["status"] == "ok"  # /health is open
    big = httpx.post(guarded.url + "/v1/completions", headers=auth, timeout=60,
                     content=json.dumps({"prompt": "x" * 100_000}))
    assert big.status_code == 413 and big.json()["error"]["code"] == 413
    assert KEY not in guarded.output() and "ab\\ud800cd" not in guarded.output()


@pytest.mark.parametrize("args, message", [(["--max-body-bytes", "0"], "max-body-bytes"),
                                           (["--api-key", " "], "must not be empty")])
def test_serve_refuses_a_bad_limit_or_key_before_loading(args, message):
    from click.testing import CliRunner

    from kvbuffer.cli.serve import serve

    result = CliRunner().invoke(serve, ["--device", "cpu", *args])
    assert result.exit_code == 2 and message in result.output


def test_the_issue_s_tiny_temperatures_and_infinite_logits_fail_alone(reference):
    """Issue 42's first finding, end to end: tiny positive temperatures (5e-324, 1e-40, 1.2e-38)
    are refused by the engine's rule as 400s naming `temperature`; a repetition penalty that makes a
    sampled row's logits infinite fails that request alone (400); the requests beside them get
    generate's text."""
    want = reference.generate(["The "], max_new_tokens=8)[0].text
    with serving(_llm()) as c, ThreadPoolExecutor(6) as pool:
        tiny = [pool.submit(c.post, "/v1/completions", json={"prompt": "The ", "max_tokens": 8, "temperature": t})
                for t in (5e-324, 1e-40, 1.2e-38)]
        infinite = pool.submit(c.post, "/v1/completions", json={"prompt": "The ", "max_tokens": 8, "temperature": 1,
                                                                 "repetition_penalty": 1e-300})
        good = [pool.submit(c.post, "/v1/completions", json={"prompt": "The ", **GREEDY}) for _ in range(2)]
        for r in tiny:
            assert _error(r.result(60), 400)["param"] == "temperature"
        assert _error(infinite.result(60), 400)["message"].startswith("generation failed")
        assert [g.result(60).json()["choices"][0]["text"] for g in good] == [want, want]
