"""Drafters for speculative decoding: n-gram prompt lookup, and the model's own MTP head.

A drafter proposes deterministic draft tokens (kvbuffer.engine.acceptance has the acceptance
rule). The engine tells it what happened through two hooks, so a drafter with state (the MTP
head's KV cache) can follow each request: `on_prefill` after a prompt was processed and its first
token sampled, `on_commit` after a verify, with the tokens each request kept.
"""

from __future__ import annotations

import torch

from ..runtime.batch import ForwardBatch
from ..runtime.caches import KVCache


class Drafter:
    """Interface and no-op hooks; `needs_hidden` asks the engine for the target's hidden states."""

    needs_hidden = False

    def propose(self, reqs, count: int) -> list[list[int]]:
        raise NotImplementedError

    def on_prefill(self, req, hidden, next_tokens: list[int]) -> None:
        """hidden (T, H) of the prompt positions just processed; next_tokens: the token after each."""

    def on_commit(self, reqs, hidden, kept: list[int], next_tokens: list[list[int]]) -> None:
        """hidden (B, T+1, H) of the verify; request b kept its first kept[b] fed positions, whose
        following tokens are next_tokens[b]."""

    def release(self, req) -> None:
        """The request finished; forget it."""


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (longest n
    first) and propose the tokens that followed it. No second model needed."""

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, reqs, count):
        return [self.lookup(r.context, count) for r in reqs]

    def lookup(self, context: list[int], count: int) -> list[int]:
        for n in range(min(self.ngram_max, len(context) - 1), self.ngram_min - 1, -1):
            suffix = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    follow = context[start + n:start + n + count]
                    if follow:
                        return follow
        return []


class MTPDrafter(Drafter):
    """Drafts with the model's multi-token-prediction head (Qwen3.5's kvbuffer.models.mtp, or
    Nemotron-3 Super's in kvbuffer.models.nemotron_h).

    The head keeps its own KV cache per request slot, filled by catching up on every
    position whose next token is known (prompt positions after prefill, kept positions after a
    verify) with the target model's hidden states. Drafting then applies the head recursively;
    those speculative KV entries sit past the committed length and are overwritten next time.
    """

    needs_hidden = True

    def __init__(self, model, *, max_requests: int, max_len: int, max_drafts: int, device, dtype):
        if getattr(model, "mtp", None) is None:
            raise ValueError("speculative method 'mtp' needs a checkpoint with an MTP head (mtp.* tensors); "
                             "use method 'ngram' for this model")
        c = model.config
        self.model = model
        self.kv = KVCache(model.mtp.num_attention_layers, max_requests, max_len + 2 * max_drafts + 2,
                          c.num_key_value_heads, c.head_dim, device=device, dtype=dtype)
        self.device = device
        self.committed: dict[int, int] = {}  # slot -> MTP KV entries that belong to the request
        self.last: dict[int, tuple[int, int, torch.Tensor]] = {}  # slot -> (draft 1, position, head hidden)

    # -- the head --------------------------------------------------------------------------------
    def _run(self, slots, positions, tokens, hidden, kv_start) -> torch.Tensor:
        i32 = dict(dtype=torch.int32, device=self.device)
        B = len(slots)
        batch = ForwardBatch(phase="verify", mode="kvbuffer", positions=positions,
                             slots=torch.tensor(slots, **i32), state_slots=torch.full((B,), -1, **i32),
                             lengths=torch.zeros(B, **i32), cached=torch.tensor(kv_start, **i32), flush_at=1)
        embeds = self.model.embed(tokens)
        return self.model.mtp(embeds, hidden.to(embeds.dtype), batch, self)

    def _greedy(self, h: torch.Tensor) -> list[int]:
        return torch.argmax(self.model.lm_head(h), dim=-1).tolist()

    @torch.inference_mode()
    def _catch_up(self, slots, first_positions, hiddens, next_tokens):
        """Feed (next token, hidden) pairs per request (ragged; padded at the end, outputs read before it)."""
        B, T = len(slots), max(len(t) for t in next_tokens)
        H = hiddens[0].shape[-1]
        tokens = torch.zeros(B, T, dtype=torch.long, device=self.device)
        hidden = torch.zeros(B, T, H, dtype=hiddens[0].dtype, device=self.device)
        for b, (h, t) in enumerate(zip(hiddens, next_tokens)):
            tokens[b, : len(t)] = torch.tensor(t, device=self.device)
            hidden[b, : len(t)] = h
        positions = torch.tensor(first_positions, device=self.device)[:, None] + torch.arange(T, device=self.device)
        out = self._run(slots, positions, tokens, hidden, [self.committed[s] for s in slots])
        lasts = torch.stack([out[b, len(t) - 1] for b, t in enumerate(next_tokens)])
        for b, (slot, t) in enumerate(zip(slots, next_tokens)):
            self.committed[slot] += len(t)
        for b, (slot, d) in enumerate(zip(slots, self._greedy(lasts))):
            self.last[slot] = (d, first_positions[b] + len(next_tokens[b]) - 1, lasts[b])

    # -- hooks ------------------------------------------------------------------------------------
    def on_prefill(self, req, hidden, next_tokens):
        self.committed.setdefault(req.slot, 0)
        self._catch_up([req.slot], [req.cached - len(next_tokens)], [hidden], [next_tokens])

    def on_commit(self, reqs, hidden, kept, next_tokens):
        self._catch_up([r.slot for r in reqs], [r.cached - m for r, m in zip(reqs, kept)],
                       [hidden[b, :m] for b, m in enumerate(kept)], next_tokens)

    @torch.inference_mode()
    def propose(self, reqs, count):
        slots = [r.slot for r in reqs]
        drafts = [[self.last[s][0]] for s in slots]
        h = torch.stack([self.last[s][2] for s in slots])[:, None]
        pos = [self.last[s][1] for s in slots]
        for k in range(1, count):  # apply the head to its own output
            tokens = torch.tensor([[d[-1]] for d in drafts], device=self.device)
            positions = torch.tensor([[p + k] for p in pos], device=self.device)
            h = self._run(slots, positions, tokens, h, [self.committed[s] + k - 1 for s in slots])
            for d, t in zip(drafts, self._greedy(h[:, 0])):
                d.append(t)
        return drafts

    def release(self, req):
        self.committed.pop(req.slot, None)
        self.last.pop(req.slot, None)
