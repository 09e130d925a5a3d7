"""The engine loop: one background thread owns the LLM and steps it while requests are in flight.

HTTP handlers never touch the engine: they send commands (add, abort) through a queue that the
thread drains between steps, and read their request's outputs from an asyncio queue the thread
fills. So requests arriving at any time join the running batch at the next step (continuous
batching), an abort (a client that went away) frees the request's slots before the next step,
and the number of requests in flight is bounded (QueueFullError past it, which the server answers
with 503). A request that fails fails alone (RequestFailed): refused at admission, or finished by
the engine with finish_reason "error" while the rest of its step goes on. Only a step that raises
fails the requests in it. After every change the thread publishes the engine's stats (`stats`),
the one view of it that /health and /metrics read.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass

from ..engine.outputs import EngineStats, StepOutput
from ..engine.sampling import SamplingParams
from ..errors import QueueFullError

log = logging.getLogger("kvbuffer.serve")


class RequestFailed(Exception):
    """A request that failed. own_values: its own values caused it (the engine refused it, or
    finished it alone with an error: a client's error), else the engine failed (a step raised)."""

    def __init__(self, message: str, own_values: bool):
        super().__init__(message)
        self.own_values = own_values


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    rid: int | None = None


class AsyncEngine:
    """max_waiting: requests that may wait for a slot beyond the engine's max_batch running ones."""

    def __init__(self, llm, *, max_waiting: int = 256, metrics=None):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        if llm.has_work():  # (this also creates the scheduler now, before two threads could race to)
            raise ValueError("the LLM has requests in flight; give AsyncEngine an idle one")
        self.llm, self.metrics = llm, metrics
        self.capacity = llm.limits.max_requests + max_waiting
        self._keys = itertools.count()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._streams: dict[int, _Stream] = {}  # key -> stream, touched by the engine thread only
        self._by_rid: dict[int, int] = {}  # engine rid -> key
        self._stopping = False
        self.stats: EngineStats = llm.stats  # replaced (never changed) by the engine thread after each change
        self._thread = threading.Thread(target=self._run, name="kvbuffer-engine", daemon=True)

    # the asyncio side ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what is in flight, then end the thread."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def reserve(self, count: int) -> None:
        """Claim room for `count` requests before submitting them (all or none)."""
        with self._lock:
            if self._stopping:
                raise QueueFullError("the server is shutting down")
            if self._in_flight + count > self.capacity:
                raise QueueFullError(f"{self._in_flight} requests in flight; the server takes {self.capacity} "
                                     f"(max_batch + max_waiting)")
            self._in_flight += count

    def _unreserve(self) -> None:
        with self._lock:
            self._in_flight -= 1

    async def generate(self, prompt_ids: list[int], params: SamplingParams):
        """Yield this request's StepOutputs until it finishes (reserve() first). Leaving early (the
        client went away, or the consumer stopped at a stop string) aborts it in the engine."""
        key = next(self._keys)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._send(("add", key, stream, list(prompt_ids), params))
        finished = False
        try:
            while True:
                out = await stream.outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finish_reason is not None
                if out.finish_reason == "error":
                    raise RequestFailed(out.error or "the engine could not finish this request", own_values=True)
                yield out
                if finished:
                    return
        finally:  # the room is given back once the engine holds nothing of the request any more
            if finished:
                self._unreserve()  # the engine freed its slots before delivering the last output
            else:
                self._send(("abort", key))  # the engine thread frees the slots, then gives the room back

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        llm = self.llm
        while True:
            self._drain()
            if not llm.has_work():
                if self._stopping and self._commands.empty():
                    return
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outs = llm.step()
            except Exception as e:  # one step's requests fail; the others (waiting) go on
                log.exception("kvbuffer: engine step failed")
                self._fail_running(f"engine step failed: {type(e).__name__}: {e}")
                continue
            self._publish()
            for out in outs:
                self._deliver(out)
            if self.metrics is not None:
                self.metrics.on_step(outs)

    def _publish(self) -> None:
        """Replace `stats` with the engine's now: called after each change and before anyone is told
        of it (an output delivered, a slot's room given back), so that no reader sees older stats."""
        self.stats = self.llm.stats

    def _drain(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, key, stream, prompt_ids, params = command
                try:
                    stream.rid = self.llm.add_request(prompt_ids, params)
                except Exception as e:  # a bad request fails alone
                    failure = RequestFailed(str(e), own_values=isinstance(e, (ValueError, TypeError)))
                    stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, failure)
                    continue
                self._streams[key] = stream
                self._by_rid[stream.rid] = key
                self._publish()
            else:  # abort: also sent for requests the engine never took or already ended
                stream = self._streams.pop(command[1], None)
                if stream is not None:
                    self._by_rid.pop(stream.rid, None)
                    self.llm.abort(stream.rid)
                    self._publish()
                self._unreserve()

    def _deliver(self, out: StepOutput) -> None:
        key = self._by_rid.get(out.rid)
        if key is None:
            return
        stream = self._streams[key]
        if out.finish_reason is not None:
            del self._streams[key], self._by_rid[out.rid]
        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, out)

    def _fail_running(self, message: str) -> None:
        """After a failed step: every request but those still waiting was in it (running, or
        admitted by it and already released by the engine) and fails; the waiting ones go on."""
        waiting = self.llm.waiting_ids()
        failed = [(key, stream) for key, stream in self._streams.items() if stream.rid not in waiting]
        for key, stream in failed:
            self.llm.abort(stream.rid)
            del self._streams[key], self._by_rid[stream.rid]
        self._publish()
        for _, stream in failed:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, RequestFailed(message, own_values=False))
