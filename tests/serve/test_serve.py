"""`kvbuffer serve` on the demo model, called with the official openai client and raw HTTP, on
loopback: outputs equal LLM.generate's, under concurrency, disconnects, bad requests, a full queue
and SIGTERM. Every loop is bounded in count and time."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


from kvbuffer import LLM, demo_checkpoint  # noqa: E402
from kvbuffer.serve.chat import chat_prompt  # noqa: E402
from kvbuffer.serve.launch import ServerProcess  # noqa: E402

MAX_LEN = 256
PROMPTS = [f"{w} {i} " for i in range(16) for w in ("The", "def", "import", "class")]  # 64 distinct prompts
N_TOKENS = 12
CPU = ("--device", "cpu", "--log-level", "warning")


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*CPU, "--max-batch", "16", "--max-waiting", "96", "--max-len", str(MAX_LEN), timeout=90)
    yield s
    s.kill()


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)  # the server process decodes on the other core
    return LLM(str(demo_checkpoint()), device="cpu", max_batch=16, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def _expected(llm, prompts, n=N_TOKENS):
    return [o.text for o in llm.generate(prompts, max_new_tokens=n)]


def test_completions_streaming_and_not(client, llm):
    want = _expected(llm, ["The "])[0]
    r = client.completions.create(model="demo", prompt="The ", max_tokens=N_TOKENS, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (4, N_TOKENS)
    chunks = list(client.completions.create(model="demo", prompt="The ", max_tokens=N_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == N_TOKENS


def test_chat_streaming_and_not(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a loop."}]
    want = _expected(llm, [chat_prompt(llm.tokenizer, messages)])[0]
    r = client.chat.completions.create(model="demo", messages=messages, max_tokens=N_TOKENS, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=N_TOKENS,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"


def test_sampling_options_n_seed_stop_and_logprobs(client, llm):
    kw = dict(model="demo", prompt="The ", max_tokens=N_TOKENS, temperature=0.9, top_p=0.9, seed=7, n=3,
              extra_body={"top_k": 20})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    want = _expected(llm, ["The "], 40)[0]
    stop = want[10:13]
    r = client.completions.create(model="demo", prompt="The ", max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want[:want.index(stop)]
    eos = client.completions.create(model="demo", prompt="The ", max_tokens=40, temperature=0,
                                    stop=[ord(want[3])])  # a token id: the byte tokenizer's ids are bytes
    assert eos.choices[0].finish_reason == "stop" and eos.choices[0].text == want[:3]
    lp = client.completions.create(model="demo", prompt="The ", max_tokens=4, temperature=0, logprobs=0)
    assert len(lp.choices[0].logprobs.token_logprobs) == 4 and all(x <= 0 for x in lp.choices[0].logprobs.token_logprobs)
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True)
    assert [t.token for t in chat.choices[0].logprobs.content] == list(chat.choices[0].message.content)


def test_the_readme_client_example_runs(server, capsys):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.findall(r"```py\n(.*?)```", readme.split("## Serving", 1)[1], re.S)[0]
    exec(compile(block.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}"), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert server.health()["status"] == "ok"
    text = httpx.get(server.url + "/metrics", timeout=5).text
    for name in ("kvbuffer_requests_running", "kvbuffer_requests_waiting", "kvbuffer_generation_tokens_per_second",
                 "kvbuffer_state_slots_used_ratio", "kvbuffer_buffer_entries_used_ratio",
                 "kvbuffer_spec_acceptance_rate", "kvbuffer_time_to_first_token_seconds_bucket",
                 "kvbuffer_time_per_output_token_seconds_bucket"):
        assert name in text


def _poll(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def _stream_text(client, prompt, n=N_TOKENS):
    chunks = client.completions.create(model="demo", prompt=prompt, max_tokens=n, temperature=0, stream=True)
    text, reason = "", None
    for c in chunks:
        text += c.choices[0].text
        reason = c.choices[0].finish_reason or reason
    return text, reason


def test_64_concurrent_streaming_clients_get_what_generate_gives(server, client, llm):
    want = _expected(llm, PROMPTS)
    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(lambda p: _stream_text(client, p), PROMPTS, timeout=120))
    assert [t for t, _ in got] == want
    assert all(r == "length" for _, r in got)
    assert server.wait_idle()["request_slots_free"] == 16


def test_clients_that_disconnect_free_their_slots_and_change_no_one_else(server, client, llm):
    keep = PROMPTS[:6]
    want = _expected(llm, keep, 24)
    started = threading.Barrier(9, timeout=60)

    def leave_early(i):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": f"gone {i} ", "max_tokens": 200, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(3):  # a few events, then hang up mid-stream
                next(lines)
            started.wait()

    def stay(p):
        return _stream_text(client, p, 24)[0]

    with ThreadPoolExecutor(16) as pool:
        leavers = [pool.submit(leave_early, i) for i in range(8)]
        stayers = [pool.submit(stay, p) for p in keep]
        started.wait()  # all eight leavers are mid-stream
        for f in leavers:
            f.result(timeout=60)
        assert _poll(lambda: server.health()["in_flight"] <= len(keep))  # the leavers' slots came back
        assert [f.result(timeout=120) for f in stayers] == want
    h = server.wait_idle(30)
    assert (h["in_flight"], h["request_slots_free"]) == (0, 16)


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({"prompt": "x" * (MAX_LEN + 1)}, 400, "prompt"),
    ({"prompt": "x", "stop": [10 ** 9]}, 400, "stop"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ({}, 400, "prompt"),
], ids=["malformed-json", "unknown-field", "temperature", "max-tokens", "n", "top-p", "empty-prompt", "token-id",
        "too-long", "stop-id", "model", "missing"])
def test_bad_requests_get_a_json_error_naming_the_field(server, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_bad_chat_messages(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


@pytest.fixture(scope="module")
def small_server():
    """Four slots and four places in the queue: the queue overflows, then SIGTERM drains it. The other
    mode, with speculative decoding up to two running requests (plain steps above): greedy outputs stay
    those of plain LLM.generate."""
    s = ServerProcess(*CPU, "--max-batch", "4", "--max-waiting", "4", "--max-len", str(MAX_LEN), "--mode", "recurrent",
               "--speculative", "ngram", "--draft-tokens", "3", "--disable-speculation-above", "2", timeout=90)
    yield s
    s.kill()


def test_queue_overflow_is_a_503_and_the_server_recovers(small_server, llm):
    """Eight long streams fill the four slots and the four places in the queue; the ninth request
    gets 503 with a JSON error; once they hang up, every slot is free and requests are served again."""
    release = threading.Event()

    def hold(i):
        with httpx.stream("POST", small_server.url + "/v1/completions", timeout=60,
                          json={"prompt": f"hold {i} ", "max_tokens": 200, "temperature": 0, "stream": True}):
            release.wait(60)

    with ThreadPoolExecutor(8) as pool:
        holders = [pool.submit(hold, i) for i in range(8)]
        try:
            assert _poll(lambda: small_server.health()["in_flight"] == 8)
            r = httpx.post(small_server.url + "/v1/completions", json={"prompt": "late ", "max_tokens": 4}, timeout=30)
            assert r.status_code == 503 and "in flight" in r.json()["error"]["message"]
        finally:
            release.set()
        for f in holders:
            f.result(timeout=60)
    h = small_server.wait_idle()
    assert (h["in_flight"], h["request_slots_free"]) == (0, 4)
    client = openai.OpenAI(base_url=small_server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    assert _stream_text(client, "The ", N_TOKENS)[0] == _expected(llm, ["The "])[0]


def test_sigterm_drains_the_requests_in_flight_then_exits(small_server, llm):
    client = openai.OpenAI(base_url=small_server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    prompts = PROMPTS[:6]
    want = _expected(llm, prompts, 32)

    def one(p):
        return _stream_text(client, p, 32)[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        assert _poll(lambda: small_server.health()["in_flight"] == 6)  # four decoding, two waiting for a slot
        small_server.proc.send_signal(signal.SIGTERM)
        assert [f.result(timeout=120) for f in futures] == want  # no request lost or cut
    assert small_server.proc.wait(60) == 0  # a drained shutdown exits 0, as on Ctrl-C
