"""The HTTP routes: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health
and /metrics. Each choice of a request is one engine request; every error is an OpenAI error object
(http.py). A request body is read under a size limit, then parsed, checked and tokenized in a worker
thread, so that the event loop (and /health) never waits for a big body."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..engine.sampling import SamplingParams
from ..errors import QueueFullError
from .chat import ChatTemplate, chat_prompt
from .engine_loop import AsyncEngine, RequestFailed
from .http import ApiKeyCheck, BadRequest, error_body, error_response, parse, read_body
from .limits import DEFAULT_MAX_BODY_BYTES
from .schemas import ChatCompletionRequest, CompletionRequest
from .stream import ChoiceText

DISCONNECT_POLL_S = 0.1
SCHEMAS = {"completion": CompletionRequest, "chat": ChatCompletionRequest}
log = logging.getLogger("kvbuffer.serve")


def build_app(engine: AsyncEngine, model_name: str, metrics=None, chat_template: ChatTemplate | None = None, *,
              api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The server's app; its lifespan starts the engine thread and, at shutdown (after uvicorn has
    drained the requests in flight), stops it. chat_template: chat prompts' template in place of the
    tokenizer's. api_key: required (as a bearer token) on every route but /health. max_body_bytes:
    larger request bodies get 413."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string (or None: no key)")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="kvbuffer", lifespan=lifespan)
    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    llm = engine.llm
    handler = _Handler(engine, model_name, metrics, chat_template, max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        err = exc.errors()[0]
        return _rejected(metrics, error_response(400, f"{'.'.join(map(str, err.get('loc', ())))}: {err.get('msg')}"))

    @app.exception_handler(HTTPException)
    async def _http(_request, exc: HTTPException):  # starlette's own: an unknown route, a wrong method
        return _rejected(metrics, error_response(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(BadRequest)
    async def _bad(_request, exc: BadRequest):
        return _rejected(metrics, error_response(exc.status, str(exc), exc.param))

    @app.exception_handler(QueueFullError)
    async def _full(_request, exc: QueueFullError):
        return _rejected(metrics, error_response(503, str(exc)))

    @app.exception_handler(Exception)
    async def _crashed(_request, exc: Exception):  # a bug: the client gets a JSON 500, the log the traceback
        log.error("kvbuffer: request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        return _rejected(metrics, error_response(500, f"internal error: {type(exc).__name__}"))

    @app.get("/health")
    async def health():
        stats = engine.stats
        return {"status": "ok", "in_flight": engine.in_flight, "running": stats.running,
                "waiting": stats.waiting, "request_slots_free": stats.request_slots_free}

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "kvbuffer",
            "max_model_len": llm.limits.max_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise BadRequest(f"model {model_id!r} is not served here (this server serves {model_name!r})", "model",
                             status=404)
        return card

    @app.get("/metrics")
    async def metrics_route():
        if metrics is None:
            return error_response(404, "this server keeps no metrics")
        return Response(metrics.render(engine.stats, llm.limits), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handler.run("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handler.run("chat", request)

    return app


def _rejected(metrics, response):
    if metrics is not None:
        metrics.rejected.labels(str(response.status_code)).inc()
    return response


# SamplingParams' field -> the request field that sets it (the others have the same name)
REQUEST_FIELDS = {"max_new_tokens": "max_tokens", "stop_token_ids": "stop"}


class _Handler:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics, chat_template: ChatTemplate | None,
                 max_body_bytes: int):
        self.engine, self.llm, self.model_name, self.metrics = engine, engine.llm, model_name, metrics
        self.chat_template, self.max_body_bytes = chat_template, max_body_bytes

    # request -> engine requests (in a worker thread) ---------------------------------------------
    def _prepare(self, kind: str, raw: bytes):
        """The request body -> (its checked fields, [(prompt ids, SamplingParams)] one per choice, prompt
        tokens); BadRequest for anything wrong with it. Parses and tokenizes: run it off the event loop."""
        body = parse(SCHEMAS[kind], raw)
        if body.model is not None and body.model != self.model_name:
            raise BadRequest(f"model {body.model!r} is not served here (this server serves {self.model_name!r})",
                             "model", status=404)
        prompts = self._prompts(kind, body)
        choices = len(prompts) * body.n
        if choices > self.engine.capacity:
            raise BadRequest(f"the request asks for {choices} completions (prompts x n); this server takes "
                             f"{self.engine.capacity} at once", "n")
        jobs = [(p, self._params(kind, body, len(p), i * body.n + j)) for i, p in enumerate(prompts)
                for j in range(body.n)]
        return body, jobs, sum(len(p) for p in prompts)

    def _encode(self, prompt, param: str) -> list[int]:
        llm = self.llm
        if isinstance(prompt, str):
            if llm.tokenizer is None:
                raise BadRequest("this model has no tokenizer: send token ids", param)
            ids = list(llm.tokenizer.encode(prompt))
        else:
            ids = list(prompt)
        if not ids:
            raise BadRequest("the prompt is empty", param)
        bad = [t for t in ids if not 0 <= t < llm.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {llm.vocab_size})", param)
        if len(ids) >= llm.limits.max_len:
            raise BadRequest(f"the prompt has {len(ids)} tokens; this server's max_len is "
                             f"{llm.limits.max_len}", param)
        return ids

    def _prompts(self, kind: str, body) -> list[list[int]]:
        if kind == "chat":
            try:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            except ValueError as e:
                raise BadRequest(str(e), "messages") from None
            if self.llm.tokenizer is None:
                raise BadRequest("this model has no tokenizer, so chat messages cannot be encoded", "messages")
            try:
                text = chat_prompt(self.llm.tokenizer, messages, self.chat_template)
            except ValueError as e:
                raise BadRequest(str(e), "messages") from None
            return [self._encode(text, "messages")]
        p = body.prompt
        if isinstance(p, str) or (isinstance(p, list) and isinstance(p[0], int)):
            return [self._encode(p, "prompt")]
        return [self._encode(x, "prompt") for x in p]

    def _params(self, kind: str, body, prompt_len: int, choice: int) -> SamplingParams:
        """The choice's SamplingParams; the engine's own rules (SamplingParams') refuse a value as a
        BadRequest naming the request field."""
        limit = body.max_completion_tokens if kind == "chat" and body.max_completion_tokens else body.max_tokens
        if limit is None:
            limit = 16 if kind == "completion" else self.llm.limits.max_len - prompt_len
        eos = () if body.ignore_eos else tuple(self.llm.model.config.eos_token_ids)
        bad = [t for t in body.stop_token_ids() if t >= self.llm.vocab_size]
        if bad:
            raise BadRequest(f"stop token id {bad[0]} is outside the vocabulary", "stop")
        try:
            return SamplingParams(max_new_tokens=limit, temperature=body.temperature, top_k=max(body.top_k, 0),
                                  top_p=body.top_p, seed=None if body.seed is None else body.seed + choice,
                                  stop_token_ids=eos + tuple(body.stop_token_ids()),
                                  logprobs=body.logprobs is not None if kind == "completion" else body.logprobs,
                                  presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                  repetition_penalty=body.repetition_penalty)
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e), _named_field(str(e))) from None

    async def run(self, kind: str, request: Request):
        raw = await read_body(request, self.max_body_bytes)
        body, jobs, prompt_tokens = await asyncio.to_thread(self._prepare, kind, raw)
        self.engine.reserve(len(jobs))
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(prompt_tokens)
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        events: asyncio.Queue = asyncio.Queue()
        text = dict(stops=body.stop_strings(), skip_special_tokens=body.skip_special_tokens)
        tasks = [asyncio.create_task(self._choice(rid, index, ids, params, text, events))
                 for index, (ids, params) in enumerate(jobs)]
        usage = {"prompt_tokens": prompt_tokens}
        fmt = _Format(kind, rid, self.model_name, self.llm.tokenizer)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._sse(tasks, events, fmt, usage, include_usage),
                                     media_type="text/event-stream")
        return await self._collect(tasks, request, fmt, usage)

    async def _choice(self, rid: str, index, ids, params, text: dict, events: asyncio.Queue) -> dict:
        """Run one choice: put ("piece", index, text, token ids, logprobs, finish reason) events, then
        ("done", index, error or None); return its summary. `text`: ChoiceText's stops and skip_special_tokens.
        However it ends, the metrics count it by finish reason ("error": it failed; "abort": cancelled)
        and a debug line logs it."""
        text = ChoiceText(self.llm.tokenizer, ids, **text)
        arrival, first, last, reason = time.monotonic(), None, None, None
        token_ids, logprobs = [], []
        try:
            async with contextlib.aclosing(self.engine.generate(ids, params)) as outs:
                async for out in outs:
                    last = time.monotonic()
                    first = first or last
                    token_ids += out.token_ids
                    logprobs += out.logprobs or []
                    shown = out.token_ids
                    if out.finish_reason == "stop" and shown and shown[-1] in params.stop_token_ids:
                        shown = shown[:-1]  # a stop token's text is not part of the answer (as eos's is not)
                    piece = text.push(shown)
                    reason = "stop" if text.stopped else out.finish_reason
                    if reason is not None and not text.stopped:
                        piece += text.finish()
                    events.put_nowait(("piece", index, piece, out.token_ids, out.logprobs, reason))
                    if reason is not None:
                        break  # at a stop string, leaving the generator aborts the request in the engine
        except Exception as e:
            reason = "error"
            events.put_nowait(("done", index, e))
            raise
        finally:
            if self.metrics is not None:
                self.metrics.on_request_done(arrival, first, last, len(token_ids), reason or "abort")
            log.debug("%s choice %d: %d prompt tokens, %s; finish %s, %d tokens, %.3f s", rid, index, len(ids),
                      _params_text(params), reason or "abort", len(token_ids), time.monotonic() - arrival)
        events.put_nowait(("done", index, None))
        return {"index": index, "text": text.text, "token_ids": token_ids,
                "logprobs": logprobs if params.logprobs else None, "finish_reason": reason}

    async def _sse(self, tasks, events, fmt: "_Format", usage: dict, include_usage: bool):
        try:
            left = len(tasks)
            while left:
                event = await events.get()
                if event[0] == "piece":
                    yield _sse_data(fmt.chunk(*event[1:]))
                    continue
                left -= 1
                if event[2] is not None:  # the request failed: its error, then the end of the stream
                    yield _sse_data(error_body(*_failure(event[2])))
                    yield "data: [DONE]\n\n"
                    return
            if include_usage:
                yield _sse_data(fmt.usage_chunk(_usage(usage, [t.result() for t in tasks])))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): stop every choice still running
            for t in tasks:
                t.cancel()

    async def _collect(self, tasks, request: Request, fmt: "_Format", usage: dict):
        gathered = asyncio.gather(*tasks)
        try:
            while not gathered.done():
                await asyncio.wait([gathered], timeout=DISCONNECT_POLL_S)
                if not gathered.done() and await request.is_disconnected():
                    gathered.cancel()
                    return Response(status_code=499)
            choices = gathered.result()
        except Exception as e:
            for t in tasks:
                t.cancel()
            return _rejected(self.metrics, error_response(*_failure(e)))
        return fmt.response(choices, _usage(usage, choices))


def _failure(e: Exception) -> tuple[int, str]:
    """A failed choice's HTTP status and message: 400 where its own values failed it, else 500."""
    if isinstance(e, RequestFailed):
        return (400 if e.own_values else 500), f"generation failed: {e}"
    log.error("kvbuffer: generation failed: %s: %s", type(e).__name__, e, exc_info=e)
    return 500, f"generation failed: internal error ({type(e).__name__})"


def _named_field(message: str) -> str | None:
    """The request field an engine error message names first (SamplingParams' messages start with it)."""
    names = [f.name for f in dataclasses.fields(SamplingParams) if f.name in message]
    if not names:
        return None
    first = min(names, key=message.index)
    return REQUEST_FIELDS.get(first, first)


def _params_text(params: SamplingParams) -> str:
    """A request's sampling params as `name=value` pairs, for the request log."""
    return " ".join(f"{f.name}={getattr(params, f.name)}" for f in dataclasses.fields(params))


def _usage(usage: dict, choices: list[dict]) -> dict:
    done = sum(len(c["token_ids"]) for c in choices)
    return dict(usage, completion_tokens=done, total_tokens=usage["prompt_tokens"] + done)


def _sse_data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Format:
    """OpenAI's response and chunk shapes for one request."""

    def __init__(self, kind: str, rid: str, model: str, tokenizer):
        self.kind, self.rid, self.model, self.tokenizer = kind, rid, model, tokenizer
        self.created = int(time.time())
        self.started: set[int] = set()

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, token_ids, logprobs):
        if logprobs is None:
            return None
        words = [self.tokenizer.decode([t]) if self.tokenizer is not None else str(t) for t in token_ids]
        if self.kind == "completion":
            return {"tokens": words, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}
        return {"content": [{"token": w, "logprob": lp, "bytes": list(w.encode()), "top_logprobs": []}
                            for w, lp in zip(words, logprobs)]}

    def chunk(self, index, text, token_ids, logprobs, reason) -> dict:
        if self.kind == "completion":
            choice = {"index": index, "text": text, "logprobs": self._logprobs(token_ids, logprobs),
                      "finish_reason": reason}
            return dict(self._head("text_completion"), choices=[choice])
        delta = {"content": text}
        if index not in self.started:
            self.started.add(index)
            delta["role"] = "assistant"
        choice = {"index": index, "delta": delta, "logprobs": self._logprobs(token_ids, logprobs),
                  "finish_reason": reason}
        return dict(self._head("chat.completion.chunk"), choices=[choice])

    def usage_chunk(self, usage: dict) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return dict(self._head(obj), choices=[], usage=usage)

    def response(self, choices, usage) -> JSONResponse:
        if self.kind == "completion":
            out = [{"index": c["index"], "text": c["text"], "logprobs": self._logprobs(c["token_ids"], c["logprobs"]),
                    "finish_reason": c["finish_reason"]} for c in choices]
            return JSONResponse(dict(self._head("text_completion"), choices=out, usage=usage))
        out = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                "logprobs": self._logprobs(c["token_ids"], c["logprobs"]), "finish_reason": c["finish_reason"]}
               for c in choices]
        return JSONResponse(dict(self._head("chat.completion"), choices=out, usage=usage))
