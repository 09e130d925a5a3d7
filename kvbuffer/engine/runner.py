"""The model runner: owns the model, the caches and the forwards; the scheduler tells it what to run.

Each forward is followed by the bookkeeping KVBuffer needs, done once for all layers: buffer fills
advance (or reset where a flush folded the buffer into the state), and KV lengths grow.
"""

from __future__ import annotations

import torch

from ..reference import conv as conv_ops
from ..reference import core
from ..runtime.batch import ForwardBatch
from ..runtime.caches import CacheSpec, ModelCaches
from .request import Request


class ModelRunner:
    def __init__(self, model, spec: CacheSpec, *, mode: str, device, dtype, buffer_dtype=None, kernels: bool = False):
        self.model, self.spec, self.mode = model, spec, mode
        self.device = device
        self.caches = ModelCaches(spec, device=device, dtype=dtype, buffer_dtype=buffer_dtype, kernels=kernels)
        self.has_linear = spec.num_linear_layers > 0

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

    def _batch(self, kind, reqs, positions) -> ForwardBatch:
        i32 = dict(dtype=torch.int32, device=self.device)
        return ForwardBatch(
            kind=kind, mode=self.mode, positions=positions,
            slots=torch.tensor([r.slot for r in reqs], **i32),
            state_slots=torch.tensor([r.state_slot for r in reqs], **i32),
            lengths=torch.tensor([self._fill(r) for r in reqs], **i32),
            cached=torch.tensor([r.cached for r in reqs], **i32),
            flush_at=self.spec.chunk_size,
        )

    def _advance(self, req: Request, count: int) -> None:
        """After a forward that kept `count` tokens: buffer fill and KV length move on."""
        req.cached += count
        if self.caches.buffers is not None:
            fill = self._fill(req) + count
            self.caches.buffers.reset(req.slot)
            self.caches.buffers.accept(req.slot, fill % self.spec.chunk_size)

    # forwards --------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, req: Request, max_tokens: int, want_hidden: bool = False):
        """Feed up to `max_tokens` of the request's pending tokens.

        Returns the logits of the last one if it was the last pending token (else None), and with
        want_hidden also the final hidden states of the tokens fed, (T, H).
        """
        tokens = req.pending[:max_tokens]
        if req.cached + len(tokens) > self.spec.max_len:
            raise ValueError(f"request {req.rid}: context of {req.cached + len(tokens)} tokens exceeds "
                             f"max_len={self.spec.max_len}")
        self._ensure_state(req, len(tokens))
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(req.cached, req.cached + len(tokens), device=self.device)[None]
        out = self.model(ids, self._batch("prefill", [req], positions), self.caches, **self._hidden(want_hidden))
        logits, hidden = out if want_hidden else (out, None)
        self._advance(req, len(tokens))
        last = logits[0, -1] if not req.pending else None
        return (last, hidden[0]) if want_hidden else last

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
        ids = torch.tensor([[r.context[r.cached]] for r in reqs], dtype=torch.long, device=self.device)
        positions = torch.tensor([[r.cached] for r in reqs], dtype=torch.long, device=self.device)
        logits = self.model(ids, self._batch("decode", reqs, positions), self.caches)
        for r in reqs:
            self._advance(r, 1)
        return logits[:, 0]

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
        return self.model(ids, self._batch("verify", reqs, positions), self.caches, **self._hidden(want_hidden))

    @torch.inference_mode()
    def commit(self, reqs: list[Request], kept: list[int]) -> None:
        """Keep the first kept[b] fed tokens of each request's last verify (at least its real token)."""
        if self.has_linear:
            i32 = dict(dtype=torch.int32, device=self.device)
            slots = torch.tensor([r.slot for r in reqs], **i32)
            counts = torch.tensor(kept, **i32)
            for layer in range(self.spec.num_linear_layers):  # conv histories take the kept inputs
                conv_ops.conv_accept(self.caches.convs.layer(layer), slots, counts, self.spec.conv_width)
        for r, m in zip(reqs, kept):
            if self.caches.draft_states is not None:
                for layer in range(self.spec.num_linear_layers):  # copy back the accepted draft's state
                    self.caches.states.layer(layer)[r.state_slot] = self.caches.draft_states[layer][r.slot, m - 1]
                r.cached += m
            else:
                self._commit_buffer(r, m)

    def _commit_buffer(self, r: Request, m: int) -> None:
        """Accepted entries simply stay in the buffer; a buffer that reached C is folded into the state."""
        r.cached += m
        buffers = self.caches.buffers
        if buffers is None:
            return
        buffers.accept(r.slot, m)
        if buffers.length(r.slot) < self.spec.chunk_size:
            return
        if r.state_slot < 0:
            r.state_slot = self.caches.allocate_state()
        i32 = dict(dtype=torch.int32, device=self.device)
        rows = (torch.tensor([r.state_slot], **i32), torch.tensor([r.slot], **i32))
        fill = torch.tensor([buffers.length(r.slot)], **i32)
        for layer in range(self.spec.num_linear_layers):
            core.flush(self.caches.states.layer(layer), rows[0], *buffers.layer(layer).tensors(), rows[1], fill)
        buffers.reset(r.slot)
