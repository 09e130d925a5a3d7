"""Generic TileLang templates for linear-attention decode: one family for Gated DeltaNet and Mamba-2.

KVBUFFER.md: both layers run S_t = exp(g_t) S_{t-1} + k_t u_t^T, o_t = S_t^T q_t. Two compile-time
choices select the layer:

* `delta` (the delta rule): u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t) (GDN), or u_t = v_t (Mamba-2).
* the gating front (`family`): "gdn" (l2norm q, k; q * K**-0.5; g = -exp(A_log) softplus(a + dt_bias);
  beta = sigmoid(b)) or "mamba2" (key B, query C per group; dt = softplus(dt + dt_bias); value dt * x;
  g = -exp(A_log) dt; output y = o + D x, optionally y * silu(z)). The front fixes the kernel's
  argument list; everything after it is shared.

Templates: `linear_recurrent` (the baseline: read + write the state), `linear_buffered` (T_new tokens
after the row's n buffered entries, one read of S0, no state write; T_new = 1 is the decode step, T_new
drafts the speculative verify, and with flush_at = C a row reaching C entries is folded into its state
in the same launch: a prefill chunk or the flushing decode step), `linear_flush`.

Grid: one block per (value tile of BV columns, value head, batch row); dynamic batch and pool sizes.
Value head h reads key head h // (Hv // Hk) (a Mamba-2 group is a key head).

Buffered kernel layout: the row's S0 tile (K x BV) is staged in shared memory, and every product with
it is ONE small tensor-core GEMM: X (M x K) . S0 with X = [q_1..q_T (; k_1..k_T)] padded to M = 16
rows, so verifying T drafts costs one S0 read like a step. The buffer's keys (and the new keys) form
Kb (cp x K); P = X Kb^T gives every k_i . q_t (and k_i . k_t) at once; the weighted history is a
third GEMM W . Db. Under the delta rule every product runs as 3xTF32 (hi/lo split; hi has the low 13
mantissa bits cleared, which the tensor cores ignore) so the deltas keep fp32 accuracy; decay-only
outputs use plain TF32 (~1e-3 relative, under bf16 output rounding). The fused flush is fp32 FMA.

Tensor ABI (contiguous; `in` = activation dtype, `bd` = buffer dtype):
    GDN      q, k (B, [T,] Hk, K) in; v (B, [T,] Hv, V) in; a, b (B, [T,] Hv) in; A_log, dt_bias (Hv,) fp32
    Mamba-2  x (B, [T,] Hv, V) in; dt (B, [T,] Hv) in; A_log, dt_bias (Hv,) fp32; Bm, Cm (B, [T,] Hk, K) in;
             D (Hv,) fp32; z (B, [T,] Hv, V) in (read only when built with has_z; else pass x)
    state (NS, Hv, K, V) fp32, state_slots (B,) int32 (-1: no state, reads as zero)
    buf_k (NB, cap, Hk, K) bd, buf_v (NB, cap, Hv, V) bd, buf_g (NB, cap, Hv) fp32
    buffer_slots, lengths (B,) int32 (-1: padding row, zero output, nothing written)
    out (o or y) (B, [T,] Hv, V) in
"""

# no `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations

import itertools
from types import SimpleNamespace

from ..reference.core import LOG_DECAY_FLOOR

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0
FAMILIES = ("gdn", "mamba2")
F32 = "float32"


def _tl():
    import tilelang.language as T  # noqa: N812  (TileLang's own convention)

    return T


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_shape(Hk: int, Hv: int, K: int, V: int, BV: int) -> None:
    if Hv % Hk:
        raise ValueError(f"Hv={Hv} must be a multiple of Hk={Hk}")
    if V % BV:
        raise ValueError(f"V={V} must be a multiple of BV={BV}")
    if K % 16 or V % 16:
        raise ValueError(f"K={K} and V={V} must be multiples of 16")


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


# ----------------------------------------------------------------------------------------------
# fronts: fill the shared token arrays of one (row, value head, value tile)
#   X (M, K): rows 0..Tn-1 the queries, rows Tn..2Tn-1 the keys (delta rule), zero beyond
#   kn (Tn, K) new keys, vn (Tn, BV) new values (GDN v; Mamba-2 dt * x), gl (Tn,) log decays, beta (Tn,)


def _softplus(T, x):
    return T.if_then_else(x > SOFTPLUS_THRESHOLD, x, T.log1p(T.exp(x)))


def _gdn_front(T, Tn, M, K, BV, key_rows: bool):
    q_scale = K ** -0.5

    @T.macro
    def front(q, k, v, a, b, A_log, dt_bias, bb, hk, hv, v0, s, f):
        # the value and gate loads first: they need nothing, so they overlap the key and query loads
        for t, j in T.Parallel(Tn, BV):
            s.vn[t, j] = T.cast(v[bb, t, hv, v0 + j], F32)
        for t in T.Parallel(Tn):
            s.gl[t] = -T.exp(A_log[hv]) * _softplus(T, T.cast(a[bb, t, hv], F32) + dt_bias[hv])
            s.beta[t] = 1.0 / (1.0 + T.exp(-T.cast(b[bb, t, hv], F32)))
        for t, i in T.Parallel(Tn, K):
            f.xq[t, i] = T.cast(q[bb, t, hk, i], F32)
            f.xk[t, i] = T.cast(k[bb, t, hk, i], F32)
        for t, i in T.Parallel(Tn, K):
            f.sq[t, i] = f.xq[t, i] * f.xq[t, i]
        T.reduce_sum(f.sq, f.nq, dim=1)
        for t, i in T.Parallel(Tn, K):
            f.sq[t, i] = f.xk[t, i] * f.xk[t, i]
        T.reduce_sum(f.sq, f.nk, dim=1)
        for t, i in T.Parallel(Tn, K):
            s.kn[t, i] = f.xk[t, i] * T.rsqrt(f.nk[t] + L2NORM_EPS)
            s.qn[t, i] = f.xq[t, i] * T.rsqrt(f.nq[t] + L2NORM_EPS) * q_scale
        # the GEMM rows from shared memory (a fragment is only read in its own layout)
        for rr, i in T.Parallel(M, K):
            s.X[rr, i] = T.if_then_else(
                rr < Tn, s.qn[T.min(rr, Tn - 1), i],
                T.if_then_else(rr < 2 * Tn, s.kn[T.min(T.max(rr - Tn, 0), Tn - 1), i], 0.0) if key_rows else 0.0)

    return front


def _mamba2_front(T, Tn, M, K, BV):
    @T.macro
    def front(x, dt, A_log, dt_bias, Bm, Cm, D, bb, hk, hv, v0, s):
        # the raw values and D first: they need nothing, so their loads overlap the gate's (the value
        # dt * x waits for the gate; the output reads x and D from shared memory, not from memory again)
        for t, j in T.Parallel(Tn, BV):
            s.xr[t, j] = T.cast(x[bb, t, hv, v0 + j], F32)
        for _ in T.Parallel(1):
            s.dd[0] = D[hv]
        for r, i in T.Parallel(M, K):
            s.X[r, i] = T.if_then_else(r < Tn, T.cast(Cm[bb, T.min(r, Tn - 1), hk, i], F32), 0.0)
        for t, i in T.Parallel(Tn, K):
            s.kn[t, i] = T.cast(Bm[bb, t, hk, i], F32)
        for t in T.Parallel(Tn):
            s.dtv[t] = _softplus(T, T.cast(dt[bb, t, hv], F32) + dt_bias[hv])
            s.gl[t] = -T.exp(A_log[hv]) * s.dtv[t]
        for t, j in T.Parallel(Tn, BV):
            s.vn[t, j] = s.dtv[t] * s.xr[t, j]

    return front


def _front_scratch(T, family: str, Tn: int, M: int, K: int, BV: int) -> SimpleNamespace:
    """The shared token arrays every front fills, plus the GDN front's l2norm scratch (fragments) and
    the Mamba-2 front's raw values x and D (its output reads them)."""
    s = SimpleNamespace(X=T.alloc_shared((M, K), F32), kn=T.alloc_shared((Tn, K), F32), qn=None,
                        vn=T.alloc_shared((Tn, BV), F32), gl=T.alloc_shared((Tn,), F32),
                        beta=T.alloc_shared((Tn,), F32), dtv=T.alloc_shared((Tn,), F32))
    f = None
    if family == "mamba2":
        s.xr, s.dd = T.alloc_shared((Tn, BV), F32), T.alloc_shared((1,), F32)
    if family == "gdn":
        s.qn = T.alloc_shared((Tn, K), F32)
        f = SimpleNamespace(xq=T.alloc_fragment((Tn, K), F32), xk=T.alloc_fragment((Tn, K), F32),
                            sq=T.alloc_fragment((Tn, K), F32), nq=T.alloc_fragment((Tn,), F32),
                            nk=T.alloc_fragment((Tn,), F32))
    return s, f


# ----------------------------------------------------------------------------------------------
# outputs: o (GDN) or y = o + D x (* silu(z)) (Mamba-2), from the shared rows Zs[0..Tn-1]


def _gdn_output(T, Tn, BV, in_dtype):
    @T.macro
    def output(o, bb, hv, v0, Zs, real):
        for t, j in T.Parallel(Tn, BV):
            o[bb, t, hv, v0 + j] = T.if_then_else(real, T.cast(Zs[t, j], in_dtype), T.cast(0.0, in_dtype))

    return output


def _mamba2_output(T, Tn, BV, in_dtype, has_z: bool):
    @T.macro
    def output(y, s, z, bb, hv, v0, Zs, real):
        for t, j in T.Parallel(Tn, BV):
            yv = Zs[t, j] + s.dd[0] * s.xr[t, j]
            if has_z:
                zv = T.cast(z[bb, t, hv, v0 + j], F32)
                yv = yv * zv / (1.0 + T.exp(-zv))
            y[bb, t, hv, v0 + j] = T.if_then_else(real, T.cast(yv, in_dtype), T.cast(0.0, in_dtype))

    return output


def _tf32_hi(T, x):
    """x with the 13 low mantissa bits cleared: exactly representable in TF32; x - hi is exact in fp32."""
    return T.reinterpret(T.bitwise_and(T.reinterpret(x, "uint32"), T.uint32(0xFFFFE000)), F32)


# ----------------------------------------------------------------------------------------------
# recurrent step (the baseline: read and write the whole state every token)


def recurrence(T, K: int, BV: int, delta: bool):
    """A TileLang macro, advance(S, s, t, out, P, red): token t of a front's arrays (s: kn, vn, gl,
    beta, X as _front_scratch fills them) applied to the K x BV state tile S in a fragment, S <- exp(g_t)
    S + k_t u_t^T (u_t: the delta rule's beta_t (v_t - exp(g_t) S^T k_t), or v_t), and out[t, :] = S^T
    q_t. P (K, BV) and red (BV,) are fragments for the products."""

    @T.macro
    def advance(S, s, t, out, P, red):
        decay = T.exp(s.gl[t])
        for i, j in T.Parallel(K, BV):
            S[i, j] = S[i, j] * decay
        if delta:
            for i, j in T.Parallel(K, BV):
                P[i, j] = S[i, j] * s.kn[t, i]
            T.reduce_sum(P, red, dim=0)
            for j in T.Parallel(BV):
                s.vn[t, j] = s.beta[t] * (s.vn[t, j] - red[j])
        for i, j in T.Parallel(K, BV):
            S[i, j] = S[i, j] + s.kn[t, i] * s.vn[t, j]
            P[i, j] = S[i, j] * s.X[t, i]
        T.reduce_sum(P, red, dim=0)
        for j in T.Parallel(BV):
            out[t, j] = red[j]

    return advance


# (BV, threads) of the recurrent step, best first, since `kvbuffer tune --max-configs N` tries the first N:
# the signature's default, then the measured winners at large, small and one-row batches (docs/results.md).
# The one-warp tiles (32 threads) keep every reduction over K inside a warp; BV 8
# gives 4x the default's blocks, for one row.
RECURRENT_FIRST = ((32, 128), (64, 64), (32, 32), (8, 32))


def get_recurrent_configs() -> list[dict]:
    """RECURRENT_FIRST, then every other (BV, threads) with 8 to 128 state values a thread (K = 128)."""
    rest = [(bv, th) for bv, th in itertools.product((8, 16, 32, 64), (32, 64, 128, 256))
            if 8 <= bv * 128 // th <= 128 and (bv, th) not in RECURRENT_FIRST]
    return [{"BV": bv, "threads": th} for bv, th in RECURRENT_FIRST + tuple(rest)]


def linear_recurrent(family: str, Hk: int, Hv: int, K: int = 128, V: int = 128, *, BV: int = 32,
                     threads: int = 128, in_dtype: str = "bfloat16", has_z: bool = False):
    """One decode step of the plain recurrence, updating state[state_slots] in place.

    The delta rule is on for GDN and off for Mamba-2 (selective_state_update semantics).
    Args: the family's activations, state, state_slots, out (module docstring; no token axis).
    """
    _check_family(family)
    check_shape(Hk, Hv, K, V, BV)
    T = _tl()
    B = T.dynamic("batch")
    NS = T.dynamic("num_state_slots")
    r = Hv // Hk
    delta = family == "gdn"

    @T.macro
    def load(state, slot, hv, v0, S):
        # issued before the front, so the state tile streams in while the token's inputs are loaded and
        # normalised (one memory round trip instead of two in a row; at small batch that is the step's
        # latency). A row without a state reads slot 0 and discards it; the copy is bounds-checked
        # against the dynamic pool size, so an empty pool reads nothing.
        T.copy(state[T.max(slot, 0), hv, :, v0:v0 + BV], S)

    advance = recurrence(T, K, BV, delta)

    @T.macro
    def step(state, slot, hv, v0, S, s, out):
        P = T.alloc_fragment((K, BV), F32)
        red = T.alloc_fragment((BV,), F32)
        if slot >= 0:
            advance(S, s, 0, out, P, red)
            T.copy(S, state[slot, hv, :, v0:v0 + BV])
        else:
            for j in T.Parallel(BV):
                out[0, j] = 0.0

    if family == "gdn":
        front = _gdn_front(T, 1, 1, K, BV, key_rows=False)
        output = _gdn_output(T, 1, BV, in_dtype)

        @T.prim_func
        def gdn_recurrent_step(
            q: T.Tensor((B, 1, Hk, K), in_dtype), k: T.Tensor((B, 1, Hk, K), in_dtype),
            v: T.Tensor((B, 1, Hv, V), in_dtype), a: T.Tensor((B, 1, Hv), in_dtype),
            b: T.Tensor((B, 1, Hv), in_dtype), A_log: T.Tensor((Hv,), F32), dt_bias: T.Tensor((Hv,), F32),
            state: T.Tensor((NS, Hv, K, V), F32), state_slots: T.Tensor((B,), "int32"),
            o: T.Tensor((B, 1, Hv, V), in_dtype),
        ):
            with T.Kernel(V // BV, Hv, B, threads=threads) as (bv, hv, bb):
                s, f = _front_scratch(T, family, 1, 1, K, BV)
                Zs = T.alloc_shared((1, BV), F32)
                S = T.alloc_fragment((K, BV), F32)
                slot = state_slots[bb]
                load(state, slot, hv, bv * BV, S)
                front(q, k, v, a, b, A_log, dt_bias, bb, hv // r, hv, bv * BV, s, f)
                step(state, slot, hv, bv * BV, S, s, Zs)
                output(o, bb, hv, bv * BV, Zs, slot >= 0)

        return gdn_recurrent_step

    front = _mamba2_front(T, 1, 1, K, BV)
    output = _mamba2_output(T, 1, BV, in_dtype, has_z)

    @T.prim_func
    def mamba2_recurrent_step(
        x: T.Tensor((B, 1, Hv, V), in_dtype), dt: T.Tensor((B, 1, Hv), in_dtype),
        A_log: T.Tensor((Hv,), F32), dt_bias: T.Tensor((Hv,), F32),
        Bm: T.Tensor((B, 1, Hk, K), in_dtype), Cm: T.Tensor((B, 1, Hk, K), in_dtype),
        D: T.Tensor((Hv,), F32), z: T.Tensor((B, 1, Hv, V), in_dtype),
        state: T.Tensor((NS, Hv, K, V), F32), state_slots: T.Tensor((B,), "int32"),
        y: T.Tensor((B, 1, Hv, V), in_dtype),
    ):
        with T.Kernel(V // BV, Hv, B, threads=threads) as (bv, hv, bb):
            s, _ = _front_scratch(T, family, 1, 1, K, BV)
            Zs = T.alloc_shared((1, BV), F32)
            S = T.alloc_fragment((K, BV), F32)
            slot = state_slots[bb]
            load(state, slot, hv, bv * BV, S)
            front(x, dt, A_log, dt_bias, Bm, Cm, D, bb, hv // r, hv, bv * BV, s)
            step(state, slot, hv, bv * BV, S, s, Zs)
            output(y, s, z, bb, hv, bv * BV, Zs, slot >= 0)

    return mamba2_recurrent_step


# ----------------------------------------------------------------------------------------------
# buffered step / speculative verify / prefill chunk (T_new = 1 is the decode step)


def get_buffered_configs() -> list[dict]:
    # the M=16 GEMMs split N over the warps: BV / warps >= 8
    return [{"BV": bv, "threads": th} for bv, th in itertools.product((32, 64, 128), (64, 128, 256))
            if bv // (th // 32) >= 8]


def linear_buffered(family: str, Hk: int, Hv: int, K: int = 128, V: int = 128, *, cap: int = 16,
                    T_new: int = 1, flush_at: int = 0, BV: int = 64, threads: int = 128,
                    in_dtype: str = "bfloat16", buf_dtype: str = "bfloat16", has_z: bool = False):
    """T_new tokens after each row's n buffered entries: one read of S0, no state write.

    Writes the T_new entries (k, u, G) at buffer positions n .. n+T_new-1 (lengths untouched; u is
    the delta under the delta rule, the value otherwise). With flush_at = C > 0, a row with
    n + T_new == C also folds its full buffer into its state in the same launch.
    """
    _check_family(family)
    check_shape(Hk, Hv, K, V, BV)
    if not 1 <= T_new <= cap:
        raise ValueError(f"T_new={T_new} must be in [1, cap={cap}]")
    if flush_at and not T_new <= flush_at <= cap:
        raise ValueError(f"flush_at={flush_at} must be in [T_new={T_new}, cap={cap}] (or 0)")
    warps = threads // 32
    if BV % (8 * warps):
        raise ValueError(f"BV={BV} must be a multiple of 8 * warps = {8 * warps} (threads={threads})")
    delta = family == "gdn"
    if delta and T_new > 8:
        raise ValueError(f"T_new={T_new}: the delta rule's query and key rows must fit 16 GEMM rows")
    T = _tl()
    B = T.dynamic("batch")
    NS = T.dynamic("num_state_slots")
    NB = T.dynamic("num_buffer_slots")
    r = Hv // Hk
    Tn, C = T_new, flush_at
    M = max(16, -(-(2 * Tn if delta else Tn) // 16) * 16)
    cp = max(pow2(cap), 8 * warps)  # on-chip capacity: power of two (layout inference), >= 8 per warp
    precise = delta  # 3xTF32 where the products feed the deltas (and through them the state)

    def row_token(rr):
        return T.if_then_else(rr < Tn, rr, rr - Tn)

    def row_real(rr):
        return rr < (2 * Tn if delta else Tn)

    @T.macro
    def split(A, A_lo, rows, cols):
        for i, j in T.Parallel(rows, cols):
            A_lo[i, j] = A[i, j] - _tf32_hi(T, A[i, j])
            A[i, j] = _tf32_hi(T, A[i, j])

    @T.macro
    def keep_lo(A, rows, cols):
        for i, j in T.Parallel(rows, cols):
            A[i, j] = A[i, j] - _tf32_hi(T, A[i, j])

    @T.macro
    def flush_rows(state, buf_k, sslot, bslot, hk, hv, v0, n, c):
        Sf = T.alloc_fragment((K, BV), F32)
        for i, j in T.Parallel(cp, K):
            c.Kb[i, j] = T.if_then_else(
                i < n, T.cast(buf_k[bslot, T.min(i, cap - 1), hk, j], F32),
                T.if_then_else(i < C, T.cast(T.cast(c.Kn[T.min(T.max(i - n, 0), Tn - 1), j], buf_dtype), F32), 0.0))
        for i, j in T.Parallel(cp, BV):
            if i >= n and i < C:
                c.Db[i, j] = T.cast(T.cast(c.U[T.min(T.max(i - n, 0), Tn - 1), j], buf_dtype), F32)
        for i in T.Parallel(cp):
            c.wv[i] = T.if_then_else(i < C, T.exp(c.Gs[Tn - 1] - c.Gb[i]), 0.0)
        T.copy(state[sslot, hv, :, v0:v0 + BV], Sf)
        for i, j in T.Parallel(K, BV):
            Sf[i, j] = Sf[i, j] * T.exp(c.Gs[Tn - 1])
        for e in T.serial(C):
            for i, j in T.Parallel(K, BV):
                Sf[i, j] = Sf[i, j] + c.wv[e] * c.Kb[e, i] * c.Db[e, j]
        T.copy(Sf, state[sslot, hv, :, v0:v0 + BV])

    @T.macro
    def core(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, bb, hv, v0, s, c):
        hk = hv // r
        sslot = state_slots[bb]
        bslot = buffer_slots[bb]
        n = lengths[bb]
        # cumulative log decays of the new tokens, each step's clamped (reference.core.clamp_log_decay)
        G_prev = T.if_then_else(n > 0, buf_g[bslot, T.max(n - 1, 0), hv], 0.0)
        for t in T.Parallel(Tn):
            c.Gs[t] = G_prev
        for u in T.serial(Tn):
            for t in T.Parallel(Tn):
                c.Gs[t] = c.Gs[t] + T.if_then_else(u <= t, T.max(s.gl[u], LOG_DECAY_FLOOR), 0.0)
        # the buffer (entries i < n, never past them) followed by the new keys (and values)
        for i, j in T.Parallel(cp, K):
            c.Kb[i, j] = T.if_then_else(
                i < n, T.cast(buf_k[bslot, T.min(i, cap - 1), hk, j], F32),
                T.if_then_else(i < n + Tn, s.kn[T.min(T.max(i - n, 0), Tn - 1), j], 0.0))
        for i, j in T.Parallel(cp, BV):
            c.Db[i, j] = T.if_then_else(
                i < n, T.cast(buf_v[bslot, T.min(i, cap - 1), hv, v0 + j], F32),
                0.0 if delta else T.if_then_else(i < n + Tn, s.vn[T.min(T.max(i - n, 0), Tn - 1), j], 0.0))
        for i in T.Parallel(cp):
            c.Gb[i] = T.if_then_else(i < n, buf_g[bslot, T.min(i, cap - 1), hv],
                                     T.if_then_else(i < n + Tn, c.Gs[T.min(T.max(i - n, 0), Tn - 1)], 0.0))
        # P = X Kb^T (every k_i . q_t, k_i . k_t) and Z = X S0: one pass over S0 for all rows
        if precise:
            split(s.X, c.X_lo, M, K)
        T.gemm(s.X, c.Kb, c.P, transpose_B=True, clear_accum=True)
        T.gemm(s.X, c.S0, c.Z, clear_accum=True)
        if precise:
            T.gemm(c.X_lo, c.Kb, c.P, transpose_B=True)
            T.gemm(c.X_lo, c.S0, c.Z)
            keep_lo(c.Kb, cp, K)
            keep_lo(c.S0, K, BV)
            T.gemm(s.X, c.Kb, c.P, transpose_B=True)
            T.gemm(s.X, c.S0, c.Z)
        T.copy(c.P, c.Ps)
        for rr in T.Parallel(M):
            c.Es[rr] = T.if_then_else(row_real(rr), T.exp(c.Gs[T.min(row_token(rr), Tn - 1)]), 0.0)
        for rr, j in T.Parallel(M, BV):
            c.Z[rr, j] = c.Z[rr, j] * c.Es[rr]
        # history weights exp(G_t - G_i) (k_i . x_r); decay-only rows also see the new entries i <= n + t
        for rr, i in T.Parallel(M, cp):
            c.W[rr, i] = T.if_then_else(
                row_real(rr) and i < n + (0 if delta else row_token(rr) + 1),
                T.exp(c.Gs[T.min(row_token(rr), Tn - 1)] - c.Gb[i]) * c.Ps[rr, i], 0.0)
        if precise:
            split(c.W, c.W_lo, M, cp)
        T.gemm(c.W, c.Db, c.Z)
        if precise:
            T.gemm(c.W_lo, c.Db, c.Z)
        T.copy(c.Z, c.Zs)
        if delta:
            # (I + A) U = R by forward substitution, then the outputs' new-token terms
            for t, u in T.Parallel(8, 8):  # padded to 8 x 8 (T <= 8): warp-uniform for every T
                c.Ac[t, u] = T.if_then_else(
                    u < t and t < Tn, s.beta[T.min(t, Tn - 1)] * T.exp(c.Gs[T.min(t, Tn - 1)] - c.Gs[T.min(u, Tn - 1)])
                    * c.Ps[T.min(Tn + t, M - 1), T.min(n + u, cp - 1)], 0.0)
                c.Bc[t, u] = T.if_then_else(
                    u <= t and t < Tn, T.exp(c.Gs[T.min(t, Tn - 1)] - c.Gs[T.min(u, Tn - 1)])
                    * c.Ps[T.min(t, M - 1), T.min(n + u, cp - 1)], 0.0)
            for j in T.Parallel(BV):
                for t in T.serial(Tn):
                    c.U[t, j] = s.beta[t] * (s.vn[t, j] - c.Zs[Tn + t, j])
                    for u in T.serial(t):
                        c.U[t, j] = c.U[t, j] - c.Ac[t, u] * c.U[u, j]
                for t in T.serial(Tn):
                    for u in T.serial(t + 1):
                        c.Zs[t, j] = c.Zs[t, j] + c.Bc[t, u] * c.U[u, j]
        else:
            for t, j in T.Parallel(Tn, BV):
                c.U[t, j] = s.vn[t, j]
        # append the new entries at n .. n+Tn-1 (lengths are the host's business)
        for t, j in T.Parallel(Tn, BV):
            buf_v[bslot, n + t, hv, v0 + j] = T.cast(c.U[t, j], buf_dtype)
        if v0 == 0:
            for t in T.Parallel(Tn):
                buf_g[bslot, n + t, hv] = c.Gs[t]
            if hv % r == 0:
                for t, j in T.Parallel(Tn, K):
                    buf_k[bslot, n + t, hk, j] = T.cast(s.kn[t, j], buf_dtype)
        # fused flush: S0 <- exp(G_C) S0 + sum_i exp(G_C - G_i) k_i u_i^T, entries as stored (fp32 FMA)
        if C > 0:
            if n + Tn == C and sslot >= 0:
                flush_rows(state, buf_k, sslot, bslot, hk, hv, v0, n, c)

    def scratch(s):
        c = SimpleNamespace(
            S0=T.alloc_shared((K, BV), F32), Kb=T.alloc_shared((cp, K), F32), Db=T.alloc_shared((cp, BV), F32),
            Gb=T.alloc_shared((cp,), F32), wv=T.alloc_shared((cp,), F32), Gs=T.alloc_shared((Tn,), F32), Es=T.alloc_shared((M,), F32),
            Ps=T.alloc_shared((M, cp), F32), W=T.alloc_shared((M, cp), F32), Zs=T.alloc_shared((M, BV), F32),
            U=T.alloc_shared((Tn, BV), F32), P=T.alloc_fragment((M, cp), F32), Z=T.alloc_fragment((M, BV), F32),
            Kn=s.kn)
        if delta:
            c.Ac, c.Bc = T.alloc_shared((8, 8), F32), T.alloc_shared((8, 8), F32)
        if precise:
            c.X_lo, c.W_lo = T.alloc_shared((M, K), F32), T.alloc_shared((M, cp), F32)
        return c

    @T.macro
    def load_state(state, state_slots, bb, hv, v0, c):
        # issued first: the S0 tile is the one large read
        if state_slots[bb] >= 0:
            T.copy(state[state_slots[bb], hv, :, v0:v0 + BV], c.S0)
        else:
            T.clear(c.S0)

    if family == "gdn":
        front = _gdn_front(T, Tn, M, K, BV, key_rows=True)
        output = _gdn_output(T, Tn, BV, in_dtype)

        @T.prim_func
        def gdn_buffered_step(
            q: T.Tensor((B, Tn, Hk, K), in_dtype), k: T.Tensor((B, Tn, Hk, K), in_dtype),
            v: T.Tensor((B, Tn, Hv, V), in_dtype), a: T.Tensor((B, Tn, Hv), in_dtype),
            b: T.Tensor((B, Tn, Hv), in_dtype), A_log: T.Tensor((Hv,), F32), dt_bias: T.Tensor((Hv,), F32),
            state: T.Tensor((NS, Hv, K, V), F32), state_slots: T.Tensor((B,), "int32"),
            buf_k: T.Tensor((NB, cap, Hk, K), buf_dtype), buf_v: T.Tensor((NB, cap, Hv, V), buf_dtype),
            buf_g: T.Tensor((NB, cap, Hv), F32), buffer_slots: T.Tensor((B,), "int32"),
            lengths: T.Tensor((B,), "int32"), o: T.Tensor((B, Tn, Hv, V), in_dtype),
        ):
            with T.Kernel(V // BV, Hv, B, threads=threads) as (bv, hv, bb):
                s, f = _front_scratch(T, family, Tn, M, K, BV)
                c = scratch(s)
                if buffer_slots[bb] >= 0:
                    load_state(state, state_slots, bb, hv, bv * BV, c)
                    front(q, k, v, a, b, A_log, dt_bias, bb, hv // r, hv, bv * BV, s, f)
                    core(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, bb, hv, bv * BV, s, c)
                    output(o, bb, hv, bv * BV, c.Zs, True)
                else:
                    output(o, bb, hv, bv * BV, c.Zs, False)

        return gdn_buffered_step

    front = _mamba2_front(T, Tn, M, K, BV)
    output = _mamba2_output(T, Tn, BV, in_dtype, has_z)

    @T.prim_func
    def mamba2_buffered_step(
        x: T.Tensor((B, Tn, Hv, V), in_dtype), dt: T.Tensor((B, Tn, Hv), in_dtype),
        A_log: T.Tensor((Hv,), F32), dt_bias: T.Tensor((Hv,), F32),
        Bm: T.Tensor((B, Tn, Hk, K), in_dtype), Cm: T.Tensor((B, Tn, Hk, K), in_dtype),
        D: T.Tensor((Hv,), F32), z: T.Tensor((B, Tn, Hv, V), in_dtype),
        state: T.Tensor((NS, Hv, K, V), F32), state_slots: T.Tensor((B,), "int32"),
        buf_k: T.Tensor((NB, cap, Hk, K), buf_dtype), buf_v: T.Tensor((NB, cap, Hv, V), buf_dtype),
        buf_g: T.Tensor((NB, cap, Hv), F32), buffer_slots: T.Tensor((B,), "int32"),
        lengths: T.Tensor((B,), "int32"), y: T.Tensor((B, Tn, Hv, V), in_dtype),
    ):
        with T.Kernel(V // BV, Hv, B, threads=threads) as (bv, hv, bb):
            s, _ = _front_scratch(T, family, Tn, M, K, BV)
            c = scratch(s)
            if buffer_slots[bb] >= 0:
                load_state(state, state_slots, bb, hv, bv * BV, c)
                front(x, dt, A_log, dt_bias, Bm, Cm, D, bb, hv // r, hv, bv * BV, s)
                core(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, bb, hv, bv * BV, s, c)
                output(y, s, z, bb, hv, bv * BV, c.Zs, True)
            else:
                output(y, s, z, bb, hv, bv * BV, c.Zs, False)

    return mamba2_buffered_step


# ----------------------------------------------------------------------------------------------
# stand-alone flush (no front: the same kernel serves both families)


def get_flush_configs() -> list[dict]:
    return [{"BV": bv, "threads": th} for bv, th in itertools.product((16, 32, 64), (64, 128, 256))
            if bv * 128 // th >= 8]


def linear_flush(Hk: int, Hv: int, K: int = 128, V: int = 128, *, cap: int = 16, BV: int = 32,
                 threads: int = 128, buf_dtype: str = "bfloat16"):
    """Fold each row's n buffered entries into its state: S0 <- exp(G_n) S0 + sum_i exp(G_n - G_i) k_i u_i^T.

    Rows with a padding buffer slot, an empty buffer or no state slot are left alone (the launcher
    rejects entries without a state). Args: state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths.
    """
    check_shape(Hk, Hv, K, V, BV)
    T = _tl()
    B = T.dynamic("batch")
    NS = T.dynamic("num_state_slots")
    NB = T.dynamic("num_buffer_slots")
    r = Hv // Hk
    cp = pow2(cap)

    @T.prim_func
    def flush_rows(
        state: T.Tensor((NS, Hv, K, V), F32),
        state_slots: T.Tensor((B,), "int32"),
        buf_k: T.Tensor((NB, cap, Hk, K), buf_dtype),
        buf_v: T.Tensor((NB, cap, Hv, V), buf_dtype),
        buf_g: T.Tensor((NB, cap, Hv), F32),
        buffer_slots: T.Tensor((B,), "int32"),
        lengths: T.Tensor((B,), "int32"),
    ):
        with T.Kernel(V // BV, Hv, B, threads=threads) as (bv, hv, bb):
            hk = hv // r
            v0 = bv * BV
            Kb = T.alloc_shared((cp, K), F32)
            Db = T.alloc_shared((cp, BV), F32)
            wb = T.alloc_shared((cp,), F32)
            S = T.alloc_fragment((K, BV), F32)
            sslot = state_slots[bb]
            bslot = buffer_slots[bb]
            n = lengths[bb]
            if bslot >= 0 and sslot >= 0 and n > 0:
                G_last = buf_g[bslot, n - 1, hv]
                for i, c in T.Parallel(cp, K):
                    Kb[i, c] = T.if_then_else(i < n, T.cast(buf_k[bslot, i, hk, c], F32), 0.0)
                for i, j in T.Parallel(cp, BV):
                    Db[i, j] = T.if_then_else(i < n, T.cast(buf_v[bslot, i, hv, v0 + j], F32), 0.0)
                for i in T.Parallel(cp):
                    wb[i] = T.if_then_else(i < n, T.exp(G_last - buf_g[bslot, i, hv]), 0.0)
                T.copy(state[sslot, hv, :, v0:v0 + BV], S)
                for i, j in T.Parallel(K, BV):
                    S[i, j] = S[i, j] * T.exp(G_last)
                for e in T.serial(n):
                    for i, j in T.Parallel(K, BV):
                        S[i, j] = S[i, j] + wb[e] * Kb[e, i] * Db[e, j]
                T.copy(S, state[sslot, hv, :, v0:v0 + BV])

    return flush_rows
