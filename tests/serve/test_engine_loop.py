"""The engine thread in-process: a request that fails (bad input, or a step that raises) fails
alone or with its step's batch, never the ones after it, and no slot stays taken."""

import asyncio

import pytest

pytest.importorskip("fastapi")

from kvbuffer import LLM, demo_checkpoint  # noqa: E402
from kvbuffer.engine.sampling import SamplingParams  # noqa: E402
from kvbuffer.errors import QueueFullError  # noqa: E402
from kvbuffer.serve.engine_loop import AsyncEngine  # noqa: E402

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
            with pytest.raises(RuntimeError, match="engine step failed: RuntimeError: injected"):
                await _tokens(engine, [84, 104, 101, 32])
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await _tokens(engine, [10 ** 6])
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
