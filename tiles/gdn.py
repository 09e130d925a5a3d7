"""Qwen3.5 Gated DeltaNet decode templates (recurrent and flush from tiles.linear_decode, buffered below).

The GDN entry points under their established names. The recurrent step and the flush are the generic
family (linear_decode.py: delta rule on, GDN gating front). `gdn_buffered` is still the in-block-
reduction template below: the generic `linear_buffered("gdn", ...)` passes the same GPU tests
(H200, 2026-11-30: 155/156, the miss a fused-flush state at 1.12e-5 against 1e-5) but runs ~3.5x
slower on GDN shapes (3xTF32 GEMM path, ~73+ KB shared memory per block), so it replaces this one
only once it is faster (see docs/kernels.md). Tensor ABI: linear_decode's module docstring (GDN rows);
the recurrent step takes a token axis of 1.
"""

import itertools

from .linear_decode import _tl, check_shape as _check_shape, pow2 as _pow2  # noqa: F401
from .linear_decode import (  # noqa: F401  (the tunables lists are part of this module's API)
    L2NORM_EPS,
    SOFTPLUS_THRESHOLD,
    get_flush_configs,
    get_recurrent_configs,
    linear_buffered,
    linear_flush,
    linear_recurrent,
)


def gdn_recurrent(Hk: int, Hv: int, K: int = 128, V: int = 128, *, BV: int = 32, threads: int = 128,
                  in_dtype: str = "bfloat16"):
    """One decode step of the plain GDN recurrence, updating state[state_slots] in place.

    Args: q, k, v, a, b, A_log, dt_bias, state, state_slots, o.
    """
    return linear_recurrent("gdn", Hk, Hv, K, V, BV=BV, threads=threads, in_dtype=in_dtype)


def get_buffered_configs() -> list[dict]:
    """Tunables of `gdn_buffered` (BV * K / threads >= 16: smaller per-thread tiles fail layout inference)."""
    return [{"BV": bv, "threads": th} for bv, th in itertools.product((32, 64, 128), (64, 128, 256))
            if 16 <= bv * 128 // th <= 128]


def gdn_buffered(Hk: int, Hv: int, K: int = 128, V: int = 128, *, cap: int = 16, T_new: int = 1,
                 flush_at: int = 0, BV: int = 32, threads: int = 128, in_dtype: str = "bfloat16",
                 buf_dtype: str = "bfloat16"):
    """T_new tokens after each row's n buffered entries: one read of S0, no state write.

    Writes the T_new entries (k, delta, G) at buffer positions n .. n+T_new-1 (lengths untouched).
    The deltas of the new tokens are coupled by (I + A) Delta = R, solved by forward substitution.
    With flush_at = C > 0, a row with n + T_new == C also folds its full buffer into its state in
    the same launch (the flush fused into the step that fills the buffer; S0 is in registers).

    Args: q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
    lengths, o (module docstring; token axis T present).
    """
    _check_shape(Hk, Hv, K, V, BV)
    if not 1 <= T_new <= cap:
        raise ValueError(f"T_new={T_new} must be in [1, cap={cap}]")
    if flush_at and not T_new <= flush_at <= cap:
        raise ValueError(f"flush_at={flush_at} must be in [T_new={T_new}, cap={cap}] (or 0)")
    T = _tl()
    B = T.dynamic("batch")
    NS = T.dynamic("num_state_slots")
    NB = T.dynamic("num_buffer_slots")
    r = Hv // Hk
    f32 = "float32"
    q_scale = K ** -0.5
    Tn = T_new
    C = flush_at
    cp = _pow2(cap)  # on-chip capacity: TileLang's layout inference wants power-of-two extents

    @T.prim_func
    def gdn_buffered_step(
        q: T.Tensor((B, Tn, Hk, K), in_dtype),
        k: T.Tensor((B, Tn, Hk, K), in_dtype),
        v: T.Tensor((B, Tn, Hv, V), in_dtype),
        a: T.Tensor((B, Tn, Hv), in_dtype),
        b: T.Tensor((B, Tn, Hv), in_dtype),
        A_log: T.Tensor((Hv,), f32),
        dt_bias: T.Tensor((Hv,), f32),
        state: T.Tensor((NS, Hv, K, V), f32),
        state_slots: T.Tensor((B,), "int32"),
        buf_k: T.Tensor((NB, cap, Hk, K), buf_dtype),
        buf_v: T.Tensor((NB, cap, Hv, V), buf_dtype),
        buf_g: T.Tensor((NB, cap, Hv), f32),
        buffer_slots: T.Tensor((B,), "int32"),
        lengths: T.Tensor((B,), "int32"),
        o: T.Tensor((B, Tn, Hv, V), in_dtype),
    ):
        with T.Kernel(V // BV, Hv, B, threads=threads) as (bv, hv, bb):
            hk = hv // r
            v0 = bv * BV
            # new tokens, normalised, and their per-token scalars
            qs = T.alloc_shared((Tn, K), f32)
            ks = T.alloc_shared((Tn, K), f32)
            Gs = T.alloc_shared((Tn,), f32)        # cumulative log decay G_t since S0
            betas = T.alloc_shared((Tn,), f32)
            gl = T.alloc_shared((Tn,), f32)
            kk_new = T.alloc_shared((Tn, Tn), f32)  # k_s . k_t
            kq_new = T.alloc_shared((Tn, Tn), f32)  # k_s . q_t
            # the row's buffer (entries i < n) and the new entries (for a fused flush)
            Kb = T.alloc_shared((cp, K), f32)
            Db = T.alloc_shared((cp, BV), f32)
            Gb = T.alloc_shared((cp,), f32)
            wk = T.alloc_shared((Tn, cp), f32)    # exp(G_t - G_i) (k_i . k_t)
            wq = T.alloc_shared((Tn, cp), f32)    # exp(G_t - G_i) (k_i . q_t)
            s0k = T.alloc_shared((Tn, BV), f32)
            s0q = T.alloc_shared((Tn, BV), f32)
            hkb = T.alloc_shared((Tn, BV), f32)
            hqb = T.alloc_shared((Tn, BV), f32)
            dl = T.alloc_shared((Tn, BV), f32)     # deltas of the new tokens

            xf = T.alloc_fragment((Tn, K), f32)
            yf = T.alloc_fragment((Tn, K), f32)
            nx = T.alloc_fragment((Tn,), f32)
            ny = T.alloc_fragment((Tn,), f32)
            PK = T.alloc_fragment((cp, K), f32)
            red_c = T.alloc_fragment((cp,), f32)
            PT = T.alloc_fragment((Tn, K), f32)
            red_t = T.alloc_fragment((Tn,), f32)
            PD = T.alloc_fragment((cp, BV), f32)
            red_v = T.alloc_fragment((BV,), f32)
            S = T.alloc_fragment((K, BV), f32)
            P = T.alloc_fragment((K, BV), f32)

            sslot = state_slots[bb]
            bslot = buffer_slots[bb]
            n = lengths[bb]

            if bslot >= 0:
                # issue the S0 loads first: they stay in flight while the front and buffer work runs
                if sslot >= 0:
                    T.copy(state[sslot, hv, :, v0:v0 + BV], S)
                else:
                    T.clear(S)
                # ---- front: l2norm(q) * K**-0.5, l2norm(k), g, beta, G
                for t, i in T.Parallel(Tn, K):
                    xf[t, i] = T.cast(q[bb, t, hk, i], f32)
                    yf[t, i] = T.cast(k[bb, t, hk, i], f32)
                for t, i in T.Parallel(Tn, K):
                    PT[t, i] = xf[t, i] * xf[t, i]
                T.reduce_sum(PT, nx, dim=1)
                for t, i in T.Parallel(Tn, K):
                    PT[t, i] = yf[t, i] * yf[t, i]
                T.reduce_sum(PT, ny, dim=1)
                for t, i in T.Parallel(Tn, K):
                    qs[t, i] = xf[t, i] * T.rsqrt(nx[t] + L2NORM_EPS) * q_scale
                    ks[t, i] = yf[t, i] * T.rsqrt(ny[t] + L2NORM_EPS)
                for t in T.Parallel(Tn):
                    gl[t] = -T.exp(A_log[hv]) * T.if_then_else(
                        T.cast(a[bb, t, hv], f32) + dt_bias[hv] > SOFTPLUS_THRESHOLD,
                        T.cast(a[bb, t, hv], f32) + dt_bias[hv],
                        T.log1p(T.exp(T.cast(a[bb, t, hv], f32) + dt_bias[hv])))
                    betas[t] = 1.0 / (1.0 + T.exp(-T.cast(b[bb, t, hv], f32)))
                G_prev = T.if_then_else(n > 0, buf_g[bslot, T.max(n - 1, 0), hv], 0.0)
                for t in T.Parallel(Tn):
                    Gs[t] = G_prev
                for s in T.serial(Tn):
                    for t in T.Parallel(Tn):
                        Gs[t] = Gs[t] + T.if_then_else(s <= t, gl[s], 0.0)
                # dot products among the new tokens
                for s in T.serial(Tn):
                    for t, i in T.Parallel(Tn, K):
                        PT[t, i] = ks[s, i] * ks[t, i]
                    T.reduce_sum(PT, red_t, dim=1)
                    for t in T.Parallel(Tn):
                        kk_new[t, s] = red_t[t]
                    for t, i in T.Parallel(Tn, K):
                        PT[t, i] = ks[s, i] * qs[t, i]
                    T.reduce_sum(PT, red_t, dim=1)
                    for t in T.Parallel(Tn):
                        kq_new[t, s] = red_t[t]

                # ---- the buffer: entries i < n only (the rest is never read)
                for i, c in T.Parallel(cp, K):
                    Kb[i, c] = T.if_then_else(i < n, T.cast(buf_k[bslot, i, hk, c], f32), 0.0)
                for i, j in T.Parallel(cp, BV):
                    Db[i, j] = T.if_then_else(i < n, T.cast(buf_v[bslot, i, hv, v0 + j], f32), 0.0)
                for i in T.Parallel(cp):
                    Gb[i] = T.if_then_else(i < n, buf_g[bslot, i, hv], 0.0)
                for t in T.serial(Tn):
                    for i, c in T.Parallel(cp, K):
                        PK[i, c] = Kb[i, c] * ks[t, c]
                    T.reduce_sum(PK, red_c, dim=1)
                    for i in T.Parallel(cp):
                        wk[t, i] = T.if_then_else(i < n, T.exp(Gs[t] - Gb[i]) * red_c[i], 0.0)
                    for i, c in T.Parallel(cp, K):
                        PK[i, c] = Kb[i, c] * qs[t, c]
                    T.reduce_sum(PK, red_c, dim=1)
                    for i in T.Parallel(cp):
                        wq[t, i] = T.if_then_else(i < n, T.exp(Gs[t] - Gb[i]) * red_c[i], 0.0)
                    for i, j in T.Parallel(cp, BV):
                        PD[i, j] = wk[t, i] * Db[i, j]
                    T.reduce_sum(PD, red_v, dim=0)
                    for j in T.Parallel(BV):
                        hkb[t, j] = red_v[j]
                    for i, j in T.Parallel(cp, BV):
                        PD[i, j] = wq[t, i] * Db[i, j]
                    T.reduce_sum(PD, red_v, dim=0)
                    for j in T.Parallel(BV):
                        hqb[t, j] = red_v[j]

                # ---- S0: one read serves S0^T k and S0^T q of every new token
                for t in T.serial(Tn):
                    for i, j in T.Parallel(K, BV):
                        P[i, j] = S[i, j] * ks[t, i]
                    T.reduce_sum(P, red_v, dim=0)
                    for j in T.Parallel(BV):
                        s0k[t, j] = red_v[j]
                    for i, j in T.Parallel(K, BV):
                        P[i, j] = S[i, j] * qs[t, i]
                    T.reduce_sum(P, red_v, dim=0)
                    for j in T.Parallel(BV):
                        s0q[t, j] = red_v[j]

                # ---- deltas by forward substitution, then outputs
                for t in T.serial(Tn):
                    for j in T.Parallel(BV):
                        dl[t, j] = betas[t] * (T.cast(v[bb, t, hv, v0 + j], f32)
                                               - T.exp(Gs[t]) * s0k[t, j] - hkb[t, j])
                    for s in T.serial(t):
                        for j in T.Parallel(BV):
                            dl[t, j] = dl[t, j] - betas[t] * T.exp(Gs[t] - Gs[s]) * kk_new[t, s] * dl[s, j]
                for t in T.serial(Tn):
                    for j in T.Parallel(BV):
                        red_v[j] = T.exp(Gs[t]) * s0q[t, j] + hqb[t, j]
                    for s in T.serial(t + 1):
                        for j in T.Parallel(BV):
                            red_v[j] = red_v[j] + T.exp(Gs[t] - Gs[s]) * kq_new[t, s] * dl[s, j]
                    for j in T.Parallel(BV):
                        o[bb, t, hv, v0 + j] = T.cast(red_v[j], in_dtype)

                # ---- append the new entries at n .. n+Tn-1 (lengths are the host's business)
                for t, j in T.Parallel(Tn, BV):
                    buf_v[bslot, n + t, hv, v0 + j] = T.cast(dl[t, j], buf_dtype)
                if bv == 0:
                    for t in T.Parallel(Tn):
                        buf_g[bslot, n + t, hv] = Gs[t]
                    if hv % r == 0:
                        for t, c in T.Parallel(Tn, K):
                            buf_k[bslot, n + t, hk, c] = T.cast(ks[t, c], buf_dtype)

                # ---- fused flush: S0 <- exp(G_C) S0 + sum_i exp(G_C - G_i) k_i delta_i^T
                if C > 0:
                    if n + Tn == C and sslot >= 0:
                        # the new entries as stored (buffer dtype), like a flush that reads them back
                        for t, c in T.Parallel(Tn, K):
                            Kb[n + t, c] = T.cast(T.cast(ks[t, c], buf_dtype), f32)
                        for t, j in T.Parallel(Tn, BV):
                            Db[n + t, j] = T.cast(T.cast(dl[t, j], buf_dtype), f32)
                        for t in T.Parallel(Tn):
                            Gb[n + t] = Gs[t]
                        for i in T.Parallel(cp):
                            Gb[i] = T.if_then_else(i < C, T.exp(Gs[Tn - 1] - Gb[i]), 0.0)
                        for i, j in T.Parallel(K, BV):
                            S[i, j] = S[i, j] * T.exp(Gs[Tn - 1])
                        for e in T.serial(C):
                            for i, j in T.Parallel(K, BV):
                                S[i, j] = S[i, j] + Gb[e] * Kb[e, i] * Db[e, j]
                        T.copy(S, state[sslot, hv, :, v0:v0 + BV])
            else:
                for t, j in T.Parallel(Tn, BV):
                    o[bb, t, hv, v0 + j] = T.cast(0.0, in_dtype)

    return gdn_buffered_step


def gdn_flush(Hk: int, Hv: int, K: int = 128, V: int = 128, *, cap: int = 16, BV: int = 32,
              threads: int = 128, buf_dtype: str = "bfloat16"):
    """Fold each row's n buffered entries into its state (the family's shared flush)."""
    return linear_flush(Hk, Hv, K, V, cap=cap, BV=BV, threads=threads, buf_dtype=buf_dtype)
