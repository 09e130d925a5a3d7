"""The model runner: owns the model, the caches and the forwards; the scheduler tells it what to run.

Each forward is followed by the bookkeeping KVBuffer needs, done once for all layers: buffer fills
advance (or reset where a flush folded the buffer into the state), and KV lengths grow.
"""

from __future__ import annotations

import logging

import torch

from ..runtime.backend import REFERENCE, Backend
from ..runtime.batch import ForwardBatch
from ..runtime.caches import CacheSpec, ModelCaches
from .graphs import DecodeGraphs, StepInputs
from .request import Request

log = logging.getLogger("kvbuffer")


class ModelRunner:
    """backend: what every forward's layers call (kvbuffer.runtime.backend), carried on each
    ForwardBatch; the runner's own flushes and conv accepts go through it too. cuda_graphs: capture
    the decode forward (CUDA with the compiled kernels, or no linear layers: the reference ops read
    the device back, which a capture forbids)."""

    def __init__(self, model, spec: CacheSpec, *, mode: str, device, dtype, buffer_dtype=None,
                 backend: Backend = REFERENCE, cuda_graphs: bool = False):
        self.model, self.spec, self.mode = model, spec, mode
        self.device, self.backend = device, backend
        self.caches = ModelCaches(spec, device=device, dtype=dtype, buffer_dtype=buffer_dtype)
        self.has_linear = spec.num_linear_layers > 0
        self.inputs = StepInputs(spec.max_requests, torch.device(device))
        self.graphs = DecodeGraphs(self._decode_forward, self.inputs, spec.max_len) if cuda_graphs else None

    # slots -----------------------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        req.slot = self.caches.allocate_request()
        if self.mode == "recurrent" and self.has_linear:
            req.state_slot = self.caches.allocate_state()

    def release(self, req: Request) -> None:
        self.caches.free_request(req.slot, req.state_slot)
        req.slot, req.state_slot = -1, -1

    def _fill(self, req: Request) -> int:
        return self.caches.buffers.length(req.slot) if self.caches.buffers is not None else 0

    def _ensure_state(self, req: Request, adding: int) -> None:
        """A short-context request gets its state only when this forward fills its buffer."""
        if self.caches.buffers is not None and req.state_slot < 0 and \
                self._fill(req) + adding >= self.spec.chunk_size:
            req.state_slot = self.caches.allocate_state()

    def _batch(self, phase, reqs, positions) -> ForwardBatch:
        i32 = dict(dtype=torch.int32, device=self.device)
        return ForwardBatch(
            phase=phase, mode=self.mode, positions=positions, backend=self.backend,
            slots=torch.tensor([r.slot for r in reqs], **i32),
            state_slots=torch.tensor([r.state_slot for r in reqs], **i32),
            lengths=torch.tensor([self._fill(r) for r in reqs], **i32),
            cached=torch.tensor([r.cached for r in reqs], **i32),
            flush_at=self.spec.chunk_size,
            context_len=max(r.cached for r in reqs) + positions.shape[1],
        )

    def _decode_batch(self, view: torch.Tensor, context_len: int) -> ForwardBatch:
        """The decode ForwardBatch over StepInputs' device view (FIELDS order)."""
        ids, positions, slots, state_slots, lengths, cached = view
        i32 = torch.int32
        return ForwardBatch(phase="decode", mode=self.mode, backend=self.backend, positions=positions[:, None],
                            slots=slots.to(i32), state_slots=state_slots.to(i32), lengths=lengths.to(i32),
                            cached=cached.to(i32), flush_at=self.spec.chunk_size, context_len=context_len)

    def _decode_forward(self, view: torch.Tensor, context_len: int) -> torch.Tensor:
        return self._forward(view[0][:, None], self._decode_batch(view, context_len))[:, 0]

    def _forward(self, ids, batch: ForwardBatch, **kw):
        return self.model(ids, batch, self.caches, **kw)

    def _advance(self, req: Request, count: int) -> None:
        """After a forward that kept `count` tokens: buffer fill and KV length move on."""
        req.cached += count
        if self.caches.buffers is not None:
            fill = self._fill(req) + count
            self.caches.buffers.reset(req.slot)
            self.caches.buffers.accept(req.slot, fill % self.spec.chunk_size)

    # forwards --------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, reqs: list[Request], max_tokens: int, want_hidden: bool = False):
        """One prefill forward: up to max_tokens pending tokens for each of as many of `reqs` as have
        the same buffer fill and the same number of tokens to feed (at least one request; prompts
        of equal length go together). The linear layers cut the chunk at the flush points.

        Returns [(request, logits of its last prompt token if it has none pending now, else None,
        hidden states (T, H) of the tokens fed with want_hidden, else None)] for the rows fed.
        Call again until no request has pending tokens.
        """
        groups: dict[tuple[int, int], list[Request]] = {}
        for r in reqs:
            if r.pending:
                groups.setdefault((self._fill(r), min(len(r.pending), max_tokens)), []).append(r)
        if not groups:
            return []
        (fill, T), rows = max(groups.items(), key=lambda kv: kv[0][1] * len(kv[1]))
        rows = rows[:max(1, max_tokens // T)]
        for r in rows:
            if r.cached + T > self.spec.max_len:
                raise ValueError(f"request {r.rid}: context of {r.cached + T} tokens exceeds "
                                 f"max_len={self.spec.max_len}")
            self._ensure_state(r, T)
        ids = torch.tensor([r.pending[:T] for r in rows], dtype=torch.long, device=self.device)
        positions = torch.tensor([list(range(r.cached, r.cached + T)) for r in rows], dtype=torch.long,
                                 device=self.device)
        batch = self._batch("prefill", rows, positions)
        batch.common_fill = fill
        out = self._forward(ids, batch, **self._hidden(want_hidden))
        logits, hidden = out if want_hidden else (out, None)
        for r in rows:
            self._advance(r, T)
        return [(r, None if r.pending else logits[b, -1], hidden[b] if want_hidden else None)
                for b, r in enumerate(rows)]

    @staticmethod
    def _hidden(want: bool) -> dict:
        return {"return_hidden": True} if want else {}

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> torch.Tensor:
        """One token for each request (its last sampled one): logits (B, vocab)."""
        for r in reqs:
            if r.cached + 1 > self.spec.max_len:
                raise ValueError(f"request {r.rid}: context exceeds max_len={self.spec.max_len}")
            self._ensure_state(r, 1)
        columns = [[r.context[r.cached] for r in reqs], [r.cached for r in reqs], [r.slot for r in reqs],
                   [r.state_slot for r in reqs], [self._fill(r) for r in reqs], [r.cached for r in reqs]]
        context_len = max(r.cached for r in reqs) + 1
        logits = None
        if self.graphs is not None and self.graphs.enabled:
            try:
                logits = self.graphs.run(columns, context_len)
            except RuntimeError as e:  # a capture that failed leaves the caches untouched
                cause = e.__context__ or e  # the error inside the capture, not capture_end's follow-up
                log.warning("kvbuffer: CUDA graph capture failed, decoding eagerly from now on: %s",
                            str(cause).splitlines()[0] if str(cause) else repr(cause))
                self.graphs.enabled = False
        if logits is None:
            logits = self._decode_forward(self.inputs.upload(columns, len(reqs)), context_len)
        for r in reqs:
            self._advance(r, 1)
        return logits

    @torch.inference_mode()
    def verify(self, reqs: list[Request], drafts: list[list[int]], want_hidden: bool = False):
        """Feed each request's last token plus its T drafts in one forward: logits (B, T+1, vocab)
        (and the hidden states (B, T+1, H) with want_hidden).

        Nothing is committed: call commit() with the number of tokens each request keeps.
        """
        T1 = len(drafts[0]) + 1
        if T1 > self.spec.max_drafts:
            raise ValueError(f"{T1 - 1} drafts exceed the caches' room for {self.spec.max_drafts - 1}")
        for r in reqs:
            if r.cached + T1 > self.spec.max_len:
                raise ValueError(f"request {r.rid}: context exceeds max_len={self.spec.max_len}")
        ids = torch.tensor([[r.context[r.cached]] + d for r, d in zip(reqs, drafts)], dtype=torch.long,
                           device=self.device)
        positions = torch.tensor([[r.cached + i for i in range(T1)] for r in reqs], dtype=torch.long,
                                 device=self.device)
        return self._forward(ids, self._batch("verify", reqs, positions), **self._hidden(want_hidden))

    @torch.inference_mode()
    def commit(self, reqs: list[Request], kept: list[int]) -> None:
        """Keep the first kept[b] fed tokens of each request's last verify (at least its real token)."""
        i32 = dict(dtype=torch.int32, device=self.device)
        slots = torch.tensor([r.slot for r in reqs], **i32)
        if self.has_linear:
            counts = torch.tensor(kept, **i32)
            for layer in range(self.spec.num_linear_layers):  # conv histories take the kept inputs
                self.backend.conv_accept(self.caches.convs.layer(layer), slots, counts, self.spec.conv_width)
        for r, m in zip(reqs, kept):
            r.cached += m
        if self.caches.draft_states is not None:  # copy back each request's accepted draft state
            states = torch.tensor([r.state_slot for r in reqs], dtype=torch.long, device=self.device)
            which = torch.tensor(kept, dtype=torch.long, device=self.device) - 1
            for layer in range(self.spec.num_linear_layers):
                self.caches.states.layer(layer)[states] = self.caches.draft_states[layer][slots.long(), which]
            return
        buffers = self.caches.buffers
        if buffers is None:
            return
        full = []  # accepted entries simply stay; buffers that reached C are folded into their states
        for r, m in zip(reqs, kept):
            buffers.accept(r.slot, m)
            if buffers.length(r.slot) >= self.spec.chunk_size:
                if r.state_slot < 0:
                    r.state_slot = self.caches.allocate_state()
                full.append(r)
        if full:
            self._flush(full)

    def _flush(self, reqs: list[Request]) -> None:
        """Fold the buffers of these requests into their states, every layer in one launch each."""
        i32 = dict(dtype=torch.int32, device=self.device)
        buffers = self.caches.buffers
        state_slots = torch.tensor([r.state_slot for r in reqs], **i32)
        slots = torch.tensor([r.slot for r in reqs], **i32)
        fills = torch.tensor([buffers.length(r.slot) for r in reqs], **i32)
        family = "gdn" if self.spec.linear_shape.delta_rule else "mamba2"
        for layer in range(self.spec.num_linear_layers):
            self.backend.flush(family, self.caches.states.layer(layer), state_slots, buffers.layer(layer).tensors(),
                               slots, fills)
        for r in reqs:
            buffers.reset(r.slot)
