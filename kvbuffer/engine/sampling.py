"""Token sampling: greedy, temperature, top-k and top-p, each request with its own seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None  # None = the model's eos tokens
    logprobs: bool = False  # record each sampled token's log-probability (one softmax per token)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from, (V,) in fp32: temperature, then top-k, then top-p."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        probs = probs / probs.sum()
    return probs


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits (V,)."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def token_logprob(logits: torch.Tensor, token: int) -> float:
    """log p(token) under the model's distribution (before temperature and filtering), as OpenAI reports it."""
    return float(torch.log_softmax(logits.float(), dim=-1)[token])


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """One token per row of logits (B, V): greedy rows share one argmax and one transfer to the
    host (a per-row argmax would synchronise B times); sampled rows draw with their own generator."""
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    out = [0] * len(params)
    if greedy:
        picked = logits if len(greedy) == len(params) else logits[greedy]
        for i, token in zip(greedy, torch.argmax(picked, dim=-1).tolist()):
            out[i] = token
    for i, p in enumerate(params):
        if p.temperature != 0.0:
            out[i] = sample_token(logits[i], p, generators[i])
    return out
