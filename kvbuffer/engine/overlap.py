"""Overlapped decode steps: step n + 1 is queued before step n's tokens are read back.

A synchronous decode step leaves the GPU idle while the host reads the sampled tokens back, emits
them and prepares the next step's inputs: about 3 ms of a 20 ms step for a 9B model at batch 256.
Nothing the next step needs from the host depends on the token picked: positions, slots and
buffer fills advance by one whatever it is, and the pick itself (argmax, or a draw for a sampled
row: sampling.pick_rows) can stay on the device (StepInputs.hold, then upload(feed=...)). So the
engine queues step n + 1 first and reads step n's tokens while the GPU runs it; only rows whose
logits the host wants (kept, or for log-probabilities) make a step synchronous.

The price is one step of lag on a stop token: a request whose step-n token stops it was fed to
step n + 1 already, and that step's token for it is dropped. Its writes are harmless: the request's
slots are freed after step n + 1 was queued, and whatever reuses them is queued after it on the
same stream. Rows that end by length are known in advance and never fed the extra step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .graphs import PendingTokens
from .request import Request

OVERLAP_CHOICES = (True, False, "auto")


@dataclass
class InflightStep:
    """A queued decode step whose tokens the host has not read yet, row by row."""
    rows: list[Request]
    tokens: PendingTokens


def ends_at_length(req: Request, outputs: int, max_len: int) -> bool:
    """Whether a request with `outputs` tokens generated is done by length: max_new_tokens, or a
    context that fills max_len (LLM._emit's rule, which plan_feed applies one token ahead)."""
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
    """LLM(overlap=...): True, False or "auto" (on CUDA, where the host's work can hide behind the GPU's)."""
    if overlap not in OVERLAP_CHOICES:
        raise ValueError(f"overlap must be True, False or 'auto', got {overlap!r}")
    return device.type == "cuda" if overlap == "auto" else bool(overlap)
