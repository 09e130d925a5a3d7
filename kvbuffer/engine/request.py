"""A request as the scheduler sees it: token ids and slot numbers, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import SamplingParams


@dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    slot: int = -1  # request slot: buffer, conv history, KV cache
    state_slot: int = -1  # recurrent state; -1 until the context outgrows the buffer
    cached: int = 0  # tokens already processed into the caches
    finish_reason: str | None = None  # "stop", "length" (max_new_tokens or max_len), "abort" or "error"
    error: str | None = None  # with finish_reason "error": why this request failed (one line)
    keep_logits: bool = False  # keep each generated token's logits (on the host) in `logits`
    logits: list = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # per generated token, with params.logprobs

    @property
    def context(self) -> list[int]:
        return self.prompt + self.output

    @property
    def wants_logits(self) -> bool:
        """Whether emitting a token needs its logits on the host (kept, or for its log-probability)."""
        return self.keep_logits or self.params.logprobs

    @property
    def picked_on_device(self) -> bool:
        """Whether the device alone can pick this request's decode tokens: neither logits nor
        log-probabilities wanted on the host, no penalty over its previous tokens (overlapped decode
        steps; sampled rows draw there too)."""
        return not self.wants_logits and not self.params.penalized

    @property
    def accepted_on_device(self) -> bool:
        """Whether a verify can accept this request's drafts inside its graph: picked on the device and
        greedy (sampled rows accept after it, speculative.accept_sampled)."""
        return self.picked_on_device and self.params.temperature == 0.0

    @property
    def prefilling(self) -> bool:
        """Whether part of the prompt is still to be fed (its first token not sampled yet)."""
        return self.cached < len(self.prompt)

    @property
    def pending(self) -> list[int]:
        """Tokens not yet fed to the model: the prompt at first, then the last sampled token."""
        return self.context[self.cached:]
