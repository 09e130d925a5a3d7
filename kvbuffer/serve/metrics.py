"""Prometheus metrics of one server (its own registry, so that several servers fit in a process).

The gauges are set when /metrics is read, from the engine's published stats (AsyncEngine.stats, what
/health reads too) and the tokens of the last RATE_WINDOW_S seconds: they are never left at the
values of the last step (after a disconnect while idle, or after a failed step)."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 10.0  # tokens/s is averaged over the steps of this many seconds


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("kvbuffer_requests_running", "Requests admitted now (feeding their prompts or decoding)", registry=r)
        self.waiting = Gauge("kvbuffer_requests_waiting", "Requests waiting for a slot", registry=r)
        self.request_slots = Gauge("kvbuffer_request_slots_used_ratio", "Request slots (buffer, conv, KV) in use",
                                   registry=r)
        self.state_slots = Gauge("kvbuffer_state_slots_used_ratio", "Recurrent state slots in use", registry=r)
        self.buffer_fill = Gauge("kvbuffer_buffer_entries_used_ratio",
                                 "Buffer entries in use over all request slots (mode kvbuffer)", registry=r)
        self.tokens_per_second = Gauge("kvbuffer_generation_tokens_per_second",
                                       f"Tokens generated per second over the last {RATE_WINDOW_S:g} s", registry=r)
        self.acceptance = Gauge("kvbuffer_spec_acceptance_rate", "Speculative drafts accepted / proposed", registry=r)
        self.prompt_tokens = Counter("kvbuffer_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generated = Counter("kvbuffer_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("kvbuffer_requests_finished", "Requests finished", ["finish_reason"], registry=r)
        self.rejected = Counter("kvbuffer_requests_rejected", "Requests answered with an error",
                                ["status"], registry=r)
        self.ttft = Histogram("kvbuffer_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvbuffer_time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)
        self._window: list[tuple[float, int]] = []  # (time, tokens) of the recent steps
        self._lock = threading.Lock()  # the window: written by the engine thread, read by /metrics
        self._started = time.monotonic()

    def on_step(self, outs) -> None:
        """Called by the engine thread after each step (outs: its StepOutputs)."""
        now, tokens = time.monotonic(), sum(len(o.token_ids) for o in outs)
        self.generated.inc(tokens)
        with self._lock:
            self._window = [(t, n) for t, n in self._window if now - t < RATE_WINDOW_S] + [(now, tokens)]

    def recent_tokens_per_second(self, now: float) -> float:
        """Tokens generated in the RATE_WINDOW_S seconds before `now`, per second (over the time the
        server has run, where that is shorter)."""
        with self._lock:
            tokens = sum(n for t, n in self._window if now - t < RATE_WINDOW_S)
        return tokens / max(min(RATE_WINDOW_S, now - self._started), 1e-3)

    def render(self, stats, limits) -> bytes:
        """The metrics in Prometheus' text format; stats and limits: the engine's (EngineStats, EngineLimits)."""
        self.tokens_per_second.set(self.recent_tokens_per_second(time.monotonic()))
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.request_slots.set(1 - stats.request_slots_free / limits.max_requests)
        if stats.state_slots_free is not None:
            self.state_slots.set(1 - stats.state_slots_free / limits.max_states)
        if stats.buffered_tokens is not None:
            self.buffer_fill.set(stats.buffered_tokens / (limits.max_requests * limits.chunk_size))
        if stats.drafts is not None:
            self.acceptance.set(stats.drafts.acceptance_rate)
        return generate_latest(self.registry)

    def on_request_done(self, arrival: float, first: float | None, last: float | None, tokens: int,
                        finish_reason: str) -> None:
        """Called once per choice however it ends: finish_reason as the client sees it ("stop" for a stop
        token or a stop string, "length"), "error" (the request failed), or "abort" (the client went away)."""
        self.finished.labels(finish_reason).inc()
        if first is not None:
            self.ttft.observe(first - arrival)
        if first is not None and tokens > 1:
            self.tpot.observe((last - first) / (tokens - 1))
