"""Overlapped decode steps: step n + 1 is queued before step n's tokens are read back.

Positions, slots and buffer fills advance by one whatever token is picked, and the pick (argmax or
a draw: sampling.pick_rows) stays on the device, so the host reads step n's tokens while the GPU runs
step n + 1. The price is one step of lag on a stop token: that request's token from step n + 1 is
dropped (its writes land in slots freed after step n + 1 was queued, on the same stream). Rows that
end by length are known in advance and never fed the extra step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .graphs import PendingTokens
from .request import Request

@dataclass
class InflightStep:
    """A queued decode step whose tokens the host has not read yet, row by row."""
    rows: list[Request]
    tokens: PendingTokens


def ends_at_length(req: Request, outputs: int, max_len: int) -> bool:
    """Whether a request with `outputs` tokens generated is done by length: max_new_tokens, or a
    context that fills max_len (EngineCore.emit's rule, which plan_feed applies one token ahead)."""
    return outputs >= req.params.max_new_tokens or len(req.prompt) + outputs >= max_len


def plan_feed(running: list[Request], inflight: InflightStep | None, max_len: int) -> tuple[list[Request], list[int]]:
    """The rows of the next overlapped step and where each one's token comes from: -1 (its context
    holds it) or its row in the step in flight. A row that the step in flight ends by length is left out."""
    index = {r.rid: i for i, r in enumerate(inflight.rows)} if inflight is not None else {}
    rows, feed = [], []
    for req in running:
        i = index.get(req.rid, -1)
        if i >= 0 and ends_at_length(req, len(req.output) + 1, max_len):
            continue
        rows.append(req)
        feed.append(i)
    return rows, feed


def use_overlap(overlap, device) -> bool:
    """EngineConfig.overlap (checked there): True, False or "auto" (on CUDA, where the host's work hides
    behind the GPU's)."""
    return device.type == "cuda" if overlap == "auto" else bool(overlap)


class OverlapPipeline:
    """The overlapped decode steps of an engine: at most one step in flight, whose tokens `emit`
    (request, token) delivers one step later; `pick(logits, requests)` picks them on the device
    (EngineCore.pick: NO_TOKEN for a row that has none, which `emit` finishes with an error)."""

    def __init__(self, runner, pick, emit):
        self.runner, self.pick, self.emit = runner, pick, emit
        self.inflight: InflightStep | None = None

    def step(self, running: list[Request]) -> int:
        """Queue a step of `running` (picks left on the device), then emit the step in flight's
        tokens while the GPU runs it. Returns the rows of the step emitted."""
        rows, feed = plan_feed(running, self.inflight, self.runner.spec.max_len)
        queued = None
        if rows:
            logits = self.runner.decode(rows, feed)
            picks = self.pick(logits, rows)
            queued = InflightStep(rows, self.runner.hold(picks))
        settled = self.settle()
        self.inflight = queued
        return settled

    def settle(self) -> int:
        """Emit the step in flight's tokens, if any (a request that ended meanwhile drops its own);
        returns that step's rows (0: none in flight)."""
        step, self.inflight = self.inflight, None
        if step is None:
            return 0
        for req, token in zip(step.rows, step.tokens.tolist()):
            if req.finish_reason is None:
                self.emit(req, token)
        return len(step.rows)
