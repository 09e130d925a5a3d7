"""Exact reference semantics of KVBuffer for the generic gated linear-attention recurrence.

One recurrence serves both model families (see KVBUFFER.md):

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,    o_t = S_t^T q_t

with u_t = delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t) under the delta rule (Gated DeltaNet),
and u_t = v_t without it (Mamba-2: key B, value dt*x, query C, g = dt*A). `beta=None` selects the
decay-only form. States are (K x V) per value head, key-major, for both families.

Tensor conventions shared with the compiled kernels (the ABI of the public ops):

    state      (num_state_slots, Hv, K, V)          fp32 (fp64 for exactness tests)
    buf_k      (num_buffer_slots, cap, Hk, K)       keys of buffered tokens
    buf_v      (num_buffer_slots, cap, Hv, V)       their deltas (GDN) or values (Mamba-2)
    buf_g      (num_buffer_slots, cap, Hv)          cumulative log decay G_i since the state
    q, k       (B, [T,] Hk, K)   v (B, [T,] Hv, V)   g, beta (B, [T,] Hv)
    state_slots, buffer_slots, lengths   (B,) int   one row per request in the batch

Slot -1 is the null slot. A row whose buffer slot is -1 is padding: its outputs are zero and
nothing is written for it. A row whose state slot is -1 has no state yet (a short context):
S0 reads as zero. Value head h reads key head h // (Hv // Hk) (repeat_interleave grouping).

`lengths` holds each row's current buffer fill n. The ops never change it: a server advances
lengths once per forward, after every layer has run (see kvbuffer.pools.BufferPool).

Everything is computed in the state's dtype; buffer entries are stored in the buffer's dtype and
read back from it, exactly as a kernel would. Weights are always exp(G_t - G_i) <= 1, formed as
a difference of cumulative log decays, never as a ratio of exponentials. Each step's log decay
enters G clamped at LOG_DECAY_FLOOR (see `clamp_log_decay`), so G stays finite at any gate.
"""

from __future__ import annotations

import torch

from ..checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_capacity,
    check_disjoint,
    check_slots,
    check_tensor,
    check_unique,
)
from ..errors import ShapeError, SlotError

__all__ = ["recurrent_step", "recurrent_drafts", "verify", "buffered_step", "flush", "prefill", "LOG_DECAY_FLOOR", "clamp_log_decay"]

LOG_DECAY_FLOOR = -128.0


def clamp_log_decay(g: torch.Tensor) -> torch.Tensor:
    """max(g, LOG_DECAY_FLOOR): the log decay a step adds to the cumulative G of the buffered form.

    Why: an extreme gate (an input of +inf, or 3e38 on consecutive steps) gives g = -inf, or
    cumulative sums that overflow fp32 to -inf, and then exp(G_t - G_i) = exp(-inf + inf) = NaN,
    while the recurrent step just multiplies its state by exp(g) = 0. Every template clamps at the
    same floor, so the entries they write (G) equal this reference's.

    Why it changes nothing else, for gates g <= 0 (both families' fronts give g <= 0):
    * The weights stay <= 1: clamping only raises a g that is below the floor, and the floor is
      negative, so every clamped g' = max(g, F) satisfies F <= g' <= 0. Hence for i <= t,
      G_t - G_i = g'_{i+1} + ... + g'_t lies in [(t - i) F, 0], and exp(G_t - G_i) <= 1.
    * G stays finite: a buffer holds at most cap entries since its state, so |G| <= cap |F|
      (2,048 at cap 16; finite in fp32 for any cap below 1e36).
    * A weight whose span contains a clamped step is as zero as the recurrence's exp(g): its
      exponent is <= F + a few ulp(|G|) (under 2^-6 for |G| <= 2^15 in fp32) < -127, and
      exp(x) rounds to exactly 0 in fp32 for x < -103.98 (the smallest subnormal is e^-103.28),
      and flushes to 0 even sooner under FTZ; the recurrent step's exp(g) with g < F is 0 too. In
      fp64 such a weight is at most e^-127 ~ 7e-56 instead of 0, far below any tolerance.
    * A gate at or above the floor passes bit-exactly (max is exact), so every output and entry
      of a run whose gates stay above F is unchanged; no sane gate is that low (a decay of e^-128
      per token erases the state in one step).
    After a clamped step, a difference of two G's carries the rounding of G's larger magnitude
    (ulp 2^-16 at |G| = 128, 2^-12 at 2,048 in fp32): a relative error of that size in a weight.
    """
    return g.clamp(min=LOG_DECAY_FLOOR)


# ----------------------------------------------------------------------------------------------
# validation


def _check_tokens(q, k, v, g, beta, state, *, with_time: bool):
    """Check token inputs against the state pool; return (B, T, Hk, Hv, K, V)."""
    check_tensor("state", state, (None, None, None, None), (torch.float32, torch.float64))
    _, Hv, K, V = state.shape
    dev = state.device
    lead = 2 if with_time else 1
    check_tensor("q", q, [None] * lead + [None, K], FLOAT_DTYPES, dev)
    B = q.shape[0]
    T = q.shape[1] if with_time else 1
    Hk = q.shape[lead]
    if with_time and T == 0:
        raise ShapeError(f"q must hold at least one token per row: got shape {tuple(q.shape)} (T = 0)")
    head = [B, T] if with_time else [B]
    check_tensor("k", k, head + [Hk, K], FLOAT_DTYPES, dev)
    check_tensor("v", v, head + [Hv, V], FLOAT_DTYPES, dev)
    check_tensor("g", g, head + [Hv], FLOAT_DTYPES, dev)
    if beta is not None:
        check_tensor("beta", beta, head + [Hv], FLOAT_DTYPES, dev)
    if Hk == 0 or Hv % Hk:
        raise ShapeError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    check_disjoint({"state": state})
    return B, T, Hk, Hv, K, V


def _check_buffer(buf_k, buf_v, buf_g, state, Hk, Hv, K, V):
    """Check the buffer pool tensors; return (num_buffer_slots, capacity)."""
    dev = state.device
    check_tensor("buf_k", buf_k, (None, None, Hk, K), FLOAT_DTYPES, dev)
    n_slots, cap = buf_k.shape[:2]
    check_tensor("buf_v", buf_v, (n_slots, cap, Hv, V), (buf_k.dtype,), dev)
    check_tensor("buf_g", buf_g, (n_slots, cap, Hv), (torch.float32, torch.float64), dev)
    check_disjoint({"state": state, "buf_k": buf_k, "buf_v": buf_v, "buf_g": buf_g})
    return n_slots, cap


def check_shapes(q, k, v, g, beta, state, buffers=None, *, with_time: bool) -> None:
    """The metadata-only part of the checks (shapes, dtypes, devices, pool aliasing): what a fake
    (meta) implementation can check, since slot values and fills cannot be read there."""
    _, _, Hk, Hv, K, V = _check_tokens(q, k, v, g, beta, state, with_time=with_time)
    if buffers is not None:
        _check_buffer(*buffers, state, Hk, Hv, K, V)


def check_flush_shapes(state, buf_k, buf_v, buf_g) -> int:
    """flush's metadata-only checks (see check_shapes); returns the number of buffer slots."""
    check_tensor("state", state, (None, None, None, None), (torch.float32, torch.float64))
    _, Hv, K, V = state.shape
    check_tensor("buf_k", buf_k, (None, None, None, K), FLOAT_DTYPES, state.device)
    return _check_buffer(buf_k, buf_v, buf_g, state, buf_k.shape[2], Hv, K, V)


def _check_rows(state, state_slots, buffer_slots, lengths, B, n_buffer_slots):
    dev = state.device
    check_slots("state_slots", state_slots, B, state.shape[0], dev)
    check_slots("buffer_slots", buffer_slots, B, n_buffer_slots, dev)
    check_tensor("lengths", lengths, (B,), INDEX_DTYPES, dev)
    check_unique("state_slots", state_slots)
    check_unique("buffer_slots", buffer_slots)


# ----------------------------------------------------------------------------------------------
# helpers


def _by_value_head(x: torch.Tensor, Hv: int) -> torch.Tensor:
    """(..., Hk, K) -> (..., Hv, K): value head h reads key head h // (Hv // Hk)."""
    Hk = x.shape[-2]
    return x if Hk == Hv else x.repeat_interleave(Hv // Hk, dim=-2)


def _read_states(state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Gather S0 per row; the null slot reads as a zero state."""
    s = state[slots.clamp(min=0).long()]
    return torch.where((slots >= 0).view(-1, 1, 1, 1), s, torch.zeros((), dtype=s.dtype, device=s.device))


def _read_buffer(buf_k, buf_v, buf_g, buffer_slots, lengths, Hv, dtype):
    """Gather each row's buffer as (B, cap, Hv, K), (B, cap, Hv, V), (B, cap, Hv) and its mask."""
    rows = buffer_slots.clamp(min=0).long()
    cap = buf_k.shape[1]
    filled = torch.arange(cap, device=buf_k.device)[None, :] < lengths.long()[:, None]
    filled = filled & (buffer_slots >= 0)[:, None]
    zero = torch.zeros((), dtype=dtype, device=buf_k.device)
    # positions past the fill may hold anything (stale drafts, NaN): zero them, since 0 * NaN = NaN
    keys = torch.where(filled[:, :, None, None], _by_value_head(buf_k[rows].to(dtype), Hv), zero)
    vals = torch.where(filled[:, :, None, None], buf_v[rows].to(dtype), zero)
    logd = torch.where(filled[:, :, None], buf_g[rows].to(dtype), zero)
    return keys, vals, logd, filled


def _last_log_decay(logd: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """G_n of each row's newest entry, 0 when its buffer is empty: (B, Hv)."""
    n = lengths.long()
    last = logd[torch.arange(logd.shape[0], device=logd.device), (n - 1).clamp(min=0)]
    return torch.where((n > 0)[:, None], last, torch.zeros((), dtype=logd.dtype, device=logd.device))


def _masked_weights(G_new: torch.Tensor, G_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(G_new - G_old) where mask holds, exactly 0 elsewhere (mask the exponent, not the product)."""
    diff = (G_new - G_old).masked_fill(~mask, float("-inf"))
    return torch.exp(diff)


# ----------------------------------------------------------------------------------------------
# the baseline: today's servers read and write the whole state every token


def recurrent_step(q, k, v, g, beta, state, state_slots):
    """One decode step of the plain recurrence, updating `state[state_slots]` in place.

    Row b uses state slot state_slots[b]; slot -1 marks a padding row (zero output, no write).
    The order of operations follows transformers' torch_recurrent_gated_delta_rule.
    """
    B, _, Hk, Hv, K, V = _check_tokens(q, k, v, g, beta, state, with_time=False)
    check_slots("state_slots", state_slots, B, state.shape[0], state.device)
    check_unique("state_slots", state_slots)
    dt = state.dtype
    S = _read_states(state, state_slots)
    qe, ke = _by_value_head(q.to(dt), Hv), _by_value_head(k.to(dt), Hv)
    S = S * torch.exp(g.to(dt))[..., None, None]
    if beta is None:
        u = v.to(dt)
    else:
        u = beta.to(dt)[..., None] * (v.to(dt) - torch.einsum("bhkv,bhk->bhv", S, ke))
    S = S + ke[..., :, None] * u[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", S, qe)
    real = state_slots >= 0
    state[state_slots[real].long()] = S[real]
    return torch.where(real[:, None, None], o, torch.zeros((), dtype=dt, device=o.device)).to(v.dtype)


def check_draft_states(draft_states, draft_rows, state, B: int, T: int, *, values: bool = True) -> None:
    """The per-token state pool of a recurrent verify: (rows, >= T, Hv, K, V) in the state's dtype, apart
    from `state`, and draft_rows (B,); with `values` (not in a fake: it reads the rows) one distinct
    draft row per batch row, within the pool (-1: padding)."""
    check_tensor("draft_states", draft_states, (None, None) + tuple(state.shape[1:]), (state.dtype,), state.device)
    if draft_states.shape[1] < T:
        raise ShapeError(f"draft_states holds {draft_states.shape[1]} tokens per row; this verify writes {T}")
    check_disjoint({"state": state, "draft_states": draft_states})
    check_tensor("draft_rows", draft_rows, (B,), INDEX_DTYPES, state.device)
    if values:
        check_slots("draft_rows", draft_rows, B, draft_states.shape[0], state.device)
        check_unique("draft_rows", draft_rows)


def recurrent_drafts(q, k, v, g, beta, state, state_slots, draft_states, draft_rows):
    """Today's servers' speculative verify: T tokens per row (inputs (B, T, ...)) through the plain
    recurrence, the state after token t stored in draft_states[draft_rows[b], t] so that any accepted
    prefix has its state; `state` is only read (the caller copies the accepted one back). A row whose
    draft row is -1 is padding (zero output, nothing written); a row whose state slot is -1 starts from
    S0 = 0. Returns o (B, T, Hv, V): token by token, recurrent_step's arithmetic."""
    B, T, *_ = _check_tokens(q, k, v, g, beta, state, with_time=True)
    check_slots("state_slots", state_slots, B, state.shape[0], state.device)
    check_draft_states(draft_states, draft_rows, state, B, T)
    scratch = _read_states(state, state_slots)  # the rows' states as a pool of B slots, row b in slot b
    real = draft_rows >= 0
    rows = torch.where(real, torch.arange(B, dtype=draft_rows.dtype, device=draft_rows.device), draft_rows)
    outs = []
    for t in range(T):
        outs.append(recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], None if beta is None else beta[:, t],
                                   scratch, rows))
        draft_states[draft_rows[real].long(), t] = scratch[real]
    return torch.stack(outs, 1)


# ----------------------------------------------------------------------------------------------
# the buffered form


def verify(q, k, v, g, beta, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at=0):
    """Outputs of T new tokens after each row's n buffered entries, in one pass; no state is written.

    The T tokens' entries (k_j, u_j, G_j) are written to buffer positions n .. n+T-1 but `lengths`
    is not advanced: accepting m of them is `lengths += m` (BufferPool.accept), rejecting is nothing.
    Under the delta rule the T deltas are coupled by the unit lower-triangular system
    (I + A) U = R (KVBUFFER.md), solved by forward substitution. With T = 1 this is the decode step;
    with T = a prompt chunk it is chunked prefill. Returns o of shape (B, T, Hv, V).

    With flush_at = C > 0 (a prompt chunk, or the step that fills the buffer) no row may pass C, and
    a row whose buffer reaches exactly C with these tokens has it folded into its state in the same
    call (the fused flush); the caller then empties those rows (see `rows_flushed`).
    """
    B, T, Hk, Hv, K, V = _check_tokens(q, k, v, g, beta, state, with_time=True)
    n_slots, cap = _check_buffer(buf_k, buf_v, buf_g, state, Hk, Hv, K, V)
    _check_rows(state, state_slots, buffer_slots, lengths, B, n_slots)
    valid = buffer_slots >= 0
    check_capacity(lengths, valid, T, cap)
    if flush_at:
        _check_fold(flush_at, cap, buffer_slots, state_slots, lengths, T)

    dt = state.dtype
    S0 = _read_states(state, state_slots)
    keys, vals, logd, filled = _read_buffer(buf_k, buf_v, buf_g, buffer_slots, lengths, Hv, dt)
    qe, ke = _by_value_head(q.to(dt), Hv), _by_value_head(k.to(dt), Hv)  # (B, T, Hv, K)
    vv, gg = v.to(dt), clamp_log_decay(g.to(dt))

    G = _last_log_decay(logd, lengths)[:, None, :] + torch.cumsum(gg, dim=1)  # (B, T, Hv), finite
    decay0 = torch.exp(G)[..., None]  # weight of S0 for each new token
    # one read of S0 serves both S0^T k and S0^T q
    s0k = torch.einsum("bhkv,bthk->bthv", S0, ke)
    s0q = torch.einsum("bhkv,bthk->bthv", S0, qe)
    # buffered entries i < n: w_ji = exp(G_j - G_i)
    w_buf = _masked_weights(G[:, :, None, :], logd[:, None, :, :], filled[:, None, :, None])  # (B,T,cap,Hv)
    hist_k = torch.einsum("btih,bihk,bthk,bihv->bthv", w_buf, keys, ke, vals)
    hist_q = torch.einsum("btih,bihk,bthk,bihv->bthv", w_buf, keys, qe, vals)
    # among the new tokens: w_jj' = exp(G_j - G_j') for j' <= j
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    w_new = _masked_weights(G[:, :, None, :], G[:, None, :, :], causal[None, :, :, None])  # (B,T,T,Hv)
    kk_new = torch.einsum("bthk,bshk->btsh", ke, ke)
    kq_new = torch.einsum("bshk,bthk->btsh", ke, qe)

    if beta is None:
        u = vv
    else:
        bb = beta.to(dt)[..., None]
        resid = bb * (vv - decay0 * s0k - hist_k)
        strict = w_new * kk_new * (~torch.eye(T, dtype=torch.bool, device=q.device))[None, :, :, None]
        rows = []
        for j in range(T):  # forward substitution, T is small
            acc = resid[:, j]
            if j:
                acc = acc - bb[:, j] * torch.einsum("bsh,bshv->bhv", strict[:, j, :j], torch.stack(rows, 1))
            rows.append(acc)
        u = torch.stack(rows, dim=1)

    o = decay0 * s0q + hist_q + torch.einsum("btsh,bshv->bthv", w_new * kq_new, u)
    o = torch.where(valid[:, None, None, None], o, torch.zeros((), dtype=dt, device=o.device))

    if bool(valid.any()):
        slot_rows = buffer_slots[valid].long()[:, None]
        pos = lengths[valid].long()[:, None] + torch.arange(T, device=q.device)[None, :]
        buf_k[slot_rows, pos] = k[valid].to(buf_k.dtype)
        buf_v[slot_rows, pos] = u[valid].to(buf_v.dtype)
        buf_g[slot_rows, pos] = G[valid].to(buf_g.dtype)
    if flush_at:
        full = rows_flushed(buffer_slots, lengths, flush_at, T)
        if bool(full.any()):
            keep = torch.where(full, buffer_slots, torch.full_like(buffer_slots, -1))
            flush(state, state_slots, buf_k, buf_v, buf_g, keep, lengths + T)
    return o.to(v.dtype)


def _check_fold(flush_at, cap, buffer_slots, state_slots, lengths, T):
    if flush_at > cap:
        raise ShapeError(f"flush_at={flush_at} exceeds the buffer capacity {cap}")
    if flush_at < T:
        raise ShapeError(f"flush_at={flush_at} is below the {T} tokens of this call: flush_at must be in [T, cap] (or 0)")
    valid = buffer_slots >= 0
    if bool((valid & (lengths + T > flush_at)).any()):
        raise ShapeError(f"a row would pass flush_at={flush_at} with {T} new token(s): flush it first")
    if bool((rows_flushed(buffer_slots, lengths, flush_at, T) & (state_slots < 0)).any()):
        raise SlotError("a row fills its buffer in this call but has no state slot: allocate a state first")


def flush(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths):
    """Fold each row's n buffered entries into its state: S0 <- exp(G_n) S0 + sum_i exp(G_n - G_i) k_i u_i^T.

    A rank-n update. Rows with an empty buffer or a padding buffer slot are left alone. A row with
    entries but the null state slot is an error: the caller allocates (zeroed) state first. The
    caller then resets those rows' lengths to 0 (BufferPool.reset).
    """
    n_slots, cap = check_flush_shapes(state, buf_k, buf_v, buf_g)
    B = buffer_slots.shape[0] if isinstance(buffer_slots, torch.Tensor) and buffer_slots.dim() else -1
    _check_rows(state, state_slots, buffer_slots, lengths, B, n_slots)
    check_capacity(lengths, buffer_slots >= 0, 0, cap)
    active = (buffer_slots >= 0) & (lengths > 0)
    if bool((active & (state_slots < 0)).any()):
        raise SlotError("flush of a row with buffered entries but no state slot: allocate a state first")
    if not bool(active.any()):
        return
    dt, Hv = state.dtype, state.shape[1]
    keys, vals, logd, filled = _read_buffer(buf_k, buf_v, buf_g, buffer_slots, lengths, Hv, dt)
    G_last = _last_log_decay(logd, lengths)  # (B, Hv)
    w = _masked_weights(G_last[:, None, :], logd, filled[..., None])  # (B, cap, Hv)
    S0 = _read_states(state, state_slots)
    S = torch.exp(G_last)[..., None, None] * S0 + torch.einsum("bih,bihk,bihv->bhkv", w, keys, vals)
    state[state_slots[active].long()] = S[active]


def buffered_step(q, k, v, g, beta, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at=0):
    """One buffered decode step: reads S0 and the buffer, appends one entry, writes no state.

    With `flush_at` = C > 0, a row whose buffer reaches C entries with this token also has its
    buffer folded into its state in the same call (the flush fused into the step that fills the
    buffer); the caller resets those rows' lengths (see `rows_flushed`). Returns o (B, Hv, V).
    """
    lead = (q, k, v, g) + ((beta,) if beta is not None else ())
    for name, t in zip(("q", "k", "v", "g", "beta"), lead):
        check_tensor(name, t)
    unsq = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731
    return verify(unsq(q), unsq(k), unsq(v), unsq(g), unsq(beta), state, state_slots,
                  buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at)[:, 0]


def rows_flushed(buffer_slots: torch.Tensor, lengths: torch.Tensor, flush_at: int, T: int = 1) -> torch.Tensor:
    """Which rows a call of T tokens with `flush_at` folds into their state (their buffer is then empty)."""
    return (buffer_slots >= 0) & (lengths + T == flush_at)


def prefill(q, k, v, g, beta, state, state_slot, buf_k, buf_v, buf_g, buffer_slot, length, flush_at):
    """Chunked prefill of one request's T prompt tokens (q: (T, Hk, K), ...) into (state, buffer).

    The prompt is cut into chunks that fill the buffer up to `flush_at`; each full buffer is
    folded into the state. Returns (o of shape (T, Hv, V), new buffer length). If the prompt never
    fills the buffer, no state is touched and `state_slot` may be -1 (the short-context case).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ShapeError(f"prefill takes one request: q must be (T, Hk, K), got {getattr(q, 'shape', q)}")
    if not 0 < flush_at <= buf_k.shape[1]:
        raise ShapeError(f"flush_at must be in [1, {buf_k.shape[1]}], got {flush_at}")
    if not 0 <= length < flush_at:
        raise ShapeError(f"length must be in [0, flush_at={flush_at}), got {length}")
    if length + q.shape[0] >= flush_at and state_slot < 0:
        raise SlotError(f"a prompt of {q.shape[0]} tokens after {length} buffered ones fills the buffer "
                        f"(flush_at={flush_at}); allocate a state slot first")
    dev = state.device
    as_row = lambda s: torch.tensor([s], dtype=torch.int32, device=dev)  # noqa: E731
    s_slot, b_slot = as_row(state_slot), as_row(buffer_slot)
    outs, start, T = [], 0, q.shape[0]
    while start < T:
        take = min(flush_at - length, T - start)
        part = lambda t: None if t is None else t[start:start + take].unsqueeze(0)  # noqa: E731
        outs.append(verify(part(q), part(k), part(v), part(g), part(beta), state, s_slot,
                           buf_k, buf_v, buf_g, b_slot, as_row(length), flush_at)[0])
        length = (length + take) % flush_at  # a chunk that reached flush_at was folded into the state
        start += take
    o = torch.cat(outs, 0) if outs else v.new_zeros((0,) + tuple(v.shape[1:]))
    return o, length
