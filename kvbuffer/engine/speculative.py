"""Speculative decoding: drafters, and the rule that decides which drafts the target model keeps.

Each step feeds every request's last token plus T drafts through one verify forward. With
KVBuffer the T+1 entries land in the buffer and accepting m of them is a length update; nothing
like a per-draft state exists. The acceptance rule is the standard one: greedy keeps the drafts
that equal the target's argmax; with sampling, a draft d drawn from q is kept with probability
min(1, p(d)/q(d)), and on rejection the next token is drawn from norm(max(p - q, 0)), which leaves
the output distribution exactly p. kvbuffer's drafters (kvbuffer.engine.drafters) propose
deterministically (q is a point mass), so acceptance is p(d) and the residual is p with d removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .options import is_int
from .sampling import ROWS_PER_PASS, SamplingParams, check_drawn, draw, filtered_rows, on_device

METHODS = ("ngram", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_draft_tokens: int
    ngram_max: int = 3  # longest suffix the n-gram drafter tries to match
    ngram_min: int = 1
    # Steps with more running requests decode plainly (None: always speculate). A verify feeds T + 1
    # tokens per request, so past some batch its GEMMs turn compute-bound and a step of accepted drafts
    # costs more than the plain steps it replaces; where depends on the GPU, the model and the acceptance.
    disable_above_batch: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_draft_tokens", "ngram_max", "ngram_min"):
            value = getattr(self, name)
            if not is_int(value):
                raise TypeError(f"speculative {name} must be an int, got {type(value).__name__} {value!r}")
        limit = self.disable_above_batch
        if limit is not None and not is_int(limit):
            raise TypeError(f"speculative disable_above_batch must be an int or None, got {type(limit).__name__} "
                            f"{limit!r}")
        if limit is not None and limit < 1:
            raise ValueError(f"speculative disable_above_batch must be >= 1, got {limit}")
        if limit is not None and self.method == "mtp":
            raise ValueError("speculative disable_above_batch needs method 'ngram': the MTP head drafts from "
                             "every step's hidden states, which a plain decode step does not keep")
        if not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"num_draft_tokens must be in [1, 16], got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"speculative ngram sizes need 1 <= ngram_min <= ngram_max, got "
                             f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}")

    @classmethod
    def from_dict(cls, d: Mapping | None) -> "SpeculativeConfig | None":
        if d is None:
            return None
        if not isinstance(d, Mapping):
            raise TypeError(f"speculative must be a dict such as {{'method': 'ngram', 'num_draft_tokens': 4}} "
                            f"or None, got {type(d).__name__} {d!r}")
        unknown = set(d) - {"method", "num_draft_tokens", "ngram_max", "ngram_min", "disable_above_batch"}
        if unknown:
            raise ValueError(f"unknown speculative options {sorted(unknown, key=str)}")
        missing = {"method", "num_draft_tokens"} - set(d)
        if missing:
            raise ValueError(f"speculative lacks {sorted(missing)}")
        return cls(**d)


def accept_drafts(logits: torch.Tensor, drafts: list[int | None], params: SamplingParams,
                  generator: torch.Generator | None, argmax: list[int] | None = None) -> tuple[int, int]:
    """Decide how many deterministic drafts to keep and the token that follows them.

    logits: (T+1, V), row i is the target's prediction after the real token and drafts[:i].
    drafts: T proposals; None marks padding (never kept). Returns (kept m, next token).
    argmax: logits' argmax per row when the caller computed it for the whole batch at once.
    """
    if params.temperature != 0.0:
        kept, following = accept_sampled(logits[None], [drafts], [params], [generator])
        return kept[0], following[0]
    if argmax is None:
        argmax = torch.argmax(logits, dim=-1).tolist()
    for i, d in enumerate(drafts):
        if d is None or d != argmax[i]:
            return i, argmax[i]
    return len(drafts), argmax[len(drafts)]


def accept_sampled(logits: torch.Tensor, drafts: list[list[int | None]], params: list[SamplingParams],
                   generators: list) -> tuple[list[int], list[int]]:
    """accept_drafts for a batch of sampled rows at once, on the logits' device: (kept m, next token)
    per row, with one transfer to the host for the batch.

    logits: (R, T+1, V); drafts: R lists of T proposals (None: padding, never kept); each row's own
    params (temperature > 0) and generator. Draft i is kept while u_i < p_i(d_i) for uniforms u_i; the
    next token comes from p_m with d_m removed (the residual) after a rejection at m, from p_T when
    every draft was kept. A row draws all T uniforms whatever it keeps (the ones past its first
    rejection decide nothing), so the whole batch runs in a fixed number of launches."""
    R, T1, V = logits.shape
    T = T1 - 1
    if len(drafts) != R or len(params) != R or len(generators) != R:
        raise ValueError(f"accept_sampled: {R} rows of logits, {len(drafts)} draft lists, {len(params)} params, "
                         f"{len(generators)} generators")
    if any(len(ds) != T for ds in drafts):
        raise ValueError(f"accept_sampled: every row takes T = {T} drafts (None for padding)")
    dev = logits.device
    d = on_device([[-1 if x is None else x for x in ds] for ds in drafts], torch.long, dev).view(R, T)
    # p_i(d_i), ROWS_PER_PASS filtered rows at a time (a wide verify's rows are never all filtered at once)
    p_draft = torch.empty((R, T), dtype=torch.float32, device=dev)
    step = max(1, ROWS_PER_PASS // max(T, 1))
    for r0 in range(0, R if T else 0, step):
        each = [p for p in params[r0:r0 + step] for _ in range(T)]
        part = filtered_rows(logits[r0:r0 + step, :T].reshape(-1, V), each)
        p_draft[r0:r0 + step] = part.gather(-1, d[r0:r0 + step].reshape(-1, 1).clamp(min=0)).view(-1, T)
    p_draft = p_draft.masked_fill(d < 0, -1.0)
    u = torch.empty((R, T), dtype=torch.float32, device=dev).uniform_()
    for r, g in enumerate(generators):
        if g is not None:
            u[r] = torch.rand(T, generator=g, device=dev, dtype=torch.float32)
    kept = torch.cumprod((u < p_draft).long(), dim=-1).sum(-1)  # drafts before the first rejection
    rows = torch.arange(R, device=dev)
    q = filtered_rows(logits[rows, kept], params)  # (R, V): p_m, or p_T when every draft was kept
    d_m = torch.cat([d, torch.full((R, 1), -1, dtype=torch.long, device=dev)], dim=1)[rows, kept]  # -1: none
    q = q.masked_fill(torch.arange(V, device=dev) == d_m[:, None], 0.0)  # the residual: p_m without d_m
    following = draw(q, generators)  # the race needs no normalised weights: argmax(q_i / E_i) is drawn by q
    out = torch.stack([kept, following]).tolist()
    return out[0], check_drawn(out[1])
