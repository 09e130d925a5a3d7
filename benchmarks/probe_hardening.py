"""The hardening probe: bad inputs and faults thrown at every area a user reaches, each outcome classified.

Areas: the HTTP server (its ASGI app, in-process), the engine API (LLM, generate, add_request, rows
that fail), the checkpoint loader (configs and tensors), the artifact cache and its CLI, the custom
ops, and the transformers integration. Outcomes:

- clear: a typed error naming the problem (a kvbuffer error, a plain ValueError / TypeError, torch's
  schema error naming the argument; for the CLI one `Error:` line, exit 1 or 2; over HTTP a JSON 4xx
  in OpenAI's error format, 413 for a body past the limit), or a failed row finished alone;
- correct: accepted, and the result is right (a value that turned out valid, an op equal to its reference);
- traceback: a raw exception (KeyError, AttributeError, RuntimeError ...), a CLI traceback, an HTTP 500;
- silent: accepted garbage (a value that must be refused ran, an op's result differs from its reference);
- data lost: something else was harmed (a refused op wrote a pool, files outside kvbuffer's own changed,
  a neighbouring request's tokens changed, slots leaked, the server answers a normal request differently).

A case can count as data lost and as one of the others. CPU only, tiny models from tests/support; run from
the repository root (it imports tests.support):

    OMP_NUM_THREADS=1 python benchmarks/probe_hardening.py --out hardening_probe.json

Writes a JSON of the counts per area and every non-clear finding (kind, area, case, detail).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

import torch  # noqa: E402

from kvbuffer.errors import KVBufferError  # noqa: E402

KINDS = ("clear", "correct", "traceback", "silent", "lost")


class Tally:
    """Outcome counts per area, and the findings that are not clear or correct."""

    def __init__(self):
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.findings: list[dict] = []

    def add(self, area: str, case: str, kind: str, detail: str = "", lost: bool = False) -> None:
        c = self.counts[area]
        c["tried"] += 1
        c[kind] += 1
        if kind in ("traceback", "silent"):
            self.findings.append(dict(kind=kind, area=area, case=case, detail=detail[:300]))
        if lost:
            c["lost"] += 1
            self.findings.append(dict(kind="lost", area=area, case=case, detail=detail[:300]))

    def exception(self, area: str, case: str, e: BaseException, lost: bool = False) -> None:
        self.add(area, case, "clear" if is_clear(e) else "traceback", f"{type(e).__name__}: {e}", lost)


def is_clear(e: BaseException) -> bool:
    """A typed error that says what is wrong: kvbuffer's own, or a plain ValueError / TypeError (not a
    parser's subclass such as JSONDecodeError or UnicodeError), or torch's schema error naming the
    argument's expected type; with a message."""
    if not str(e).strip():
        return False
    if isinstance(e, KVBufferError) or type(e) in (ValueError, TypeError):
        return True
    return type(e) is RuntimeError and "Expected a value of type" in str(e)


def _bad_values():
    return [-1, 0, 2.5, "x", "", "1", True, [], {}, [1], math.nan, math.inf, -math.inf, 10 ** 13, -10 ** 13,
            2 ** 63, 1e-40, 5e-324, b"1", object()]


# ---------------------------------------------------------------------------------------------- engine

def probe_engine(t: Tally, rng: random.Random, demo: str) -> None:
    import dataclasses

    from kvbuffer import LLM
    from kvbuffer.engine.config import EngineConfig
    from kvbuffer.engine.sampling import SamplingParams
    from tests.support.pool_slots import all_free

    area = "engine API"
    llm = LLM(demo, device="cpu", max_batch=4, max_len=64, chunk_size=4)
    want = [o.token_ids for o in llm.generate([[5, 6, 7], [9, 3]], max_new_tokens=6, stop_token_ids=[])]

    def healthy() -> bool:
        got = [o.token_ids for o in llm.generate([[5, 6, 7], [9, 3]], max_new_tokens=6, stop_token_ids=[])]
        return got == want and all_free(llm) and not llm.has_work()

    # LLM(...) options: a bad value must be refused before anything is allocated
    valid_extra = {"device": ["cpu"], "overlap": [True, False, 0], "compile": [True, False, 0],
                   "cuda_graphs": [True, False, 0], "kernels": [True, False, 0], "gemv": [True, False, 0],
                   "unbuffered_rows": [0, True, False], "dtype": []}
    for f in dataclasses.fields(EngineConfig):
        for value in _bad_values() + ["cuda:7", "banana", "auto", None, torch.float64]:
            if (value is None and f.default is None) or any(type(value) is type(v) and value == v
                                                             for v in valid_extra.get(f.name, [])):
                continue
            case = f"LLM({f.name}={value!r:.40})"
            try:
                other = LLM(demo, device="cpu", max_batch=2, max_len=32, chunk_size=4, **{f.name: value})
            except Exception as e:
                t.exception(area, case, e)
                continue
            try:  # accepted: the value must have been a valid one (it runs)
                other.generate([[1, 2]], max_new_tokens=2, stop_token_ids=[])
                t.add(area, case, "correct")
            except Exception as e:
                t.add(area, case, "traceback", f"accepted, then generate: {type(e).__name__}: {e}")

    # generate(...) and SamplingParams arguments
    good = dict(max_new_tokens=3, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop_token_ids=None,
                presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    for name in good:
        for value in _bad_values() + [-2.5, 3.0, 1e300, {1: 2}, (1 << 40,), [-1]]:
            case = f"generate({name}={value!r:.40})"
            try:
                outs = llm.generate([[5, 6, 7]], **dict(good, **{name: value}))
                t.add(area, case, "correct" if _valid_setting(name, value) else "silent",
                      f"accepted: {outs[0].token_ids[:8]}")
            except Exception as e:
                t.exception(area, case, e, lost=not healthy())
        for value in _bad_values()[:10]:
            case = f"SamplingParams({name}={value!r:.40})"
            try:
                SamplingParams(**{name: value})
                t.add(area, case, "correct" if _valid_setting(name, value) else "silent", "accepted")
            except Exception as e:
                t.exception(area, case, e)

    # prompts
    prompts = [[], [[]], [-1], [97 * 1000], [1.5], ["a"], [True], [[1, 2], 3], None, 3, "", b"ab",
               torch.tensor(3), torch.tensor([[1, 2]]), torch.tensor([1.0, 2.0]), torch.empty(0, dtype=torch.long),
               torch.tensor([1, 2], device="meta"), [1] * 200, [[1] * 63], [2 ** 63 - 1], [[5], [-5]], {"a": 1},
               "ab\ud800cd", [[1, 2], []]]
    for p in prompts:
        for how in ("generate", "add_request"):
            case = f"{how}(prompt={p!r:.40})"
            try:
                if how == "generate":
                    llm.generate(p, max_new_tokens=2, stop_token_ids=[])
                else:
                    llm.add_request(p, SamplingParams(2, stop_token_ids=()))
                    while llm.has_work():
                        llm.step()
                valid = (how == "generate" and p in (["a"], [[1] * 63])) or (isinstance(p, list) and p == [1] * 200)
                t.add(area, case, "correct" if valid else "silent", "accepted")
            except Exception as e:
                t.exception(area, case, e, lost=not healthy())
    for rid in (-1, 10 ** 9, "3", None, 2.0, True):
        try:
            llm.abort(rid)
            t.add(area, f"abort({rid!r})", "correct" if isinstance(rid, int) and not isinstance(rid, bool) else
                  "silent", "accepted")
        except Exception as e:
            t.exception(area, f"abort({rid!r})", e)

    # faults of one row: NaN / inf logits or a sampler that raises, in every kind of step
    _row_faults(t, rng, demo)


def _valid_setting(name: str, value) -> bool:
    """Whether `value` is a valid generate() / SamplingParams setting `name` (the documented ranges)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    whole = isinstance(value, int) and not isinstance(value, bool)
    if name == "max_new_tokens":
        return whole and value >= 1
    if name == "temperature":
        return number and (value == 0 or 0.01 <= value < math.inf)
    if name == "top_k":
        return whole and value >= 0
    if name == "top_p":
        return number and 0 < value <= 1
    if name == "seed":
        return value is None or whole and 0 <= value < 2 ** 63
    if name == "stop_token_ids":
        return value is None or isinstance(value, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 256 for t in value)
    if name in ("presence_penalty", "frequency_penalty"):
        return number and -2 <= value <= 2
    if name == "repetition_penalty":
        return number and 0 < value < math.inf
    return False


def _row_faults(t: Tally, rng: random.Random, demo: str) -> None:
    from kvbuffer import LLM
    from kvbuffer.engine import core as engine_core
    from kvbuffer.engine import speculative as engine_speculative
    from tests.engine.test_speculative_row_errors import _params, _run
    from tests.support.pool_slots import all_free

    area = "engine API"
    engines = {"plain": dict(overlap=False), "overlapped": dict(overlap=True),
               "ngram": dict(speculative={"method": "ngram", "num_draft_tokens": 2}),
               "ngram-overlapped": dict(overlap=True, speculative={"method": "ngram", "num_draft_tokens": 2,
                                                                  "disable_above_batch": 3})}
    for ename, options in engines.items():
        llm = LLM(demo, device="cpu", max_batch=5, chunk_size=4, **options)
        for marked in (None, "top_k", "penalty"):
            clean = _run(llm, _params(marked))
            faults = [("nan", "decode"), ("nan", "verify"), ("nan", "prefill"), ("inf", "decode"),
                      ("inf", "verify")] if marked is None else \
                [("raise", "pick"), ("raise", "accept")] if marked == "top_k" else [("raise", "penalty")]
            for what, phase in faults:
                if phase in ("verify", "accept", "penalty") and "speculative" not in options:
                    continue  # a plain engine has no verify to fault
                for victim in (1, 2) if marked is None else ((1,) if marked == "top_k" else (2,)):
                    for after in (0, 1, 3):
                        case = f"{ename}: {what} in row {victim}'s {phase} from #{after} ({marked or 'logits'})"
                        with _fault(llm, what, phase, victim, after, marked, engine_core, engine_speculative):
                            try:
                                faulty = _run(llm, _params(marked))
                            except Exception as e:
                                t.add(area, case, "traceback", f"the step failed: {type(e).__name__}: {e}",
                                      lost=True)
                                _drain(llm)
                                continue
                        # with disable_above_batch a failed row changes when verifies start, which changes
                        # the sampled rows' draws (not their distribution): there only greedy rows compare
                        compared = [i for i in range(5) if i != victim and (i % 2 == 0 or "overlapped" not in ename)]
                        others = all(faulty[i] == clean[i] for i in compared)
                        lost = not others or not all_free(llm)
                        reason = faulty[victim][1]
                        if reason == "error":
                            t.add(area, case, "clear", lost=lost, detail="others changed" if lost else "")
                        elif faulty[victim] == clean[victim]:
                            t.add(area, case, "correct", lost=lost)  # the fault never met the row
                        else:
                            t.add(area, case, "silent", f"finished {reason}: {faulty[victim][0]}", lost=lost)


def _drain(llm) -> None:
    for rid in list(llm.core.scheduler.running) + list(llm.core.scheduler.waiting):
        llm.abort(rid.rid)


@contextlib.contextmanager
def _fault(llm, what, phase, victim, after, marked, engine_core, engine_speculative):
    runner, rid, seen = llm.runner, llm._next_rid + victim, [0]
    forward = runner._forward
    pick_rows, accept_sampled, penalize = engine_core.pick_rows, engine_speculative.accept_sampled, \
        engine_speculative.penalize

    def poisoned(ids, batch, **kw):
        out = forward(ids, batch, **kw)
        req = next((r for r in llm.scheduler.running if r.rid == rid), None)
        if batch.phase == phase and req is not None and bool((batch.slots == req.slot).any()):
            seen[0] += 1
            if seen[0] > after:
                logits = out[0] if isinstance(out, tuple) else out
                rows = batch.slots == req.slot
                if what == "nan":
                    logits[rows] = float("nan")
                else:
                    logits[rows, ..., 7] = float("inf")
        return out

    def raising(fn, test):
        """fn, raising from the after-th call with the marked row on (after drawing from its generators)."""
        def wrapped(*a):
            if test(a):
                seen[0] += 1
                if seen[0] > after:
                    for g in a[-1] if isinstance(a[-1], list) else ():
                        if isinstance(g, torch.Generator):
                            torch.rand(2, generator=g, device=g.device)
                    raise RuntimeError("injected fault")
            return fn(*a)
        return wrapped

    if what in ("nan", "inf"):
        runner._forward = poisoned
    elif phase == "pick":  # a plain, overlapped or first-token pick
        engine_core.pick_rows = raising(pick_rows, lambda a: any(p.top_k == 13 for p in a[1]))
    elif phase == "accept":  # a verify's sampled acceptance
        engine_speculative.accept_sampled = raising(accept_sampled, lambda a: any(p.top_k == 13 for p in a[2]))
    else:  # a verify's penalties
        engine_speculative.penalize = raising(penalize, lambda a: any(p.repetition_penalty == 1.07 for p in a[1]))
    try:
        yield
    finally:
        runner.__dict__.pop("_forward", None)
        engine_core.pick_rows, engine_speculative.accept_sampled, engine_speculative.penalize = \
            pick_rows, accept_sampled, penalize


# ---------------------------------------------------------------------------------------------- HTTP

def probe_http(t: Tally, rng: random.Random, demo: str) -> None:
    from fastapi.testclient import TestClient

    from kvbuffer import LLM
    from kvbuffer.serve.app import build_app
    from kvbuffer.serve.engine_loop import AsyncEngine
    from kvbuffer.serve.metrics import ServerMetrics

    area = "HTTP server"
    reference = LLM(demo, device="cpu", max_batch=4, max_len=64)
    want = reference.tokenizer.decode(reference.generate("hello", max_new_tokens=6, stop_token_ids=[])[0].token_ids)
    llm = LLM(demo, device="cpu", max_batch=4, max_len=64)
    metrics = ServerMetrics()
    app = build_app(AsyncEngine(llm, max_waiting=8, metrics=metrics), "demo", metrics, max_body_bytes=1 << 16)
    base = {"model": "demo", "prompt": "hi", "max_tokens": 2, "temperature": 0}
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "logprobs",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "stream", "stream_options",
              "ignore_eos", "skip_special_tokens", "echo", "user", "best_of", "suffix", "no_such_field"]
    bad = ["1", True, False, None, [], {}, "x", -1, 0, 2.5, 1e-40, 5e-324, 1e300, 2 ** 64, -2 ** 64, float("nan"),
           float("inf"), [1.5], [True], ["a", 1], [[]], [-1], [10 ** 6], "ab\ud800cd", {"a": [1]}]
    # (field, value) pairs that are valid requests: a 2xx is right for them
    valid = [("stop", None), ("stop", []), ("stop", "x"), ("stop", "1"), ("stop", ""), ("seed", None), ("seed", 0),
             ("seed", -1), ("top_k", -1), ("top_k", 0), ("n", None), ("user", "x"), ("user", "1"), ("user", ""),
             ("user", "ab\ud800cd"), ("stream", True), ("stream", False), ("stream", None), ("ignore_eos", True),
             ("ignore_eos", False), ("skip_special_tokens", True), ("skip_special_tokens", False),
             ("logprobs", 0), ("logprobs", None), ("max_tokens", None), ("temperature", 0), ("temperature", None),
             ("top_p", None), ("presence_penalty", 0), ("frequency_penalty", 0), ("presence_penalty", -1),
             ("frequency_penalty", -1), ("temperature", 2.5), ("presence_penalty", None),
             ("frequency_penalty", None), ("repetition_penalty", None), ("repetition_penalty", 2.5),
             ("prompt", "x"), ("prompt", "1"), ("stream_options", None),
             ("echo", False), ("echo", None), ("top_k", None),
             ("suffix", None), ("best_of", None),
             ("max_tokens", 2 ** 64), ("top_p", 1e-40), ("top_p", 5e-324), ("top_k", 2 ** 64), ("stop", ["a", 1]),
             ("presence_penalty", 1e-40), ("presence_penalty", 5e-324), ("frequency_penalty", 1e-40),
             ("frequency_penalty", 5e-324), ("repetition_penalty", 1e300), ("repetition_penalty", 2 ** 64),
             ("user", None), ("logprobs", True), ("logprobs", False), ("max_completion_tokens", None),
             ("max_completion_tokens", 2 ** 64), ("tools", None), ("response_format", None)]

    def is_valid(field, value) -> bool:
        return any(f == field and type(v) is type(value) and v == value for f, v in valid)

    with TestClient(app, raise_server_exceptions=False) as client:
        def check(case: str, send, must_refuse: bool) -> None:
            try:
                r = send()
            except Exception as e:
                t.add(area, case, "traceback", f"client: {type(e).__name__}: {e}")
                return
            ok_json = False
            with contextlib.suppress(Exception):
                body = r.json()
                ok_json = isinstance(body, dict) and isinstance(body.get("error"), dict) and body["error"].get(
                    "message")
            if r.status_code >= 500:
                t.add(area, case, "traceback", f"{r.status_code}: {r.text[:200]}")
            elif 400 <= r.status_code < 500:
                if ok_json or r.status_code in (404, 405, 413):
                    t.add(area, case, "clear")
                else:
                    t.add(area, case, "traceback", f"{r.status_code} without OpenAI's error object: {r.text[:200]}")
            elif must_refuse:
                t.add(area, case, "silent", f"{r.status_code}: {r.text[:200]}")
            else:
                t.add(area, case, "correct")

        def raw(path: str, body: bytes, headers=None):
            return lambda: client.post(path, content=body, headers=headers or {"content-type": "application/json"})

        for path, template in (("/v1/completions", base), ("/v1/chat/completions", chat)):
            for field in fields + (["messages", "max_completion_tokens", "tools", "response_format"]
                                   if "chat" in path else []):
                for value in bad:
                    if field == "prompt" and "chat" in path:
                        continue
                    body = dict(template, **{field: value})
                    try:
                        data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
                    except Exception:
                        continue
                    check(f"{path} {field}={value!r:.40}", raw(path, data), not is_valid(field, value))
            for value in ["user", {"role": "x", "content": "hi"}, {"role": "user"}, {"role": "user", "content": 5},
                          {"role": "user", "content": [{"type": "image_url"}]}, {"content": "hi"},
                          {"role": "user", "content": "ab\ud800"}, {"role": "user", "content": ["x"]}]:
                if "chat" in path:
                    body = dict(chat, messages=[value])
                    data = json.dumps(body).encode("utf-8", "surrogatepass")
                    check(f"{path} messages=[{value!r:.40}]", raw(path, data), True)
            raws = [b"", b"{", b"[]", b"null", b"1", b'"x"', b"{\"prompt\": \"\xff\xfe\"}", b"{" * 5000 + b"}" * 5000,
                    b"[" * 100000, json.dumps(dict(template, pad="x" * (1 << 17))).encode(),
                    json.dumps(dict(template, max_tokens=2)).encode()[:-1], b"\x00" * 10, "é".encode("latin-1"),
                    b'{"prompt": "hi", "prompt": [1]}', b'{"max_tokens": NaN}', b'{"max_tokens": Infinity}',
                    json.dumps(template).encode("utf-16")]
            for i, body in enumerate(raws):  # a repeated key: the last one counts, as in every JSON parser
                check(f"{path} raw body #{i} {body[:20]!r}", raw(path, body), b'"prompt": [1]}' not in body)
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "", "multipart/form-data"):
                check(f"{path} content-type {ctype!r}", raw(path, json.dumps(template).encode(),
                                                            {"content-type": ctype}), False)
            for _ in range(60):  # random combinations of several bad fields
                body = dict(template)
                for field in rng.sample(fields, 3):
                    body[field] = rng.choice(bad)
                if "chat" in path:
                    body.pop("prompt", None)
                data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
                pairs = [(k, v) for k, v in body.items() if k not in template or template[k] != v]
                check(f"{path} {pairs!r:.80}", raw(path, data), not all(is_valid(*p) for p in pairs))
        for method, path in (("GET", "/v1/completions"), ("DELETE", "/v1/models"), ("GET", "/nope"),
                             ("POST", "/health"), ("GET", "/v1/models/../../etc/passwd"), ("PUT", "/metrics")):
            check(f"{method} {path}", lambda m=method, p=path: client.request(m, p), True)
        r = client.post("/v1/completions", json={"model": "demo", "prompt": "hello", "max_tokens": 6,
                                                "temperature": 0, "ignore_eos": True})
        got = r.json()["choices"][0]["text"] if r.status_code == 200 else None
        if got != want or client.get("/health").status_code != 200:
            t.add(area, "a normal request after the probe", "clear", lost=True,
                  detail=f"{r.status_code}: {got!r} != {want!r}")
    # the API key
    llm2 = LLM(demo, device="cpu", max_batch=2, max_len=64)
    app = build_app(AsyncEngine(llm2, max_waiting=2), "demo", None, api_key="s3cret")
    with TestClient(app, raise_server_exceptions=False) as client:
        for path in ("/v1/models", "/metrics", "/v1/completions"):
            for header in ({}, {"authorization": "Bearer nope"}, {"authorization": "s3cret"},
                           {"authorization": "Bearer s3cre"}, {"authorization": "Bearer s3cret0"},
                           {"authorization": "Basic s3cret"}, {"x-api-key": "s3cret"}, {"authorization": ""}):
                r = client.post(path, json=base, headers=header) if "compl" in path else \
                    client.get(path, headers=header)
                case = f"api key {path} {header}"
                t.add(area, case, "clear" if r.status_code == 401 else "silent" if r.status_code < 400 else
                      "traceback" if r.status_code >= 500 else "clear", f"{r.status_code}")


# ---------------------------------------------------------------------------------------------- checkpoints

def probe_checkpoints(t: Tally, rng: random.Random, demo: str) -> None:
    from safetensors.torch import load_file, save_file

    from kvbuffer import LLM

    area = "checkpoint loader"
    src = Path(demo)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    extra_keys = ["rms_norm_eps", "rope_theta", "partial_rotary_factor", "rope_parameters", "tie_word_embeddings",
                  "eos_token_id", "linear_conv_kernel_dim", "text_config", "layer_types", "torch_dtype"]
    values = [-1, 0, 1, 2.5, -2.5, "x", "", True, None, [], {}, [1], math.nan, math.inf, 10 ** 9, 2 ** 64,
              {"x": 1}, "no", [[[[]]]]]

    def attempt(case: str, path: Path, invalid: bool) -> None:
        try:
            llm = LLM(str(path), device="cpu", max_batch=2, max_len=32, chunk_size=4)
        except Exception as e:
            t.exception(area, case, e)
            return
        try:
            outs = llm.generate([[1, 2, 3]], max_new_tokens=2, stop_token_ids=[])
        except Exception as e:
            t.add(area, case, "traceback", f"loaded, then generate: {type(e).__name__}: {e}")
            return
        t.add(area, case, "silent" if invalid else "correct", f"loaded and ran: {outs[0].token_ids}")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = root / "ckpt"

        def fresh(cfg=None, weights=None, raw_config: bytes | None = None):
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            for f in src.iterdir():
                if f.name not in ("config.json", "model.safetensors") and f.is_file():
                    shutil.copy(f, path / f.name)
            if raw_config is not None:
                (path / "config.json").write_bytes(raw_config)
            else:
                (path / "config.json").write_text(json.dumps(cfg if cfg is not None else config, allow_nan=True))
            save_file(weights if weights is not None else tensors, str(path / "model.safetensors"))

        fresh()
        read = _keys_read(path)
        for key in sorted(config) + [k for k in extra_keys if k not in config]:
            for value in values:
                cfg = dict(config, **{key: value})
                original = config.get(key, "absent")
                # a value of another JSON kind than the field's own, or a negative / non-finite number, in
                # a field the loader reads or one whose meaning it assumes (null: absent, as transformers
                # writes it; a list for eos_token_id: its other form)
                kind_changed = type(value) is not type(original) and not (
                    isinstance(original, (int, float)) and not isinstance(original, bool)
                    and isinstance(value, (int, float)) and not isinstance(value, bool))
                invalid = original != "absent" and value != original and value is not None and (
                    key in read or key in ASSUMED) and not (key == "eos_token_id" and isinstance(value, list)) and (
                    kind_changed or (isinstance(value, float) and not math.isfinite(value)) or (
                        isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0)
                    or (key in ASSUMED and value != original))
                fresh(cfg)
                attempt(f"config {key}={value!r:.30}", path, invalid)
            fresh({k: v for k, v in config.items() if k != key})
            attempt(f"config without {key}", path, False)
        for i, raw in enumerate([b"", b"{", b"[]", b"null", b"\xff\xfe", b"{}", b"[" * 20000 + b"]" * 20000,
                                 json.dumps(config).encode("utf-16")]):
            fresh(raw_config=raw)
            attempt(f"config.json raw #{i}", path, True)

        names = sorted(tensors)
        for name in names:
            w = tensors[name]
            spoils = {
                "int8": lambda w: w.to(torch.int8), "int64": lambda w: w.to(torch.int64),
                "bool": lambda w: w != 0, "float8": lambda w: w.float().to(torch.float8_e4m3fn),
                "transposed": lambda w: w.t().contiguous() if w.dim() == 2 and w.shape[0] != w.shape[1] else None,
                "one more row": lambda w: torch.cat([w, w[:1]]) if w.dim() else None,
                "flattened": lambda w: w.reshape(-1) if w.dim() > 1 else None,
                "scalar": lambda w: w.reshape(-1)[:1].reshape(()),
                "nan": lambda w: w.clone().fill_(math.nan) if w.is_floating_point() else None,
                "inf": lambda w: w.clone().fill_(math.inf) if w.is_floating_point() else None,
                "empty": lambda w: w.reshape(-1)[:0],
            }
            for sname, spoil in spoils.items():
                bad = spoil(w)
                if bad is None:
                    continue
                fresh(weights=dict(tensors, **{name: bad}))
                attempt(f"tensor {name} {sname}", path, True)
            fresh(weights={k: v for k, v in tensors.items() if k != name})
            attempt(f"tensor {name} missing", path, True)
        fresh(weights=dict(tensors, **{"model.unknown.weight": torch.zeros(3)}))
        attempt("an unknown tensor", path, True)
        fresh()
        (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:1000])
        attempt("truncated weights", path, True)


# fields kvbuffer's models do not read but whose value they assume: a checkpoint that says otherwise
# runs as something it is not
ASSUMED = ("hidden_act", "num_hidden_layers")


def _keys_read(path: Path) -> set[str]:
    """The config.json keys the loader reads for the checkpoint at `path`."""
    from kvbuffer.models import config_fields
    from kvbuffer.models.loader import load_checkpoint

    seen, raw, has = set(), config_fields.ConfigFields.raw, config_fields.ConfigFields.has

    def raw_seen(self, key, *a, **kw):
        seen.add(key)
        return raw(self, key, *a, **kw)

    def has_seen(self, key):
        seen.add(key)
        return has(self, key)

    config_fields.ConfigFields.raw, config_fields.ConfigFields.has = raw_seen, has_seen
    try:
        load_checkpoint(path, device="cpu")
    finally:
        config_fields.ConfigFields.raw, config_fields.ConfigFields.has = raw, has
    return seen


# ---------------------------------------------------------------------------------------------- cache

def probe_cache(t: Tally, rng: random.Random) -> None:
    from click.testing import CliRunner

    from kvbuffer import artifacts, gpus
    from kvbuffer.cli.main import main
    from kvbuffer.kernels import lookup
    from tests.kernels.test_cache_properties import CORRUPTIONS, build, tree_digest

    area = "artifact cache"
    gpu = gpus.get_gpu("h200")
    real_detect, real_load = gpus.detect_local_gpu, artifacts.load_library
    gpus.detect_local_gpu = lambda device=0: gpu
    artifacts.load_library = lambda path, function: (None, lambda *a: None)
    lookup.allow_jit(False)
    JSONS = [None, True, 3, -1, "x", "", [], {}, [1, "a"], {"a": None}, "../../victim", 1e308]

    def run_cli(case: str, root: Path, args: list[str], protected: list[Path]) -> None:
        before = {p: tree_digest(p) for p in protected}
        r = CliRunner().invoke(main, args, env={"KVBUFFER_CACHE_DIR": str(root)})
        lost = any(tree_digest(p) != d for p, d in before.items())
        if r.exception is not None and not isinstance(r.exception, SystemExit) or "Traceback" in r.output:
            t.add(area, case, "traceback", f"{type(r.exception).__name__}: {r.output[-200:]}", lost)
        elif r.exit_code in (1, 2):
            lines = r.output.strip().splitlines()
            one_line = any(line.startswith(("Error", "Aborted")) for line in lines) or "Usage" in r.output
            t.add(area, case, "clear" if one_line else "traceback", r.output[-200:], lost)
        else:
            t.add(area, case, "correct", r.output[-200:], lost)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(150):  # corrupted caches, then every reader, then clear
                base = Path(tmp) / f"case{i}"
                root, victim = base / "cache", base / "victim"
                victim.mkdir(parents=True)
                (victim / "precious.txt").write_text("keep me")
                build(root, gpu)
                edits = [rng.choice(sorted(CORRUPTIONS)) for _ in range(rng.randint(1, 3))]
                for name in edits:
                    with contextlib.suppress(Exception):
                        CORRUPTIONS[name](root, rng, rng.choice(JSONS))
                for args in (["cache", "ls"], ["env"], ["cache", "prune"], ["cache", "clear", "--yes"],
                             ["cache", "ls"]):
                    run_cli(f"corrupted ({'+'.join(edits)}) #{i}: {' '.join(args)}", root, args, [victim])
            # folders that are not kvbuffer's: every command must refuse them and leave them byte for byte
            foreign = {
                "another manifest": {"manifest.json": '{"name": "my-app", "version": 3}', "artifacts/x.bin": "data",
                                     "tunings/t.json": "{}", "staging/mywork.txt": "work"},
                "a home folder": {"notes.txt": "hello", "src/main.py": "print(1)"},
                "an empty manifest": {"manifest.json": "", "artifacts/keep": "k"},
                "kvbuffer-like names": {"artifacts/a/meta.json": "{}", "staging/tmp1/x": "y", "photo.jpg": "jpg"},
                "a file as the cache": None,
            }
            for label, files in foreign.items():
                for args in (["cache", "ls"], ["cache", "clear", "--yes"], ["cache", "prune"], ["env"],
                             ["cache", "import", str(Path(tmp) / "nothing.tar")],
                             ["cache", "export", str(Path(tmp) / f"out-{label}.tar")]):
                    for rep in range(8):
                        root = Path(tmp) / f"foreign-{label}-{args[-1][-8:]}-{rep}"
                        if files is None:
                            root.parent.mkdir(exist_ok=True)
                            root.write_text("not a folder")
                            run_cli(f"{label}: {' '.join(args[:3])}", root, args, [])
                            root.unlink()
                            continue
                        for rel, text in files.items():
                            (root / rel).parent.mkdir(parents=True, exist_ok=True)
                            (root / rel).write_text(text)
                        run_cli(f"{label}: {' '.join(args[:3])}", root, args, [root])
            for args in (["cache", "clear"], ["cache", "ls", "--bogus"], ["cache", "prune", "--older-than", "x"],
                         ["cache", "nope"], ["tune", "--chunk-sizes", "0"], ["tune", "--chunk-sizes", "x"],
                         ["tune", "--gpu", "nope", "--build-only"], ["plan", "--context", "-1"],
                         ["plan", "--gpu-memory", "1e400"], ["generate", "--temperature", "nan"],
                         ["generate", "--max-new-tokens", "0"], ["serve", "--port", "-1"],
                         ["serve", "--api-key", ""], ["generate", "--prompt", ""], ["bench", "nope"]):
                root = Path(tmp) / "cli-cache"
                run_cli(" ".join(args), root, args, [])
    finally:
        gpus.detect_local_gpu, artifacts.load_library = real_detect, real_load
        lookup.allow_jit(None)
        lookup.clear_kernels()


# ---------------------------------------------------------------------------------------------- ops

def probe_ops(t: Tally, rng: random.Random, count: int) -> None:
    from tests.kernels.test_ops_properties import SPOILS, _spoil
    from tests.support.op_calls import OPS, POOLS, call_op, call_reference, cloned, snapshot, unchanged, valid_call

    area = "custom ops"
    for i in range(count):
        seed = rng.randrange(2 ** 31)
        name, spoil, via = rng.choice(OPS), rng.choice(sorted(SPOILS)), rng.choice(("op", "reference"))
        r = random.Random(seed)
        call = valid_call(name, r, torch.Generator().manual_seed(seed))
        arg = rng.choice(sorted(call))
        _spoil(call, arg, spoil, r)
        case = f"{via} {name}({arg}: {spoil}) seed {seed}"
        before, reference_call = snapshot(call), cloned(call)
        try:
            out = (call_op if via == "op" else call_reference)(name, call)
        except Exception as e:
            t.exception(area, case, e, lost=not unchanged(before, call))
            continue
        real = [v for v in call.values() if isinstance(v, torch.Tensor) and v.device.type != "meta"]
        if via == "op" and real and out is not None:
            try:
                expected = call_reference(name, reference_call)
                tol = 1e-2 if name == "conv1d_update" else 1e-5
                torch.testing.assert_close(out, expected, rtol=tol, atol=tol, equal_nan=True)
                for pool in POOLS:
                    if pool in before:
                        torch.testing.assert_close(call[pool], reference_call[pool], rtol=0, atol=0, equal_nan=True)
            except Exception as e:
                t.add(area, case, "silent", f"accepted, differs from the reference: {type(e).__name__}: {e}")
                continue
        t.add(area, case, "correct")


# ---------------------------------------------------------------------------------------------- transformers

def probe_transformers(t: Tally, rng: random.Random) -> None:
    import kvbuffer.integrations.transformers as kvb
    from tests.support.hf_models import make_hf_model

    area = "transformers integration"
    model = make_hf_model("qwen3_5_text")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    want = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    for value in _bad_values() + [None, 10 ** 9, 2 ** 31, 1 << 20, torch.tensor(4)]:
        case = f"enable(chunk_size={value!r:.30})"
        try:
            kvb.enable(model, chunk_size=value)
        except Exception as e:
            t.exception(area, case, e)
            continue
        try:
            model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            t.add(area, case, "correct" if isinstance(value, int) and value > 0 else "silent")
        except Exception as e:
            t.add(area, case, "traceback", f"enabled, then generate: {type(e).__name__}: {e}")
        finally:
            kvb.disable(model)
    for target in (None, 3, "model", torch.nn.Linear(2, 2), torch.nn.Sequential(), [model], make_hf_model):
        for fn in ("enable", "disable", "fold", "enabled_layers"):
            case = f"{fn}({type(target).__name__})"
            try:
                getattr(kvb, fn)(target)
                t.add(area, case, "correct" if fn in ("disable", "enabled_layers") and
                      isinstance(target, torch.nn.Module) else "silent", "accepted")
            except Exception as e:
                t.exception(area, case, e)
    for twice in ("enable twice", "disable unenabled"):
        try:
            if twice == "enable twice":
                kvb.enable(model, chunk_size=4)
                kvb.enable(model, chunk_size=8)
            else:
                kvb.disable(model)
                kvb.disable(model)
            t.add(area, twice, "correct")
        except Exception as e:
            t.exception(area, twice, e)
        finally:
            kvb.disable(model)
    after = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    if not torch.equal(after, want):
        t.add(area, "the model after the probe", "clear", lost=True, detail="its greedy output changed")


# ---------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="hardening_probe.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", type=int, default=600, help="random spoilt op calls")
    ap.add_argument("--areas", default="ops,cache,checkpoints,engine,http,transformers")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from kvbuffer import demo_checkpoint

    demo = str(demo_checkpoint())
    t, rng = Tally(), random.Random(args.seed)
    probes = {"ops": lambda: probe_ops(t, rng, args.ops), "cache": lambda: probe_cache(t, rng),
              "checkpoints": lambda: probe_checkpoints(t, rng, demo), "engine": lambda: probe_engine(t, rng, demo),
              "http": lambda: probe_http(t, rng, demo), "transformers": lambda: probe_transformers(t, rng)}
    seconds = {}
    for name in args.areas.split(","):
        t0 = time.perf_counter()
        try:
            probes[name]()
        except Exception as e:  # a probe that broke is a finding of its own
            t.add(name, "the probe itself", "traceback", f"{type(e).__name__}: {e}")
        seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {seconds[name]} s", flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {platform.machine()} "
              f"{os.cpu_count()} cores, torch {torch.__version__}", "seed": args.seed, "seconds": seconds,
              "counts": {a: {k: c[k] for k in ("tried",) + KINDS} for a, c in t.counts.items()},
              "findings": t.findings}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for area, c in result["counts"].items():
        print(f"{area:26s} " + " ".join(f"{k} {c[k]}" for k in ("tried",) + KINDS))


if __name__ == "__main__":
    main()
