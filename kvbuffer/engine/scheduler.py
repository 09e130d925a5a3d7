"""Which requests run next: the waiting queue, the running set, admission under the pools' limits,
and each step's share of prompt tokens.

The scheduler holds token ids and slot numbers only, never tensors (the runner owns those). The
engine tells it how many request and state slots are free and which requests would need a new
state slot for the step; it answers which requests to admit, how many prompt tokens each
prefilling request feeds, and which requests decode. A request that finds no slot waits rather
than fails: for a request slot in the queue, for a state slot (a KVBuffer request whose buffer is
about to fill) by sitting out steps until another request ends.

Running requests are admitted ones: a request is prefilling (Request.prefilling) until its last
prompt token is fed, possibly over several steps, then decodes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .request import Request

WantsState = Callable[[Request, int], bool]  # (request, tokens it is about to feed) -> needs a new state slot


class Scheduler:
    def __init__(self):
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, rid: int) -> Request | None:
        """Take a request out wherever it is (None if unknown); the caller frees its slots."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return req
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                return req
        return None

    def admit(self, free_requests: int, free_states: int, wants_state: WantsState) -> list[Request]:
        """Pop the waiting requests that get their slots now, in arrival order.

        A request whose prefill needs a state slot is admitted only while more states are free
        than running requests wait for (a prefilling one counts its prompt's rest and its first
        decode), so that new arrivals never starve the running ones.
        """
        spare = free_states - sum(wants_state(r, len(r.pending) + 1 if r.prefilling else 1) for r in self.running)
        out = []
        while self.waiting and free_requests > 0:
            req = self.waiting[0]
            if wants_state(req, len(req.prompt)):
                if spare <= 0:
                    break  # first come, first served: later arrivals wait too
                spare -= 1
            out.append(self.waiting.popleft())
            free_requests -= 1
        return out

    def runnable(self, free_states: int, adding: int, wants_state: WantsState) -> list[Request]:
        """The running requests that take this decode step: all whose prompt is done, except those
        that would need a state slot beyond the free ones (they wait; one that holds a state always
        runs, so some request always progresses and frees its slots when it ends)."""
        out = []
        for req in self.running:
            if req.prefilling:
                continue
            if wants_state(req, adding):
                if free_states <= 0:
                    continue
                free_states -= 1
            out.append(req)
        return out

    def prefill_shares(self, budget: int) -> list[tuple[Request, int]]:
        """The prefilling requests, in admission order, each with the prompt tokens it feeds out of
        `budget` (fair_shares); empty when no prompt is pending."""
        reqs = [r for r in self.running if r.prefilling]
        return [(r, n) for r, n in zip(reqs, fair_shares(budget, [len(r.pending) for r in reqs])) if n]

    def finish(self, req: Request) -> None:
        self.running.remove(req)


def fair_shares(budget: int, needs: list[int]) -> list[int]:
    """A max-min fair split of `budget` prompt tokens over prompts with `needs` tokens left (in
    admission order): each gets min(need, L) for the highest level L whose total fits, so short
    prompts finish at once and long ones share the rest equally (equal shares of equal buffer fill
    share one forward). The tokens left below the next level go unused. When the budget is smaller
    than the number of prompts (L = 0), the oldest prompts get one token each."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    level, left, unsatisfied = 0, budget, len(needs)
    for need in sorted(needs):
        if (need - level) * unsatisfied > left:
            level += left // unsatisfied
            break
        left -= (need - level) * unsatisfied
        level, unsatisfied = need, unsatisfied - 1
    if level == 0:
        return [1 if i < budget else 0 for i in range(len(needs))]
    return [min(need, level) for need in needs]
