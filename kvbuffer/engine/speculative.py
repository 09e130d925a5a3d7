"""The speculative decoder: each step drafts T tokens per request, verifies them in one forward and
keeps the accepted prefix plus one more token (kvbuffer.engine.acceptance decides which).

With KVBuffer the T + 1 fed entries land in the buffer and keeping m of them is a length update.
"""

from __future__ import annotations

import torch

from .acceptance import accept_drafts, accept_sampled
from .config import SpeculativeConfig
from .drafters import MTPDrafter, NgramDrafter
from .sampling import NO_TOKEN, greedy_picks, penalize, row_error, rows_alone_on_failure
from .outputs import DraftStats


def make_drafter(config: SpeculativeConfig | None, model, *, max_requests: int, max_len: int, device, dtype):
    """The drafter `config.method` names (None without speculative decoding)."""
    if config is None:
        return None
    if config.method == "mtp":
        return MTPDrafter(model, max_requests=max_requests, max_len=max_len, max_drafts=config.fed, device=device,
                          dtype=dtype)
    return NgramDrafter(config.ngram_max, config.ngram_min)


class SpeculativeDecoder:
    """Draft + verify steps over `runner`; `emit(request, token, logits row or None)` delivers tokens,
    `generators` maps a request id to its sampler; a row whose acceptance fails gets NO_TOKEN and its
    one-line error in `row_errors` (rid -> error, which emit reads). `stats` counts drafts proposed,
    kept and emitted."""

    def __init__(self, config: SpeculativeConfig, drafter, runner, generators: dict, emit, row_errors: dict):
        self.config, self.drafter, self.runner = config, drafter, runner
        self.generators, self.emit, self.row_errors = generators, emit, row_errors
        self.stats = DraftStats()

    def applies(self, running) -> bool:
        """Whether this step verifies drafts: unless more requests run than disable_above_batch (those
        steps decode plainly; the n-gram drafter reads only the context)."""
        limit = self.config.disable_above_batch
        return limit is None or len(running) <= limit

    def step(self, running) -> None:
        """Greedy requests are accepted and committed inside the verify forward (runner.verify_greedy);
        otherwise the host accepts and commits. Near max_len the step drafts fewer tokens, so that every
        request's fed positions fit."""
        room = min(self.runner.spec.max_len - r.cached - 1 for r in running)
        T = min(self.config.num_draft_tokens, room)
        proposals = [p[:T] for p in self.drafter.propose(running, T)]
        drafts = [p + [None] * (T - len(p)) for p in proposals]  # padding drafts are never kept
        want = self.drafter.needs_hidden
        if all(r.accepted_on_device for r in running):
            picks, accepted, hidden = self.runner.verify_greedy(running, drafts, want_hidden=want)
            following = [ds[:m] + [top[m]] for ds, m, top in zip(drafts, accepted, picks)]
            logits = [None] * len(running)
        else:
            out = self.runner.verify(running, drafts, want_hidden=want)
            logits, hidden = out if want else (out, None)
            accepted, following = self._accept_on_host(running, logits, drafts)
            self.runner.commit(running, [m + 1 for m in accepted])  # the real token and m drafts
        for req, row, tokens in zip(running, logits, following):
            for i, token in enumerate(tokens):
                if req.finish_reason is None:
                    self.emit(req, token, row[i] if req.wants_logits else None)
        st = self.stats
        st.accepted += sum(accepted)
        st.emitted += sum(len(t) for t in following)
        st.request_steps += len(running)
        st.proposed += sum(len(p) for p in proposals)
        # a row that failed (NO_TOKEN) is finished and released after this step: feed its head a real id
        self.drafter.on_commit(running, hidden, [m + 1 for m in accepted], [[max(t, 0) for t in f] for f in following])

    def _accept_on_host(self, running, logits, drafts) -> tuple[list[int], list[list[int]]]:
        """Each request's kept drafts and the tokens it emits, from the verify's logits (B, T+1, V)
        (_accept). Where that raises, each row is accepted alone (sampling.rows_alone_on_failure): a
        row that raises again keeps no draft and emits NO_TOKEN, and its error goes to row_errors."""
        def run(rows: slice):
            return self._accept(running[rows], logits[rows], drafts[rows])

        def failed(i: int, e: Exception):
            self.row_errors[running[i].rid] = row_error("sampling", e)
            return [0], [[NO_TOKEN]]

        parts = rows_alone_on_failure(run, len(running), [self.generators[r.rid] for r in running], failed)
        return [m for ms, _ in parts for m in ms], [f for _, fs in parts for f in fs]

    def _accept(self, running, logits, drafts) -> tuple[list[int], list[list[int]]]:
        """_accept_on_host for a batch: greedy rows by one argmax, sampled rows by one batched acceptance;
        penalized rows first take their penalties (penalized_verify)."""
        logits = penalized_verify(running, logits, drafts)
        greedy = [i for i, r in enumerate(running) if r.params.temperature == 0.0]
        sampled = [i for i, r in enumerate(running) if r.params.temperature != 0.0]
        kept, nxt = [0] * len(running), [0] * len(running)
        if greedy:
            argmax = greedy_picks(logits)[greedy].tolist()
            for i, top in zip(greedy, argmax):
                kept[i], nxt[i] = accept_drafts(logits[i], drafts[i], running[i].params, None, top)
        if sampled:
            rows = logits if len(sampled) == len(running) else logits[sampled]
            ms, tokens = accept_sampled(rows, [drafts[i] for i in sampled], [running[i].params for i in sampled],
                                        [self.generators[running[i].rid] for i in sampled])
            for i, m, token in zip(sampled, ms, tokens):
                kept[i], nxt[i] = m, token
        return kept, [ds[:m] + [t] for ds, m, t in zip(drafts, kept, nxt)]


def penalized_verify(running, logits: torch.Tensor, drafts: list[list[int | None]]) -> torch.Tensor:
    """A verify's logits (B, T+1, V) with each penalized request's penalties applied: its row i follows
    the request's context and drafts[:i] (padding drafts are never kept, so the rows after one are
    never read). Without a penalized request, `logits` itself; else an fp32 copy (other rows widened exactly)."""
    rows = [b for b, r in enumerate(running) if r.params.penalized]
    if not rows:
        return logits
    out = logits.float()
    if out is logits:
        out = logits.clone()
    T1 = logits.shape[1]
    for b in rows:
        req, kept = running[b], [d for d in drafts[b] if d is not None]
        out[b] = penalize(logits[b], [req.params] * T1, [req.prompt] * T1, [req.output + kept[:i] for i in range(T1)])
    return out
