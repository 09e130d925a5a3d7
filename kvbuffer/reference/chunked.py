"""Chunked prefill of packed prompts in the chunkwise (WY / UT) form: core.prefill's semantics,
memory linear in the prompt.

Inputs are core's, after the gating front, for the tokens of B requests concatenated:
q, k (N, Hk, K), v (N, Hv, V), g, beta (N, Hv) (beta None: the decay-only form), with
`cu_seqlens` (B + 1,) int the cumulative token offsets (request i owns tokens cu[i] .. cu[i+1]-1).
Pools, slots and `lengths` (the fills f) follow kvbuffer.reference.core.

Contract, per request of P tokens, fill f and C = flush_at (what core.prefill does, verify chunk
by verify chunk): with f + P >= C, the f buffered entries and the prompt up to the last flush
point (a multiple of C entries from S0) are folded into the state, and the last
r = (f + P) mod C tokens are written as buffer entries 0 .. r-1 (key, delta or value, cumulative
log decay G since the new state), not folded. With f + P < C nothing is folded and the P tokens
become entries f .. f+P-1 after the buffered ones (the state slot may then be -1: S0 = 0).
Returns (o (N, Hv, V) in v's dtype, the new fills (f + P) mod C (B,)); `lengths` itself is not
changed. A row whose buffer slot is -1 is padding: zero outputs, nothing written, its fill kept.

The form: each request starts from S_f = exp(G_f) S0 + sum_i exp(G_f - G_i) k_i u_i^T (its
buffered entries, read back in the buffer's dtype, as flush reads them). Its prompt is cut into
chunks of `chunk_size` tokens that never cross the fold point. Within a chunk, with gamma the
cumulative log decay since the chunk's start, the delta rule's deltas U solve the unit lower
triangular system (I + A) U = beta (V - exp(gamma) K S) with A_ts = beta_t exp(gamma_t - gamma_s)
k_t . k_s (s < t), so U = Uhat - W S with Uhat, W independent of S (solved for every chunk at
once); then o = exp(gamma) Q S + (exp(gamma_t - gamma_s) q_t . k_s)_{s <= t} U and
S <- exp(gamma_L) S + (exp(gamma_L - gamma_s) k_s)_s^T U. Only that state carry is sequential,
over the chunks of all requests in step. Tensors are at most (chunks, Hv, chunk, chunk), with
at most N / chunk + 2B chunks: O(N x chunk + B x chunk^2) per head, no (P x P) tensor.
Computed in the state's dtype; the fold uses the deltas at that precision (a buffer of a
narrower dtype rounds only the stored entries).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import FLOAT_DTYPES, INDEX_DTYPES, check_tensor
from ..errors import ShapeError, SlotError
from .core import (
    _check_buffer,
    _check_rows,
    _last_log_decay,
    _masked_weights,
    _read_buffer,
    _read_states,
    clamp_log_decay,
)

__all__ = ["prefill", "CHUNK_SIZE"]

CHUNK_SIZE = 64  # tokens per chunk of the chunkwise form (FLA's and transformers' default)


# ----------------------------------------------------------------------------------------------
# validation and the host-side plan


@dataclass(frozen=True)
class _Plan:
    """Which rows run, and how their prompts are cut; rows sorted by decreasing chunk count, so the
    rows still running at step j are the first ones and the chunks of step j are contiguous."""

    rows: list[int]         # batch rows with a buffer slot and at least one token, in run order
    fills: list[int]        # their fills f
    slots: list[int]        # their buffer slots
    folds: list[bool]       # whether each row reaches a flush point (its state is written)
    tails: list[int]        # tokens each row writes as buffer entries without folding
    starts: list[int]       # chunk start token, chunks ordered by (step, row)
    sizes: list[int]        # chunk lengths
    per_step: list[int]     # chunks of each step (= rows still running at that step)
    fold_ends: list[list[int]]  # per step: run-order rows whose fold point ends that step's chunk


def check_packed(q, k, v, g, beta, state) -> tuple[int, int, int, int, int]:
    """Shapes, float dtypes and one device for packed q, k (N, Hk, K), v (N, Hv, V), g, beta (N, Hv) (beta
    may be None) against state (slots, Hv, K, V); returns N, Hk, Hv, K, V."""
    check_tensor("state", state, (None, None, None, None), (torch.float32, torch.float64))
    _, Hv, K, V = state.shape
    dev = state.device
    check_tensor("q", q, (None, None, K), FLOAT_DTYPES, dev)
    N, Hk = q.shape[:2]
    check_tensor("k", k, (N, Hk, K), FLOAT_DTYPES, dev)
    check_tensor("v", v, (N, Hv, V), FLOAT_DTYPES, dev)
    check_tensor("g", g, (N, Hv), FLOAT_DTYPES, dev)
    if beta is not None:
        check_tensor("beta", beta, (N, Hv), FLOAT_DTYPES, dev)
    if Hk == 0 or Hv % Hk:
        raise ShapeError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    return N, Hk, Hv, K, V


def _check_inputs(q, k, v, g, beta, cu_seqlens, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths,
                  flush_at, chunk_size):
    """Every check that needs no device read-back; returns the number of tokens N."""
    N, Hk, Hv, K, V = check_packed(q, k, v, g, beta, state)
    dev = state.device
    n_slots, cap = _check_buffer(buf_k, buf_v, buf_g, state, Hk, Hv, K, V)  # also: no pool shares memory
    check_tensor("cu_seqlens", cu_seqlens, (None,), INDEX_DTYPES, dev)
    if cu_seqlens.shape[0] < 1:
        raise ShapeError("cu_seqlens must hold B + 1 offsets (at least [0]), got an empty tensor")
    _check_rows(state, state_slots, buffer_slots, lengths, cu_seqlens.shape[0] - 1, n_slots)
    if isinstance(flush_at, bool) or not isinstance(flush_at, int) or not 0 < flush_at <= cap:
        raise ShapeError(f"flush_at must be an int in [1, {cap}] (the buffer capacity), got {flush_at!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ShapeError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    return N


def _cut(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """Tokens lo .. hi-1 as (start, length) chunks of at most `size`."""
    return [(a, min(size, hi - a)) for a in range(lo, hi, size)]


def _plan(cu_seqlens, state_slots, buffer_slots, lengths, N, flush_at, chunk_size) -> _Plan:
    """Read the offsets, slots and fills back, check their values, and cut the prompts."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != N or any(b < a for a, b in zip(cu, cu[1:])):
        raise ShapeError(f"cu_seqlens must rise from 0 to the {N} tokens of q without falling, got {cu[:8]}"
                         + (" ..." if len(cu) > 8 else ""))
    found = []  # (row, fill, buffer slot, folds, tail, chunks, index of the chunk ending at the fold point)
    for i, (f, s, b) in enumerate(zip(lengths.tolist(), state_slots.tolist(), buffer_slots.tolist())):
        P = cu[i + 1] - cu[i]
        if b < 0:
            continue
        if not 0 <= f < flush_at:
            raise ShapeError(f"lengths[{i}] = {f}: a fill must be in [0, flush_at={flush_at})")
        fold = f + P >= flush_at
        if fold and s < 0:
            raise SlotError(f"row {i}: a prompt of {P} tokens after {f} buffered ones fills the buffer "
                            f"(flush_at={flush_at}); allocate a state slot first")
        if P:
            tail = (f + P) % flush_at if fold else P
            head = _cut(cu[i], cu[i + 1] - tail, chunk_size)
            found.append((i, f, b, fold, tail, head + _cut(cu[i + 1] - tail, cu[i + 1], chunk_size),
                          len(head) - 1 if fold else -1))
    found.sort(key=lambda r: -len(r[5]))  # stable: ties keep batch order
    starts, sizes, per_step, fold_ends = [], [], [], []
    for j in range(len(found[0][5]) if found else 0):
        running = [r for r in found if len(r[5]) > j]
        per_step.append(len(running))
        fold_ends.append([n for n, r in enumerate(running) if r[6] == j])
        starts += [r[5][j][0] for r in running]
        sizes += [r[5][j][1] for r in running]
    rows, fills, slots, folds, tails = ([list(x) for x in zip(*found)][:5] if found else [[]] * 5)
    return _Plan(rows, fills, slots, folds, tails, starts, sizes, per_step, fold_ends)


# ----------------------------------------------------------------------------------------------
# the op


def prefill(q, k, v, g, beta, cu_seqlens, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths,
            flush_at: int, chunk_size: int = CHUNK_SIZE):
    """Chunked prefill of packed prompts (module docstring): returns (o (N, Hv, V), new fills (B,))."""
    N = _check_inputs(q, k, v, g, beta, cu_seqlens, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                      lengths, flush_at, chunk_size)
    plan = _plan(cu_seqlens, state_slots, buffer_slots, lengths, N, flush_at, chunk_size)
    new_lengths = torch.where(buffer_slots >= 0, (lengths + cu_seqlens.diff().to(lengths.dtype)) % flush_at, lengths)
    Hv, V = state.shape[1], state.shape[3]
    o = torch.zeros((N, Hv, V), dtype=state.dtype, device=state.device)
    if not plan.rows:
        return o.to(v.dtype), new_lengths
    dev = state.device
    rows = torch.tensor(plan.rows, dtype=torch.long, device=dev)
    S = _start_states(state, state_slots[rows], buf_k, buf_v, buf_g, buffer_slots[rows], lengths[rows])
    chunks = _Chunks(q, k, v, g, beta, plan, state.dtype)
    u, folded = chunks.carry(S, plan)
    o[chunks.tokens] = chunks.outputs()[chunks.filled]
    u_tok = torch.empty_like(o)
    u_tok[chunks.tokens] = u[chunks.filled]
    entries = _tail_entries(k, g, u_tok, cu_seqlens, buf_g, buffer_slots, lengths, plan)
    # every value is computed: now write
    fold_rows = [n for n, f in enumerate(plan.folds) if f]
    if fold_rows:
        at = torch.tensor(fold_rows, dtype=torch.long, device=dev)
        state[state_slots[rows[at]].long()] = folded[at]
    if entries is not None:
        slot, pos, kk, uu, GG = entries
        buf_k[slot, pos] = kk.to(buf_k.dtype)
        buf_v[slot, pos] = uu.to(buf_v.dtype)
        buf_g[slot, pos] = GG.to(buf_g.dtype)
    return o.to(v.dtype), new_lengths


def _start_states(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths):
    """S_f of each row: its state (0 for the null slot) with its f buffered entries folded in, as
    core.flush computes it; nothing is written. (R, Hv, K, V) in the state's dtype."""
    dt, Hv = state.dtype, state.shape[1]
    S0 = _read_states(state, state_slots)
    if not bool((lengths > 0).any()):
        return S0
    keys, vals, logd, filled = _read_buffer(buf_k, buf_v, buf_g, buffer_slots, lengths, Hv, dt)
    G_last = _last_log_decay(logd, lengths)
    w = _masked_weights(G_last[:, None, :], logd, filled[..., None])
    return torch.exp(G_last)[..., None, None] * S0 + torch.einsum("bih,bihk,bihv->bhkv", w, keys, vals)


class _Chunks:
    """Every chunk's state-independent parts, computed for all chunks and heads at once:
    contiguous (chunks, Hv, L, .) tensors, L the longest chunk, shorter chunks padded with inert
    places (k = q = v = 0, g = 0, beta = 0)."""

    def __init__(self, q, k, v, g, beta, plan: _Plan, dt):
        dev = q.device
        Hv, V = v.shape[1], v.shape[2]
        starts = torch.tensor(plan.starts, dtype=torch.long, device=dev)
        sizes = torch.tensor(plan.sizes, dtype=torch.long, device=dev)
        L = self.L = max(plan.sizes)
        at = torch.arange(L, device=dev)
        self.filled = at[None, :] < sizes[:, None]                       # (Nc, L)
        self.tokens = (starts[:, None] + at[None, :])[self.filled]       # token of each filled place
        Nc = len(plan.starts)

        def gather(x):  # (N, H, ...) -> (Nc, Hv, L, ...) in dt, value head h from head h // (Hv // H)
            H, rest = x.shape[1], tuple(x.shape[2:])
            out = torch.zeros((Nc, H, Hv // H, L) + rest, dtype=dt, device=dev)
            places = out.movedim(3, 1)                                   # (Nc, L, H, Hv // H, ...)
            places[self.filled] = x[self.tokens].to(dt).unsqueeze(2).expand(-1, -1, Hv // H, *rest)
            return out.view((Nc, Hv, L) + rest)

        qe, ke, vv = gather(q), gather(k), gather(v)
        gamma = torch.cumsum(gather(clamp_log_decay(g.to(dt))), dim=-1)  # (Nc, Hv, L), finite
        causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
        decay = _masked_weights(gamma[..., :, None], gamma[..., None, :], causal)  # exp(gamma_t - gamma_s), s <= t
        e_gamma = torch.exp(gamma)[..., None]
        kt = ke.transpose(-1, -2).contiguous()
        self.delta = beta is not None
        if self.delta:
            bb = gather(beta)[..., None]                                   # (Nc, Hv, L, 1)
            A = torch.matmul(ke, kt).mul_(decay).tril_(-1).mul_(bb)
            eye = torch.eye(L, dtype=dt, device=dev).expand_as(A)
            inv = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)  # (I + A)^-1
            self.u_hat = inv @ (bb * vv)
            self.w = inv @ (bb * e_gamma * ke)                             # U = u_hat - w S
        else:
            self.values = vv
        self.q_decayed = e_gamma * qe
        self.attn = decay.mul_(torch.matmul(qe, kt))                      # (Nc, Hv, L, L), s <= t
        g_last = gamma[..., -1:]                                          # padding adds no decay
        self.fold_keys = (torch.exp(g_last - gamma)[..., None] * ke).transpose(-1, -2).contiguous()  # (Nc,Hv,K,L)
        self.fold_decay = torch.exp(g_last)[..., None]                    # (Nc, Hv, 1, 1)
        self.V = V

    def carry(self, S, plan: _Plan):
        """Run the state through the chunks, step by step over all rows at once. Returns U
        (Nc, L, Hv, V) and each row's state at its fold point (rows that fold; others unset)."""
        Nc, L = self.q_decayed.shape[0], self.L
        U = self.u_hat if self.delta else self.values                   # updated in place to U
        self._qs = torch.empty(Nc, S.shape[1], L, S.shape[3], dtype=S.dtype, device=S.device)
        folded = torch.empty_like(S)
        first = 0
        for n, ends in zip(plan.per_step, plan.fold_ends):
            c = slice(first, first + n)
            Sj = S[:n]
            if self.delta:
                U[c] -= self.w[c] @ Sj
            torch.matmul(self.q_decayed[c], Sj, out=self._qs[c])
            S[:n] = torch.baddbmm((self.fold_decay[c] * Sj).flatten(0, 1), self.fold_keys[c].flatten(0, 1),
                                  U[c].flatten(0, 1)).view_as(Sj)
            if ends:
                at = torch.tensor(ends, dtype=torch.long, device=S.device)
                folded[at] = S[at]
            first += n
        self._u = U
        return U.transpose(1, 2), folded

    def outputs(self):
        """o per chunk place (Nc, L, Hv, V), after `carry`."""
        L, V = self.L, self.V
        out = self._qs.view(-1, L, V).baddbmm_(self.attn.view(-1, L, L), self._u.view(-1, L, V))
        return out.view(self._qs.shape).transpose(1, 2)


def _tail_entries(k, g, u_tok, cu_seqlens, buf_g, buffer_slots, lengths, plan: _Plan):
    """The buffer entries the rows keep unfolded: (slot, position, key, u, G) per entry, G the
    cumulative log decay since the state they follow (after the fold, or S0 continuing from G_f)."""
    if not any(plan.tails):
        return None
    dev, dt = u_tok.device, u_tok.dtype
    cu = cu_seqlens.tolist()
    T = max(plan.tails)
    tok, slot, pos = [], [], []
    for i, f, b, fold, tail in zip(plan.rows, plan.fills, plan.slots, plan.folds, plan.tails):
        first = 0 if fold else f
        tok.append(torch.arange(cu[i + 1] - tail, cu[i + 1] + T - tail, device=dev))
        slot += [b] * tail
        pos += range(first, first + tail)
    tok = torch.stack(tok)                                            # (R, T), past each tail: masked
    real = torch.arange(T, device=dev)[None, :] < torch.tensor(plan.tails, device=dev)[:, None]
    steps = torch.where(real[..., None], clamp_log_decay(g[tok.clamp(max=g.shape[0] - 1)].to(dt)),
                        torch.zeros((), dtype=dt, device=dev))
    rows = torch.tensor(plan.rows, dtype=torch.long, device=dev)
    start = _last_log_decay(buf_g[buffer_slots[rows].long()].to(dt), lengths[rows])   # G_f
    start = torch.where(torch.tensor(plan.folds, device=dev)[:, None], torch.zeros((), dtype=dt, device=dev), start)
    G = (start[:, None, :] + torch.cumsum(steps, dim=1))[real]
    t = tok[real]
    as_index = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
    return as_index(slot), as_index(pos), k[t], u_tok[t], G
