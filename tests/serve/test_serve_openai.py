"""What OpenAI and vLLM clients send, unchanged, against `kvbuffer serve` on the demo model: penalties
(implemented: the outputs equal LLM.generate's with the same penalties), skip_special_tokens,
/v1/models/{id}, the finished-requests counter on every finish reason, and, on a second server,
--chat-template, --memory-budget, request logs at debug level and a drained SIGTERM exiting 0."""

from __future__ import annotations

import re
import signal

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from kvbuffer import LLM, demo_checkpoint  # noqa: E402
from kvbuffer.serve.launch import ServerProcess  # noqa: E402

MAX_LEN = 256
CPU = ("--device", "cpu", "--log-level", "warning")


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*CPU, "--max-batch", "4", "--max-len", str(MAX_LEN), timeout=90)
    yield s
    s.kill()


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)  # the server process decodes on the other core
    return LLM(str(demo_checkpoint()), device="cpu", max_batch=4, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_default_client_calls_with_penalties_at_zero_succeed(client, llm):
    want = llm.generate(["The "], max_new_tokens=12)[0].text
    r = client.completions.create(model="demo", prompt="The ", max_tokens=12, temperature=0, presence_penalty=0,
                                  frequency_penalty=0)
    assert r.choices[0].text == want
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, presence_penalty=0, frequency_penalty=0)
    assert chat.choices[0].finish_reason == "length"


PENALTIES = [dict(presence_penalty=1.5), dict(frequency_penalty=0.7), dict(repetition_penalty=1.8),
             dict(presence_penalty=-0.5, frequency_penalty=0.5, repetition_penalty=1.2)]


@pytest.mark.parametrize("kw", PENALTIES, ids=lambda kw: ",".join(kw))
def test_penalties_give_what_generate_gives_with_them(client, llm, kw):
    prompt = "the the the "
    want = llm.generate([prompt], max_new_tokens=40, **kw)[0].text
    assert want != llm.generate([prompt], max_new_tokens=40)[0].text  # they change the greedy output here
    extra = {k: v for k, v in kw.items() if k == "repetition_penalty"}  # vLLM's field, not in openai's signature
    openai_kw = {k: v for k, v in kw.items() if k != "repetition_penalty"}
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0, extra_body=extra,
                                  **openai_kw)
    assert r.choices[0].text == want
    chunks = client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                       extra_body=extra, **openai_kw)
    assert "".join(c.choices[0].text for c in chunks) == want


@pytest.mark.parametrize("body, param", [({"presence_penalty": 2.5}, "presence_penalty"),
                                         ({"frequency_penalty": -3}, "frequency_penalty"),
                                         ({"repetition_penalty": 0}, "repetition_penalty"),
                                         ({"skip_special_tokens": "maybe"}, "skip_special_tokens")])
def test_out_of_range_fields_are_400s_naming_them(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_skip_special_tokens_is_accepted_both_ways(client, llm):
    want = llm.generate(["The "], max_new_tokens=8)[0].text
    for skip in (True, False):  # the byte tokenizer's only special token (eos) has no text either way
        r = client.completions.create(model="demo", prompt="The ", max_tokens=8, temperature=0,
                                      extra_body={"skip_special_tokens": skip})
        assert r.choices[0].text == want


def test_a_model_by_id_and_an_unknown_id(server, client):
    assert client.models.retrieve("demo").id == "demo"
    r = httpx.get(server.url + "/v1/models/gpt-9", timeout=10)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and "gpt-9" in err["message"] and err["code"] == 404
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def _finished(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    pattern = r'kvbuffer_requests_finished_total\{finish_reason="(\w+)"\} (\S+)'
    return {reason: float(count) for reason, count in re.findall(pattern, text)}


def test_every_finish_reason_is_counted(server, client, llm):
    server.wait_idle()
    before = _finished(server)
    want = llm.generate(["The "], max_new_tokens=40)[0].text
    r = client.completions.create(model="demo", prompt="The ", max_tokens=40, temperature=0, stop=[want[10:13]])
    assert r.choices[0].finish_reason == "stop"  # a stop string: the engine request is aborted, still a "stop"
    r = client.completions.create(model="demo", prompt="The ", max_tokens=40, temperature=0, stop=[ord(want[3])])
    assert r.choices[0].finish_reason == "stop"  # a stop token
    r = client.completions.create(model="demo", prompt="The ", max_tokens=5, temperature=0, n=2)
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "The ", "max_tokens": 200, "stream": True}) as s:
        next(s.iter_lines())  # one chunk, then hang up: an abort
    server.wait_idle()
    after = _finished(server)
    gained = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: v for k, v in gained.items() if v} == {"stop": 2, "length": 2, "abort": 1}


TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_chat_template_memory_budget_debug_logs_and_a_drained_sigterm(tmp_path, llm):
    """A second server: a template file, a memory budget (the slots it holds), one debug line per request;
    SIGTERM with a request in flight lets it finish and exits 0."""
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    budget = 3 * 2**20
    slots = LLM(str(demo_checkpoint()), device="cpu", max_len=MAX_LEN, memory_budget=budget).limits.max_requests
    s = ServerProcess("--device", "cpu", "--log-level", "debug", "--max-len", str(MAX_LEN), "--chat-template",
                      str(tmp_path / "t.jinja"), "--memory-budget", str(budget), timeout=90)
    try:
        assert s.health()["request_slots_free"] == slots
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        want = llm.generate(["[user] hi\n[assistant] "], max_new_tokens=10)[0].text
        r = client.chat.completions.create(model="demo", messages=messages, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == want
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={"prompt": "The ", "max_tokens": 60, "temperature": 0, "stream": True}) as stream:
            lines = stream.iter_lines()
            next(lines)
            s.proc.send_signal(signal.SIGTERM)
            rest = "\n".join(lines)
        assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in rest  # drained, not cut
        assert s.proc.wait(60) == 0
    finally:
        s.kill()
    logs = [line for line in s.output().splitlines() if " choice 0: " in line]
    assert len(logs) == 2 and re.search(r"chatcmpl-\w+ choice 0: \d+ prompt tokens, .*presence_penalty=0.0.*; "
                                        r"finish length, 10 tokens, [\d.]+ s", logs[0]), logs
