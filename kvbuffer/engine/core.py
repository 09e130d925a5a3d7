"""The engine core: a scheduler, a model runner and the decoders that drive them, one `step()` at a time.

Each step admits the waiting requests that fit, feeds at most `max_prefill_tokens` prompt tokens
(`prefill_tokens_while_decoding` while others decode: chunked prefill, a long prompt spreads over steps
while the others keep decoding), runs one decode (or draft + verify) step for the requests whose
prompts are done, samples, and retires the finished ones, whose slots are freed at once.

A request whose row cannot be sampled (NaN or infinite logits, or its sampling raises) is finished
alone with finish_reason "error" and a message (Request.error); the other rows of the step go on
with the tokens they would have had without it.
"""

from __future__ import annotations

import time

import torch

from .outputs import GenerationStats, StepOutput, group_events
from .overlap import OverlapPipeline, ends_at_length
from .request import Request
from .runner import ModelRunner
from .sampling import (NO_TOKEN, NO_TOKEN_ERROR, penalize_requests, pick_rows, row_error, rows_alone_on_failure,
                       token_logprob)
from .scheduler import Scheduler
from .speculative import SpeculativeDecoder


class EngineCore:
    """runner: the model, caches and forwards; drafter and speculative (SpeculativeConfig): speculative
    decoding, or both None; overlap: queue plain decode steps before reading the last one's tokens;
    max_prefill_tokens: the prompt tokens one step feeds (Scheduler.prefill_shares splits them);
    decoding_prefill_tokens: those it feeds while other requests decode (EngineConfig's)."""

    def __init__(self, runner: ModelRunner, *, drafter=None, speculative=None, overlap: bool = False,
                 max_prefill_tokens: int, decoding_prefill_tokens: int):
        self.runner = runner
        self.max_prefill_tokens = max_prefill_tokens
        self.decoding_prefill_tokens = decoding_prefill_tokens
        self.scheduler = Scheduler()
        self.generators: dict[int, torch.Generator | None] = {}  # rid -> the request's sampler
        self._prepares: dict = {}  # rid -> a callback run right after the request is admitted
        self.done: dict[int, Request] | None = None  # finished requests, kept while generate() collects them
        self.stats: GenerationStats | None = None  # generate()'s counts, while it runs
        self._events: list = []  # (rid, token, logprob) of the step in progress
        self._prompt_hidden: dict[int, list[torch.Tensor]] = {}  # rid -> hidden states of its prompt so far
        self._row_errors: dict[int, str] = {}  # rid -> why its pick failed, until emit() finishes it
        self.overlapped = overlap
        self.overlap = OverlapPipeline(runner, self.pick, self.emit)
        self.speculative = None if speculative is None else \
            SpeculativeDecoder(speculative, drafter, runner, self.generators, self.emit, self._row_errors)
        self._fed = speculative.fed if speculative is not None else 1

    @property
    def drafter(self):
        """The speculative decoder's drafter (None without speculative decoding)."""
        return self.speculative.drafter if self.speculative is not None else None

    # requests ----------------------------------------------------------------------------------
    def add(self, req: Request, generator, prepare=None) -> None:
        self.scheduler.add(req)
        self.generators[req.rid] = generator
        if prepare is not None:
            self._prepares[req.rid] = prepare

    def abort(self, rid: int) -> Request | None:
        req = self.scheduler.remove(rid)
        if req is None:
            return None
        if req.finish_reason is None:
            req.finish_reason = "abort"
        self._finish(req)
        return req

    def has_work(self) -> bool:
        return bool(self.scheduler)

    # one step ------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Admit what fits, feed prompts within the budget (_prefill), then one decode (or draft + verify)
        step for the running requests whose prompts are done.

        Returns the tokens each request got, in sampling order (a request whose prompt ends in this
        step may appear twice: its first token, then its decode token). Finished requests have freed
        their slots before this returns. If the step raises, the requests it admitted are aborted.
        """
        sched, finished, admitted = self.scheduler, {}, []
        self._events = []
        try:
            chosen = sched.admit(self.runner.caches.requests.num_free, self._free_states(), self._wants_state)
            for k, req in enumerate(chosen):
                try:
                    self._admit(req)
                except BaseException:  # the requests not admitted yet keep their place in the queue
                    sched.waiting.extendleft(reversed(chosen[k:]))
                    raise
                admitted.append(req)
            sched.running += admitted
            if any(r.prefilling for r in sched.running):
                self._prefill()
            admitted = []
            self._retire_finished(finished)  # before decoding, so their slots serve the others at once
            running = sched.runnable(self._free_states(), self._fed, self._wants_state)
            if running or self.overlap.inflight is not None:
                self._decode_step(running)
        except BaseException:  # a failed step must not leak slots: what it admitted goes back
            for req in admitted:
                sched.remove(req.rid)
                self._finish(req, "abort")
            raise
        self._retire_finished(finished)
        return group_events(self._events, {rid: r.finish_reason for rid, r in finished.items()},
                            {rid: r.error for rid, r in finished.items() if r.error is not None})

    def _retire_finished(self, finished: dict) -> None:
        for req in [r for r in self.scheduler.running if r.finish_reason is not None]:
            self.scheduler.finish(req)
            self._finish(req)
            finished[req.rid] = req

    def _admit(self, req: Request) -> None:
        try:
            self.runner.admit(req)
            prepare = self._prepares.pop(req.rid, None)
            if prepare is not None:
                prepare(req)
        except BaseException:  # e.g. a state slot that failed after the request slot: give back what it took
            if req.slot >= 0:
                self.runner.release(req)
            raise

    def _free_states(self) -> int:
        states = self.runner.caches.states
        return states.slots.num_free if states is not None else 0

    def _wants_state(self, req: Request, adding: int) -> bool:
        """Whether feeding `adding` more tokens needs a state slot this request does not hold yet."""
        caches = self.runner.caches
        if caches.states is None or req.state_slot >= 0:
            return False
        if caches.buffers is None:  # recurrent: the state is taken at admission
            return True
        return self.runner.needs_state(req, adding)

    def _finish(self, req: Request, reason: str | None = None) -> None:
        """Free a request's slots and drafter rows and keep it for generate() to collect."""
        if reason is not None and req.finish_reason is None:
            req.finish_reason = reason
        if req.slot >= 0:
            if self.drafter is not None:
                self.drafter.release(req)
            self.runner.release(req)
        self.generators.pop(req.rid, None)
        self._prepares.pop(req.rid, None)
        self._prompt_hidden.pop(req.rid, None)
        self._row_errors.pop(req.rid, None)
        if self.done is not None:
            self.done[req.rid] = req

    def _prefill(self) -> None:
        """Feed the prefilling requests' prompts: one round of decoding_prefill_tokens, shared out by the
        scheduler, or, while no request decodes, rounds of max_prefill_tokens until a prompt is done. A
        request whose prompt is done samples its first token (and a drafter that reads hidden states
        learns the whole prompt)."""
        want = self.drafter is not None and self.drafter.needs_hidden
        decoding = any(not r.prefilling and r.finish_reason is None for r in self.scheduler.running)
        while True:
            budget = self.decoding_prefill_tokens if decoding else self.max_prefill_tokens
            shares = self.scheduler.prefill_shares(budget)
            if not shares:
                return
            done = {}
            for req, logits, h in self.runner.prefill([r for r, _ in shares], [n for _, n in shares],
                                                      want_hidden=want):
                if want:
                    self._prompt_hidden.setdefault(req.rid, []).append(h)
                if logits is not None:
                    done[req.rid] = logits
            for req, _ in shares:  # in admission order
                if req.rid in done:
                    self._first_token(req, done[req.rid], want)
            if decoding or done:
                return

    def _first_token(self, req: Request, logits: torch.Tensor, want_hidden: bool) -> None:
        self.emit(req, self.pick(logits[None], [req]).tolist()[0], logits)
        if want_hidden and req.finish_reason != "error":  # the head learns the prompt, each position fed
            # with the token after it
            hidden = torch.cat(self._prompt_hidden.pop(req.rid))
            self.drafter.on_prefill(req, hidden, req.context[req.cached - len(hidden) + 1:req.cached + 1])

    def _decode_step(self, running: list[Request]) -> None:
        t0, before = time.perf_counter(), len(self._events)
        fed = len(running)  # the rows of the forward whose tokens this call emits
        if self.speculative is not None and self.speculative.applies(running):
            if self.overlap.inflight is not None:  # a plain overlapped step ran before: its tokens join the contexts
                self.overlap.settle()
                running = [r for r in running if r.finish_reason is None]
                fed = len(running)
            if running:
                self.speculative.step(running)
        elif self.overlapped and all(r.picked_on_device for r in running):
            fed = self.overlap.step(running)
        else:
            self.overlap.settle()
            running = [r for r in running if r.finish_reason is None]
            fed = len(running)
            if running:
                logits = self.runner.decode(running)
                tokens = self.pick(logits, running).tolist()
                for req, row, token in zip(running, logits, tokens):
                    self.emit(req, token, row if req.wants_logits else None)
        if self.stats is not None:  # reading tokens back waited for the device (overlapped: the step before)
            self.stats.add_step(time.perf_counter() - t0, len(self._events) - before, fed, len(running))

    def pick(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Each request's token from its row of logits (B, V), penalized, on the device (sampling.pick_rows):
        NO_TOKEN where the row has none to pick. Where picking the batch raises, each row is picked
        alone (sampling.rows_alone_on_failure) and a row that raises again gets NO_TOKEN and its error."""
        generators = [self.generators[r.rid] for r in reqs]

        def run(rows: slice) -> torch.Tensor:
            return pick_rows(penalize_requests(logits[rows], reqs[rows]), [r.params for r in reqs[rows]],
                             generators[rows])

        def failed(i: int, e: Exception) -> torch.Tensor:
            self._row_errors[reqs[i].rid] = row_error("sampling", e)
            return torch.full((1,), NO_TOKEN, dtype=torch.long, device=logits.device)

        parts = rows_alone_on_failure(run, len(reqs), generators, failed)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def emit(self, req: Request, token: int, logits: torch.Tensor | None = None) -> None:
        """Append a sampled token; `logits` (its row) is read only when req.wants_logits, else may be None.
        NO_TOKEN finishes the request alone with finish_reason "error" (nothing appended)."""
        if token == NO_TOKEN:
            req.finish_reason, req.error = "error", self._row_errors.pop(req.rid, f"sampling: {NO_TOKEN_ERROR}")
            return
        try:
            logprob = token_logprob(logits, token) if req.params.logprobs else None
            kept = logits.detach().float().cpu() if req.keep_logits else None
        except Exception as e:  # this row alone: it ends as a row whose pick failed does
            req.finish_reason, req.error = "error", row_error("recording the token", e)
            return
        req.output.append(token)
        if kept is not None:
            req.logits.append(kept)
        if logprob is not None:
            req.logprobs.append(logprob)
        self._events.append((req.rid, token, logprob))
        if token in req.params.stop_token_ids:
            req.finish_reason = "stop"
        elif ends_at_length(req, len(req.output), self.runner.spec.max_len):
            req.finish_reason = "length"  # max_new_tokens, or the next token could not be fed within max_len
