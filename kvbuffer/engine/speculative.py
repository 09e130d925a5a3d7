"""Speculative decoding: drafters, and the rule that decides which drafts the target model keeps.

Each step feeds every request's last token plus T drafts through one verify forward. With
KVBuffer the T+1 entries land in the buffer and accepting m of them is a length update; nothing
like a per-draft state exists. The acceptance rule is the standard one: greedy keeps the drafts
that equal the target's argmax; with sampling, a draft d drawn from q is kept with probability
min(1, p(d)/q(d)), and on rejection the next token is drawn from norm(max(p - q, 0)), which leaves
the output distribution exactly p. kvbuffer's drafters (kvbuffer.engine.drafters) propose
deterministically (q is a point mass), so acceptance is p(d) and the residual is p with d removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .options import is_int
from .sampling import SamplingParams, draw, filtered_probs

METHODS = ("ngram", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_draft_tokens: int
    ngram_max: int = 3  # longest suffix the n-gram drafter tries to match
    ngram_min: int = 1

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_draft_tokens", "ngram_max", "ngram_min"):
            value = getattr(self, name)
            if not is_int(value):
                raise TypeError(f"speculative {name} must be an int, got {type(value).__name__} {value!r}")
        if not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"num_draft_tokens must be in [1, 16], got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"speculative ngram sizes need 1 <= ngram_min <= ngram_max, got "
                             f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}")

    @classmethod
    def from_dict(cls, d: Mapping | None) -> "SpeculativeConfig | None":
        if d is None:
            return None
        if not isinstance(d, Mapping):
            raise TypeError(f"speculative must be a dict such as {{'method': 'ngram', 'num_draft_tokens': 4}} "
                            f"or None, got {type(d).__name__} {d!r}")
        unknown = set(d) - {"method", "num_draft_tokens", "ngram_max", "ngram_min"}
        if unknown:
            raise ValueError(f"unknown speculative options {sorted(unknown, key=str)}")
        missing = {"method", "num_draft_tokens"} - set(d)
        if missing:
            raise ValueError(f"speculative lacks {sorted(missing)}")
        return cls(**d)


def accept_drafts(logits: torch.Tensor, drafts: list[int | None], params: SamplingParams,
                  generator: torch.Generator | None, argmax: list[int] | None = None) -> tuple[int, int]:
    """Decide how many deterministic drafts to keep and the token that follows them.

    logits: (T+1, V), row i is the target's prediction after the real token and drafts[:i].
    drafts: T proposals; None marks padding (never kept). Returns (kept m, next token).
    argmax: logits' argmax per row when the caller computed it for the whole batch at once.
    """
    if params.temperature == 0.0 and argmax is None:
        argmax = torch.argmax(logits, dim=-1).tolist()
    for i, d in enumerate(drafts):
        if params.temperature == 0.0:
            target = argmax[i]
            if d is None or d != target:
                return i, target
            continue
        p = filtered_probs(logits[i], params)
        if d is not None and float(torch.rand((), generator=generator, device=p.device)) < float(p[d]):
            continue
        if d is not None:  # residual norm(max(p - q, 0)) with q a point mass on d
            p = p.clone()
            p[d] = 0.0
            p = p / p.sum()
        return i, int(draw(p[None], [generator])[0])
    last = logits[len(drafts)]
    if params.temperature == 0.0:
        return len(drafts), argmax[len(drafts)]
    return len(drafts), int(draw(filtered_probs(last, params)[None], [generator])[0])
