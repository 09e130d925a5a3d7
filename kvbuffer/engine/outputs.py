"""What the engine hands out: generation results, per-step outputs, and read-only views of its
statistics and limits (what a server reports without reaching into the runner)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens, or the context reached max_len)
    text: str | None = None
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # with return_logits=True


@dataclass(frozen=True)
class StepOutput:
    """Tokens one request got in one engine step; finish_reason is set on its last output. A request
    that failed alone (NaN or infinite logits, a failed sampling) ends with finish_reason "error" and
    `error`, one line saying why; the other requests of the step are unaffected."""
    rid: int
    token_ids: list[int]
    logprobs: list[float] | None  # with SamplingParams.logprobs
    finish_reason: str | None
    error: str | None = None


def group_events(events, finished: dict, errors: dict | None = None) -> list[StepOutput]:
    """(rid, token, logprob) events of a step -> one StepOutput per run of one request's tokens;
    finished: rid -> finish_reason, errors: rid -> message of the failed ones."""
    out = []
    for i, (rid, token, logprob) in enumerate(events):
        if out and out[-1].rid == rid and i and events[i - 1][0] == rid:
            out[-1].token_ids.append(token)
            if logprob is not None:
                out[-1].logprobs.append(logprob)
            continue
        out.append(StepOutput(rid, [token], None if logprob is None else [logprob], None))
    last = {o.rid: k for k, o in enumerate(out)}
    errors = errors or {}
    for rid, reason in finished.items():
        if rid in last:
            out[last[rid]] = dataclasses.replace(out[last[rid]], finish_reason=reason, error=errors.get(rid))
        else:
            out.append(StepOutput(rid, [], None, reason, errors.get(rid)))
    return out


@dataclass
class GenerationStats:
    """One generate() call's counts and timings."""
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    decode_seconds: float = 0.0  # time in decode (or draft + verify) steps, sampling included
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens those steps emitted
    peak_batch: int = 0  # most requests decoded together
    step_seconds: list[float] = field(default_factory=list, repr=False)  # each decode step's wall time
    step_tokens: list[int] = field(default_factory=list, repr=False)  # and the tokens it emitted
    step_rows: list[int] = field(default_factory=list, repr=False)  # and the requests it fed

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def add_step(self, seconds: float, tokens: int, rows: int, batch: int) -> None:
        self.decode_seconds += seconds
        self.decode_steps += 1
        self.decode_tokens += tokens
        self.step_seconds.append(seconds)
        self.step_tokens.append(tokens)
        self.step_rows.append(rows)
        self.peak_batch = max(self.peak_batch, batch)


@dataclass
class DraftStats:
    """Speculative decoding so far, summed over the requests of each verify step."""
    request_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.request_steps if self.request_steps else 0.0


@dataclass(frozen=True)
class EngineLimits:
    """The engine's fixed sizes: request and state slots, context length, chunk size, drafts per step."""
    max_requests: int
    max_states: int
    max_len: int
    chunk_size: int
    draft_tokens: int  # 0 without speculative decoding


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine between steps (`running` counts the admitted requests, `prefilling` those of
    them still feeding their prompts)."""
    running: int
    waiting: int
    request_slots_free: int
    state_slots_free: int | None  # None: no recurrent states (a model without linear layers)
    buffered_tokens: int | None  # entries in the running requests' buffers; None: no buffers (recurrent mode)
    drafts: DraftStats | None  # None without speculative decoding
    prefilling: int = 0
