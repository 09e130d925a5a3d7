"""The model runner: owns the model, the caches and the forwards; the scheduler tells it what to run.

Each forward is followed by the bookkeeping KVBuffer needs, done once for all layers: buffer fills
advance (or reset where a flush folded the buffer into the state), and KV lengths grow.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from ..errors import PoolExhaustedError
from ..runtime.backend import REFERENCE, Backend
from ..runtime.batch import ForwardBatch
from ..runtime.caches import CacheSpec, ModelCaches
from .compiled import COMPILED_PHASES, compile_forward, said_compiling
from .commit import PADDING_DRAFT, commit_rows, flush_rows, greedy_accepts
from .graphs import (CAPTURE_AFTER, PREFILL_GRAPH_TOKENS, CaptureFailed, PendingTokens, StepGraphs, StepInputs,
                     row_bucket, split_view, step_columns)
from .request import Request

log = logging.getLogger("kvbuffer")


class ModelRunner:
    """backend: what every forward's layers call (kvbuffer.runtime.backend), passed along on each
    ForwardBatch; the runner's own flushes and conv accepts go through it too. cuda_graphs: capture
    the decode, verify and short prefill forwards (CUDA with the compiled kernels, or no linear
    layers: the reference ops read the device back, which a capture forbids), each bucket on its
    third use (graphs.worth_capturing; warm_up captures at once); a forward whose capture fails runs
    eagerly from then on, logged once. compile: run the decode and verify forwards compiled
    (kvbuffer.engine.compiled), graphed or not; graphed, each bucket is captured at first use, so a
    compile that fails does so during a capture (padding rows only: nothing written) and falls back
    to the uncompiled forward, logged once; on CUDA a prompt chunk too long to graph runs its elementwise
    stretches as compiled regions (ForwardBatch.fuse).

    unbuffered_rows (kvbuffer mode): a decode step of at most this many rows folds its rows'
    buffers into their states and steps the recurrence in place, as the recurrent scheme does
    (where the states are few the buffer saves too little). 0: every decode step is buffered."""

    def __init__(self, model, spec: CacheSpec, *, mode: str, device, dtype, buffer_dtype=None,
                 backend: Backend = REFERENCE, cuda_graphs: bool = False, compile: bool = False,
                 unbuffered_rows: int = 0):
        self.model, self.spec, self.mode = model, spec, mode
        self.device, self.backend = device, backend
        self.caches = ModelCaches(spec, device=device, dtype=dtype, buffer_dtype=buffer_dtype)
        self.has_linear = spec.num_linear_layers > 0
        self.unbuffered_rows = unbuffered_rows if mode == "kvbuffer" and self.has_linear else 0
        self.compiled = compile_forward(model, self.caches) if compile else None
        self.fuse_prompts = bool(compile) and torch.device(device).type == "cuda"  # ForwardBatch.fuse
        self._fused_once = False  # a fused prompt forward has run (its regions compiled, said on one line)
        self.inputs = StepInputs(spec.max_requests, torch.device(device))
        self.use_graphs(cuda_graphs)

    def use_graphs(self, on: bool, capture: bool = True) -> None:
        """Run the forwards through StepGraphs (on) or plainly. capture=False runs the same padded,
        bucketed forwards eagerly: what a replay computes, checkable on a machine without CUDA."""
        self.cuda_graphs, self._capture = on, capture
        self._pool = torch.cuda.graph_pool_handle() if on and capture else None  # one memory pool for every graph
        self.graphs = self._graphs(self._decode_forward, self.inputs) if on else None
        self._multi: dict[tuple[str, int], tuple[StepInputs, StepGraphs | None]] = {}  # (phase, T) -> inputs, graphs

    def _graphs(self, forward, inputs: StepInputs) -> StepGraphs:
        """A compiled forward is captured at first use: its first run on real rows could fail halfway."""
        return StepGraphs(forward, inputs, self.spec.max_len, capture=self._capture, pool=self._pool,
                          capture_after=0 if self.compiled is not None else CAPTURE_AFTER)

    def _inputs_for(self, phase: str, tokens: int) -> tuple[StepInputs, StepGraphs | None]:
        """The staging buffer and graphs of `phase` forwards with `tokens` tokens per row (made on first use)."""
        key = (phase, tokens)
        if key not in self._multi:
            inputs = StepInputs(self.spec.max_requests, torch.device(self.device), tokens)
            graphs = self._graphs(functools.partial(self._view_forward, phase, tokens, graphed=True), inputs) \
                if self.cuda_graphs else None
            self._multi[key] = inputs, graphs
        return self._multi[key]

    # slots -----------------------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        """The request's slot, and its state slot now if it runs recurrent or its prompt will fill the
        buffer (a prompt fed over several steps never waits for a state halfway)."""
        req.slot = self.caches.allocate_request()
        try:
            if self.mode == "recurrent" and self.has_linear:
                req.state_slot = self.caches.allocate_state()
            else:
                self._ensure_state(req, len(req.pending))
        except BaseException:  # e.g. a full state pool: the request slot goes back
            self.release(req)
            raise

    def release(self, req: Request) -> None:
        self.caches.free_request(req.slot, req.state_slot)
        req.slot, req.state_slot = -1, -1

    def _fill(self, req: Request) -> int:
        return self.caches.buffers.length(req.slot) if self.caches.buffers is not None else 0

    def needs_state(self, req: Request, adding: int) -> bool:
        """Whether `adding` more tokens fill the request's buffer to C, where a fold needs its state."""
        fill = self._fill(req) if req.slot >= 0 else 0
        return fill + adding >= self.spec.chunk_size

    def _ensure_state(self, req: Request, adding: int) -> None:
        """A short-context request gets its state only when this forward fills its buffer."""
        if self.caches.buffers is not None and req.state_slot < 0 and self.needs_state(req, adding):
            req.state_slot = self.caches.allocate_state()

    def _unbuffered(self, reqs: list[Request]) -> bool:
        """Whether this decode step runs unbuffered (unbuffered_rows): if so, every row now has a
        state and an empty buffer. False, changing nothing, when the state pool cannot give the
        rows without one a state (the step then runs buffered)."""
        if len(reqs) > self.unbuffered_rows:
            return False
        stateless = [r for r in reqs if r.state_slot < 0]
        got = []
        try:
            for _ in stateless:
                got.append(self.caches.allocate_state())
        except BaseException as e:  # give back what was taken; a full pool only keeps the step buffered
            for s in got:
                self.caches.states.free(s)
            if isinstance(e, PoolExhaustedError):
                return False
            raise
        for r, s in zip(stateless, got):
            r.state_slot = s
        full = [r for r in reqs if self._fill(r) > 0]
        if full:
            host = torch.tensor([[r.state_slot for r in full], [r.slot for r in full], [self._fill(r) for r in full]],
                                dtype=torch.int32, pin_memory=torch.device(self.device).type == "cuda")
            rows = host.to(self.device, non_blocking=True)  # no wait for the step in flight (overlap)
            flush_rows(self.caches, self.backend, self.spec, rows[0], rows[1], rows[2])
            for r in full:
                self.caches.buffers.reset(r.slot)
        return True

    def _view_batch(self, phase: str, tokens: int, view: torch.Tensor, context_len: int, fill: int = 0,
                    mode: str | None = None, host_rows: tuple[list[int], list[int]] | None = None, fuse: bool = False,
                    graphed: bool = False):
        """(ids (B, T), the ForwardBatch) over StepInputs' device view (step_columns' order); host_rows:
        the rows' slots and cached as uploaded (an eager prompt's, for ForwardBatch.host_slots / host_cached);
        fuse, graphed: ForwardBatch's."""
        ids, positions, slots, state_slots, lengths, cached = split_view(view, tokens)
        i32 = torch.int32
        host_slots, host_cached = host_rows if host_rows is not None else (None, None)
        batch = ForwardBatch(phase=phase, mode=mode or self.mode, backend=self.backend, positions=positions,
                             slots=slots.to(i32), state_slots=state_slots.to(i32), lengths=lengths.to(i32),
                             cached=cached.to(i32), flush_at=self.spec.chunk_size, context_len=context_len,
                             host_slots=host_slots, host_cached=host_cached, fuse=fuse, graphed=graphed)
        batch.common_fill = fill
        return ids, batch

    def _decode_forward(self, view: torch.Tensor, context_len: int, mode: str | None = None) -> torch.Tensor:
        """mode "recurrent" in kvbuffer mode: an unbuffered step (its graphs are keyed by it)."""
        return self._forward(*self._view_batch("decode", 1, view, context_len, mode=mode))[:, 0]

    def _view_forward(self, phase: str, tokens: int, view, context_len: int, fill: int = 0, want_hidden=False,
                      commit=False, host_rows=None, fuse=False, graphed=False):
        """A verify or prefill forward over StepInputs' device view: logits (B, T, vocab) [, hidden].
        A verify's padding drafts (PADDING_DRAFT) are fed as token 0. commit (greedy verify): the
        target's picks (B, T) and the drafts kept (B,) [, hidden] instead of the logits, the kept
        tokens committed (kvbuffer.engine.commit). host_rows, fuse, graphed: see _view_batch."""
        ids, batch = self._view_batch(phase, tokens, view, context_len, fill, host_rows=host_rows, fuse=fuse,
                                      graphed=graphed)
        out = self._forward(ids.clamp(min=0) if phase == "verify" else ids, batch, **self._hidden(want_hidden))
        if not commit:
            return out
        logits, hidden = out if want_hidden else (out, None)
        picks, accepted = greedy_accepts(ids, logits)
        commit_rows(self.caches, self.backend, self.spec, batch.slots, batch.state_slots, batch.lengths, accepted + 1)
        return (picks, accepted, hidden) if want_hidden else (picks, accepted)

    def _forward(self, ids, batch: ForwardBatch, **kw):
        """The model's forward; a prompt's gives only each row's last logits (the only ones read)."""
        fn = self.compiled if self.compiled is not None and batch.phase in COMPILED_PHASES else self.model
        if batch.phase == "prefill":
            kw["last_logits"] = True
        return fn(ids, batch, self.caches, **kw)

    def _replayed(self, graphs: StepGraphs | None, columns, context_len: int, *extra, feed=None, now=False):
        """The forward's outputs from its CUDA graph (or its bucket's uncaptured forward until the
        bucket is worth a capture: graphs.worth_capturing; now: capture it at once), or None: no
        graphs, or a capture that failed (it leaves the caches untouched; that forward runs eagerly
        from then on, logged once)."""
        if graphs is None or not graphs.enabled:
            return None
        try:
            return graphs.run(columns, context_len, *extra, feed=feed, now=now)
        except CaptureFailed as e:
            failed = e.__cause__ or e
            cause = failed.__context__ or failed  # the error inside the capture, not capture_end's follow-up
            if self.compiled is not None:  # the warm-up and the capture saw padding rows only: retry uncompiled
                log.warning("kvbuffer: the compiled forward failed during a CUDA graph capture, running the "
                            "forwards uncompiled from now on: %s", _first_line(cause))
                self.compiled = None
                return self._replayed(graphs, columns, context_len, *extra, feed=feed, now=now)
            log.warning("kvbuffer: CUDA graph capture of a %d-token forward failed, running it eagerly from now "
                        "on: %s", graphs.inputs.tokens, _first_line(cause))
            graphs.enabled = False
            return None

    def _columns(self, reqs: list[Request], ids: list[list[int]]) -> list[list[int]]:
        return step_columns(ids, [r.cached for r in reqs], [r.slot for r in reqs], [r.state_slot for r in reqs],
                            [self._fill(r) for r in reqs], [r.cached for r in reqs])

    def _advance(self, req: Request, count: int, buffered: bool = True) -> None:
        """After a forward that kept `count` tokens: buffer fill (when buffered) and KV length move on."""
        req.cached += count
        if buffered:
            self.caches.advance_buffer(req.slot, count, whole=False)

    # forwards --------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, reqs: list[Request], tokens: int | list[int], want_hidden: bool = False):
        """Feed the next pending prompt tokens of each of `reqs`: tokens[i] for reqs[i] (an int: that
        many for each, or all it has pending if fewer). One forward per group of requests with the
        same buffer fill and the same count (prompts of equal length go together); the linear
        layers cut each forward at the flush points.

        Returns [(request, logits of its last prompt token if it has none pending now, else None,
        hidden states (T, H) of the tokens fed with want_hidden, else None)], group after group.
        ValueError, before any forward, for a count outside [1, pending] or past max_len.
        """
        counts = [min(len(r.pending), tokens) for r in reqs] if isinstance(tokens, int) else list(tokens)
        if len(counts) != len(reqs):
            raise ValueError(f"tokens: {len(counts)} counts for {len(reqs)} requests")
        groups: dict[tuple[int, int], list[Request]] = {}
        for r, T in zip(reqs, counts):
            if not 1 <= T <= len(r.pending):
                raise ValueError(f"request {r.rid}: tokens={T}, expected 1 to {len(r.pending)} (its pending tokens)")
            if r.cached + T > self.spec.max_len:
                raise ValueError(f"request {r.rid}: context of {r.cached + T} tokens exceeds "
                                 f"max_len={self.spec.max_len}")
            groups.setdefault((self._fill(r), T), []).append(r)
        out = []
        for (fill, T), rows in groups.items():
            out += self._prefill_rows(rows, T, fill, want_hidden)
        return out

    def _prefill_rows(self, rows: list[Request], T: int, fill: int, want_hidden: bool):
        """One prefill forward: T pending tokens of each row, all rows with buffer fill `fill`."""
        for r in rows:
            self._ensure_state(r, T)
        columns = self._columns(rows, [r.pending[:T] for r in rows])
        context_len = max(r.cached for r in rows) + T
        inputs, graphs = self._inputs_for("prefill", T)
        long_chunk = self._long_chunk(len(rows), T, inputs)
        if long_chunk:
            graphs = None  # a long chunk waits on its GEMMs, not on its launches
        out = self._replayed(graphs, columns, context_len, fill, want_hidden)
        if out is not None:  # graph outputs live until the next replay; the caller keeps these longer
            out = tuple(o.clone() for o in out) if want_hidden else out[:, -1:].clone()
        else:
            host_rows = ([r.slot for r in rows], [r.cached for r in rows])  # the prompt's attention slices rows by them
            # a long chunk (never graphed) fuses its elementwise work; a short one runs as its graph would
            fuse = long_chunk and self.fuse_prompts
            with self._first_fused(fuse):
                out = self._view_forward("prefill", T, inputs.upload(columns, len(rows)), context_len, fill,
                                         want_hidden, host_rows=host_rows, fuse=fuse)
        logits, hidden = out if want_hidden else (out, None)
        for r in rows:
            self._advance(r, T)
        return [(r, None if r.pending else logits[b, -1], hidden[b] if want_hidden else None)
                for b, r in enumerate(rows)]

    @staticmethod
    def _hidden(want: bool) -> dict:
        return {"return_hidden": True} if want else {}

    @torch.inference_mode()
    def decode(self, reqs: list[Request], feed: list[int] | None = None) -> torch.Tensor:
        """One token for each request (its last sampled one): logits (B, vocab).

        feed: per request, -1 or the index of its token among the last `hold`'s picks, which the
        host has not read yet (its context does not hold that token).
        """
        for r in reqs:
            if r.cached + 1 > self.spec.max_len:
                raise ValueError(f"request {r.rid}: context exceeds max_len={self.spec.max_len}")
        unbuffered = self._unbuffered(reqs)
        if not unbuffered:
            for r in reqs:
                self._ensure_state(r, 1)
        fed = feed or [-1] * len(reqs)
        columns = self._columns(reqs, [[r.context[r.cached] if f < 0 else 0] for r, f in zip(reqs, fed)])
        context_len = max(r.cached for r in reqs) + 1
        logits = self._decode_rows(columns, context_len, unbuffered, feed)
        for r in reqs:
            self._advance(r, 1, buffered=not unbuffered)
        return logits

    def _decode_rows(self, columns, context_len: int, unbuffered: bool, feed=None, now=False) -> torch.Tensor:
        """The decode forward of `columns`, replayed from its graph where there is one (now: captured at once)."""
        mode = ("recurrent",) if unbuffered else ()
        logits = self._replayed(self.graphs, columns, context_len, *mode, feed=feed, now=now)
        if logits is None:
            logits = self._decode_forward(self.inputs.upload(columns, len(columns[0]), feed), context_len, *mode)
        return logits

    @torch.inference_mode()
    def warm_up(self, rows: list[int], context_lens: list[int]) -> None:
        """Decode forwards of padding rows only (they read nothing and write only the KV cache's sink,
        which no row reads) for each row count and context length (unbuffered steps up to
        unbuffered_rows rows): their CUDA graphs are captured and, with compile, their compilations
        made, so the first real steps at those shapes wait for neither. Dynamo specialises a dimension of 1 and turns rows and the attention window
        dynamic once they change, so two row counts of each kind of step at two context buckets
        leave no compilation for later shapes (LLM.warm_up)."""
        for n in rows:
            columns = [[pad] * n for pad in self.inputs.padding]
            for context_len in context_lens:
                self._decode_rows(columns, context_len, n <= self.unbuffered_rows, now=True)

    @torch.inference_mode()
    def warm_up_prompt(self, tokens: int) -> None:
        """A prompt forward of one padding row (it reads nothing and writes nothing a row reads) of `tokens`
        tokens, with ForwardBatch.fuse as a chunk that long gets: the prompt's fused regions are compiled
        now, not on the first long prompt (LLM.warm_up)."""
        inputs, _ = self._inputs_for("prefill", tokens)
        columns = [[pad] for pad in inputs.padding]
        fuse = self._long_chunk(1, tokens, inputs) and self.fuse_prompts
        with self._first_fused(fuse):
            self._view_forward("prefill", tokens, inputs.upload(columns, 1), tokens, fuse=fuse)

    @staticmethod
    def _long_chunk(rows: int, tokens: int, inputs: StepInputs) -> bool:
        """Whether a prompt chunk of `rows` rows of `tokens` tokens is too long to graph (its bucket's
        row-tokens past PREFILL_GRAPH_TOKENS): it runs eagerly, and fuses where prompts fuse."""
        return row_bucket(rows, inputs.max_rows) * tokens > PREFILL_GRAPH_TOKENS

    def _first_fused(self, fuse: bool):
        """Around a prompt forward: the first fused one (its regions compile) is said on one stderr line."""
        if not fuse or self._fused_once:
            return contextlib.nullcontext()
        self._fused_once = True
        return said_compiling("the prompt's fused regions")

    @torch.inference_mode()
    def hold(self, picks: torch.Tensor) -> PendingTokens:
        """The decode step's tokens (picked on the device), left there for the next decode's feed and
        copied to the host without waiting."""
        return self.inputs.hold(picks)

    @torch.inference_mode()
    def verify(self, reqs: list[Request], drafts: list[list[int | None]], want_hidden: bool = False):
        """Feed each request's last token plus its T drafts (None: no draft, never kept) in one
        forward: logits (B, T+1, vocab) (and the hidden states (B, T+1, H) with want_hidden).

        Nothing is committed: call commit() with the number of tokens each request keeps.
        """
        return self._verify(reqs, drafts, want_hidden, commit=False)

    @torch.inference_mode()
    def verify_greedy(self, reqs: list[Request], drafts: list[list[int | None]], want_hidden: bool = False):
        """verify() for greedy requests, with the acceptance and the commit in the same forward (its
        CUDA graph; kvbuffer.engine.commit): the host reads the picks and counts once.

        Returns (picks: per request the target's T+1 greedy tokens, accepted: per request the drafts
        kept, hidden (B, T+1, H) or None). The request keeps its real token and accepted[b] drafts;
        picks[b][accepted[b]] is the token that follows them.
        """
        if self.caches.buffers is not None:  # a fold inside the forward needs its state slot already
            for r in reqs:
                self._ensure_state(r, len(drafts[0]) + 1)
        out = self._verify(reqs, drafts, want_hidden, commit=True)
        picks, accepted, hidden = out if want_hidden else (*out, None)
        rows = torch.cat([picks, accepted[:, None]], dim=1).tolist()  # the step's one read-back
        kept = [row[-1] + 1 for row in rows]
        self._kept(reqs, kept)
        return [row[:-1] for row in rows], [k - 1 for k in kept], hidden

    def _verify(self, reqs, drafts, want_hidden: bool, commit: bool):
        T1 = len(drafts[0]) + 1
        if T1 > self.spec.max_drafts:
            raise ValueError(f"{T1 - 1} drafts exceed the caches' room for {self.spec.max_drafts - 1}")
        for r in reqs:
            if r.cached + T1 > self.spec.max_len:
                raise ValueError(f"request {r.rid}: context exceeds max_len={self.spec.max_len}")
        fed = [[r.context[r.cached]] + [PADDING_DRAFT if t is None else t for t in d] for r, d in zip(reqs, drafts)]
        columns = self._columns(reqs, fed)
        context_len = max(r.cached for r in reqs) + T1
        inputs, graphs = self._inputs_for("verify", T1)
        out = self._replayed(graphs, columns, context_len, 0, want_hidden, commit)
        if out is None:
            out = self._view_forward("verify", T1, inputs.upload(columns, len(reqs)), context_len, 0, want_hidden,
                                     commit)
        return out

    @torch.inference_mode()
    def commit(self, reqs: list[Request], kept: list[int]) -> None:
        """Keep the first kept[b] fed tokens of each request's last verify (at least its real token)."""
        if self.caches.buffers is not None:  # the rows that reach C are folded: they need a state
            for r, m in zip(reqs, kept):
                self._ensure_state(r, m)
        i32 = dict(dtype=torch.int32, device=self.device)
        rows = torch.tensor([[r.slot, r.state_slot, self._fill(r), m] for r, m in zip(reqs, kept)], **i32)
        commit_rows(self.caches, self.backend, self.spec, *rows.t().contiguous())
        self._kept(reqs, kept)

    def _kept(self, reqs: list[Request], kept: list[int]) -> None:
        """The host's books after a commit: KV lengths and buffer fills move on; a buffer that reached
        C was folded (commit_rows) and starts empty."""
        for r, m in zip(reqs, kept):
            r.cached += m
            self.caches.advance_buffer(r.slot, m, whole=True)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else repr(e)
