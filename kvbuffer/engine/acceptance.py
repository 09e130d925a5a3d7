"""The acceptance rule of speculative decoding: which drafts the target model keeps.

Greedy keeps the drafts equal to the target's argmax. Sampled rows keep draft d (drawn from q) with
probability min(1, p(d)/q(d)) and on rejection draw from norm(max(p - q, 0)), which leaves the output
distribution exactly p; kvbuffer's drafters are deterministic (q a point mass), so acceptance is p(d)
and the residual is p without d.
"""

from __future__ import annotations

import torch

from .sampling import ROWS_PER_PASS, SamplingParams, draw, filtered_rows, greedy_picks, on_device


def accept_drafts(logits: torch.Tensor, drafts: list[int | None], params: SamplingParams,
                  generator: torch.Generator | None, argmax: list[int] | None = None) -> tuple[int, int]:
    """Decide how many deterministic drafts to keep and the token that follows them.

    logits: (T+1, V), row i is the target's prediction after the real token and drafts[:i].
    drafts: T proposals; None marks padding (never kept). Returns (kept m, next token).
    argmax: logits' greedy_picks per row when the caller computed them for the whole batch at once.
    A row of NaN or infinite logits picks NO_TOKEN, which no draft equals.
    """
    if params.temperature != 0.0:
        kept, following = accept_sampled(logits[None], [drafts], [params], [generator])
        return kept[0], following[0]
    if argmax is None:
        argmax = greedy_picks(logits).tolist()
    for i, d in enumerate(drafts):
        if d is None or d != argmax[i]:
            return i, argmax[i]
    return len(drafts), argmax[len(drafts)]


def accept_sampled(logits: torch.Tensor, drafts: list[list[int | None]], params: list[SamplingParams],
                   generators: list) -> tuple[list[int], list[int]]:
    """accept_drafts for a batch of sampled rows, on the logits' device, one transfer to the host:
    (kept m, next token) per row.

    logits: (R, T+1, V); drafts: R lists of T proposals (None: padding, never kept); each row's own
    params (temperature > 0) and generator. Draft i is kept while u_i < p_i(d_i); the next token is
    drawn from p_m without d_m after a rejection at m, from p_T when all were kept. Every row draws
    all T uniforms, so the batch runs in a fixed number of launches. A row without a distribution
    (NaN or infinite logits) keeps what it kept before it and gets NO_TOKEN as its next token."""
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
    return out[0], out[1]
