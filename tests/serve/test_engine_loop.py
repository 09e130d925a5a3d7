"""The engine thread in-process: a request that fails (bad input, a row the engine fails, or a step
that raises) fails alone or with its step's batch, never the ones after it, and no slot stays taken;
the stats it publishes (what /health and /metrics read) follow every change, not only steps."""

import asyncio
import contextlib
import re
import time

import pytest

pytest.importorskip("fastapi")

from kvbuffer import LLM, demo_checkpoint  # noqa: E402
from kvbuffer.engine.sampling import SamplingParams  # noqa: E402
from kvbuffer.errors import QueueFullError  # noqa: E402
from kvbuffer.serve import metrics as metrics_module  # noqa: E402
from kvbuffer.serve.engine_loop import AsyncEngine, RequestFailed  # noqa: E402
from kvbuffer.serve.metrics import ServerMetrics  # noqa: E402

from .row_errors import ROW_ERROR, fail_rows_of  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=6)


async def _tokens(engine, prompt):
    engine.reserve(1)
    out = []
    async for step in engine.generate(prompt, GREEDY):
        out += step.token_ids
    return out


@pytest.fixture
def llm():
    return LLM(str(demo_checkpoint()), device="cpu", max_batch=2)


@pytest.mark.parametrize("where", ["_prefill", "_decode_step"])
def test_a_bad_request_and_a_failed_step_fail_alone(llm, where):
    want = llm.generate([[84, 104, 101, 32]], max_new_tokens=6)[0].token_ids
    engine = AsyncEngine(llm, max_waiting=1)
    real, calls = getattr(llm.core, where), []

    def failing_once(*args):  # the first request fails in its prefill, or in its first decode
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*args)

    setattr(llm.core, where, failing_once)
    engine.start()
    try:
        async def scenario():
            with pytest.raises(RequestFailed, match="engine step failed: RuntimeError: injected") as step:
                await _tokens(engine, [84, 104, 101, 32])
            with pytest.raises(RequestFailed, match="outside the vocabulary") as refused:
                await _tokens(engine, [10 ** 6])
            assert not step.value.own_values and refused.value.own_values  # a 500 and a 400
            return await asyncio.wait_for(_tokens(engine, [84, 104, 101, 32]), 60)

        assert asyncio.run(scenario()) == want
        assert engine.in_flight == 0
    finally:
        engine.stop()
    assert llm.runner.caches.requests.num_free == 2 and not llm.has_work()


def test_reserve_is_bounded_by_slots_and_queue(llm):
    engine = AsyncEngine(llm, max_waiting=1)
    engine.reserve(3)
    with pytest.raises(QueueFullError, match="3 requests in flight; the server takes 3"):
        engine.reserve(1)
    with pytest.raises(ValueError, match="max_waiting"):
        AsyncEngine(llm, max_waiting=-1)


def test_a_row_the_engine_fails_fails_only_its_request(llm):
    """The engine finishes one request with finish_reason "error" (its own values: a client error);
    a request beside it gets exactly generate's tokens, and every slot comes back."""
    victim, other = [66, 97, 100, 32], [84, 104, 101, 32]
    want = llm.generate([other], max_new_tokens=6)[0].token_ids
    failed = fail_rows_of(llm, victim)
    engine = AsyncEngine(llm, max_waiting=1)
    engine.start()
    try:
        async def scenario():
            return await asyncio.wait_for(asyncio.gather(_tokens(engine, victim), _tokens(engine, other),
                                                         return_exceptions=True), 60)

        bad, good = asyncio.run(scenario())
    finally:
        engine.stop()
    assert isinstance(bad, RequestFailed) and bad.own_values and str(bad) == ROW_ERROR
    assert good == want and len(failed) == 1
    assert engine.in_flight == 0 and llm.runner.caches.requests.num_free == 2 and not llm.has_work()


async def _until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def _gauge(metrics, llm, engine, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", metrics.render(engine.stats, llm.limits).decode(), re.M).group(1))


def test_stats_follow_an_abort_while_idle_and_a_failed_step(llm, monkeypatch):
    """A client that leaves while nothing else runs, and a step that fails its two requests: no step
    follows either, and the published stats (and the metrics' gauges read from them) still show
    nothing running; tokens/s falls to 0 once its window has passed."""
    monkeypatch.setattr(metrics_module, "RATE_WINDOW_S", 0.5)
    metrics = ServerMetrics()
    engine = AsyncEngine(llm, max_waiting=1, metrics=metrics)
    real, calls = llm.core._decode_step, []

    def failing_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(*args)

    engine.start()
    try:
        async def scenario():
            engine.reserve(1)
            async with contextlib.aclosing(engine.generate([84, 104, 101, 32], SamplingParams(200))) as outs:
                async for _ in outs:
                    break  # one output, then the client goes away
            assert await _until(lambda: engine.in_flight == 0)
            assert engine.stats.running == 0 and _gauge(metrics, llm, engine, "kvbuffer_requests_running") == 0
            assert _gauge(metrics, llm, engine, "kvbuffer_generation_tokens_per_second") > 0
            await asyncio.sleep(0.6)
            assert _gauge(metrics, llm, engine, "kvbuffer_generation_tokens_per_second") == 0

            llm.core._decode_step = failing_third
            both = [_tokens(engine, [84, 104, 101, 32]), _tokens(engine, [100, 101, 102, 32])]
            results = await asyncio.wait_for(asyncio.gather(*both, return_exceptions=True), 60)
            assert all(isinstance(r, RequestFailed) for r in results) or calls[2:] == []
            assert engine.stats.running == 0 and _gauge(metrics, llm, engine, "kvbuffer_requests_running") == 0
            assert engine.stats.request_slots_free == 2

        asyncio.run(scenario())
    finally:
        engine.stop()
