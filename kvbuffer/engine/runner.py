"""The model runner: owns the model, the caches and the forwards; the scheduler tells it what to run.

Each forward is followed by the bookkeeping KVBuffer needs, done once for all layers: buffer fills
advance (or reset where a flush folded the buffer into the state), and KV lengths grow.
"""

from __future__ import annotations

import torch

from ..runtime.batch import ForwardBatch
from ..runtime.caches import CacheSpec, ModelCaches
from .request import Request


class ModelRunner:
    def __init__(self, model, spec: CacheSpec, *, mode: str, device, dtype):
        self.model, self.spec, self.mode = model, spec, mode
        self.device = device
        self.caches = ModelCaches(spec, device=device, dtype=dtype)
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
        return self.caches.buffers.length(req.slot) if self.has_linear else 0

    def _ensure_state(self, req: Request, adding: int) -> None:
        """A short-context request gets its state only when this forward fills its buffer."""
        if self.has_linear and req.state_slot < 0 and self._fill(req) + adding >= self.spec.chunk_size:
            req.state_slot = self.caches.allocate_state()

    def _batch(self, kind, reqs, positions) -> ForwardBatch:
        i32 = dict(dtype=torch.int32, device=self.device)
        return ForwardBatch(
            kind=kind, mode=self.mode, positions=positions,
            slots=torch.tensor([r.slot for r in reqs], **i32),
            state_slots=torch.tensor([r.state_slot for r in reqs], **i32),
            lengths=torch.tensor([self._fill(r) if self.mode == "kvbuffer" else 0 for r in reqs], **i32),
            cached=torch.tensor([r.cached for r in reqs], **i32),
            flush_at=self.spec.chunk_size,
        )

    def _advance(self, req: Request, count: int) -> None:
        """After a forward that kept `count` tokens: buffer fill and KV length move on."""
        req.cached += count
        if self.has_linear and self.mode == "kvbuffer":
            fill = self._fill(req) + count
            self.caches.buffers.reset(req.slot)
            self.caches.buffers.accept(req.slot, fill % self.spec.chunk_size)

    # forwards --------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, req: Request, max_tokens: int) -> torch.Tensor | None:
        """Feed up to `max_tokens` of the request's pending tokens; logits of the last one if it was the last."""
        tokens = req.pending[:max_tokens]
        if req.cached + len(tokens) > self.spec.max_len:
            raise ValueError(f"request {req.rid}: context of {req.cached + len(tokens)} tokens exceeds "
                             f"max_len={self.spec.max_len}")
        self._ensure_state(req, len(tokens))
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(req.cached, req.cached + len(tokens), device=self.device)[None]
        logits = self.model(ids, self._batch("prefill", [req], positions), self.caches)
        self._advance(req, len(tokens))
        return logits[0, -1] if not req.pending else None

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
