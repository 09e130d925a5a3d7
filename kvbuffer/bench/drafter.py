"""A drafter with a chosen acceptance, for benchmarks: the target's own continuation, kept with probability alpha.

Random-weight models never continue a prompt's pattern, so an n-gram drafter's drafts are never
accepted and a benchmark of speculative decoding measures only its cost. This drafter knows each
request's greedy continuation (from one plain greedy run of the same model) and proposes the next
T tokens of it, each kept with probability alpha until the first miss, which is replaced by a
wrong token (and so is every draft after it). The engine still verifies every draft, so the
output stays exactly the greedy output; the expected number of accepted drafts per step is
alpha + alpha^2 + ... + alpha^T.

A request whose output has left its reference (greedy runs at another batch size can part at a
near tie in bf16) gets wrong tokens only; `diverged` counts those requests.
"""

from __future__ import annotations

import random
from typing import Mapping, Sequence

from ..engine.drafters import Drafter


def expected_accepted(alpha: float, T: int) -> float:
    """Mean drafts accepted per verify: alpha + alpha^2 + ... + alpha^T."""
    return sum(alpha ** k for k in range(1, T + 1))


class ReferenceDrafter(Drafter):
    """Proposes each request's reference continuation, each draft right with probability alpha."""

    def __init__(self, references: Mapping[tuple[int, ...], Sequence[int]], alpha: float, vocab_size: int,
                 seed: int = 0):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 (a wrong token must exist), got {vocab_size}")
        self.refs = {tuple(p): list(c) for p, c in references.items()}
        self.alpha, self.vocab = alpha, vocab_size
        self.rng = random.Random(seed)
        self.diverged: set[int] = set()

    def propose(self, reqs, count: int) -> list[list[int]]:
        return [self._one(r, count) for r in reqs]

    def _one(self, req, count: int) -> list[int]:
        ref = self.refs.get(tuple(req.prompt))
        if ref is None:
            raise KeyError(f"request {req.rid}: its prompt has no reference continuation")
        done = len(req.output)
        if req.output != ref[:done] or done + count > len(ref):
            self.diverged.add(req.rid)
            return [self._wrong(None) for _ in range(count)]
        drafts, missed = [], False
        for token in ref[done:done + count]:
            missed = missed or self.rng.random() >= self.alpha
            drafts.append(self._wrong(token) if missed else token)
        return drafts

    def _wrong(self, token: int | None) -> int:
        """A random token other than `token`."""
        if token is None:
            return self.rng.randrange(self.vocab)
        return (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
