"""Mamba-2 buffered decode as a thread-level (SIMT) template: `mamba2_buffered(..., variant="simt")`.

The decay-only sibling of tiles/gdn.py `gdn_buffered` (same layout, barriers and S0 streaming), with
the Mamba-2 front of tiles/linear_decode.py: key = B, value = dt * x, query = C, g = dt * A,
dt = softplus(dt + dt_bias) (no floor), y = o + D x (* silu(z)). No delta rule, so no key-key Gram
and no forward substitution: the new tokens' values are known before S0 is read, and a new token t
sees the buffer entries i < n and the new entries s <= t through one weight row W[t, e].

Same ABI as the generic template (linear_decode.py module docstring, Mamba-2 rows): x, dt, A_log,
dt_bias, Bm, Cm, D, z, state (NS, H, N, P) fp32 key-major, state_slots, buf_k, buf_v, buf_g,
buffer_slots, lengths, y. All arithmetic is fp32 FMA (gates and log decays in fp64); no tensor cores, no TF32.
"""

from ..reference.core import LOG_DECAY_FLOOR
from .linear_decode import SOFTPLUS_THRESHOLD, _tl, check_shape
from .simt_parts import exp_of_f64, flush_weight, row_stager, simt_layout, state_macros


# (BV, threads, blocks) for N = 128, P = 64, in the GDN template's order; blocks > 0 caps registers
# (__launch_bounds__ min blocks/SM) so more S0 bytes are in flight per SM, at the price of spills at
# T = 8; tune picks per kernel. SMALL_BATCH_CONFIGS: at small B a grid of (P / BV) x H x B blocks leaves
# SMs idle; BV 16 or 8 gives 4-8x the blocks, each thread holding 32 state values (same ABI as the rest).
SMALL_BATCH_CONFIGS = ((16, 64, 0), (16, 128, 0), (8, 64, 0))
SIMT_CONFIGS = ((64, 128, 0), (64, 64, 6), SMALL_BATCH_CONFIGS[0], (64, 64, 0), (32, 64, 10), (64, 128, 5),
                (32, 64, 0), (64, 256, 0), (32, 128, 0)) + SMALL_BATCH_CONFIGS[1:]
# (BV, threads per head, blocks, heads): several heads of a group per block (the keys and the Gram once).
# Two heads, three blocks: 128 threads like (64, 64, 6) (docs/results.md). Four heads is not offered until
# the GPU tests cover it.
GROUPED_CONFIGS = ((64, 64, 3, 2),)


def get_simt_configs(K: int = 128) -> list[dict]:
    """The grouped configs first, then one head per block (every config names its heads)."""
    out = []
    for bv, th, blocks, heads in GROUPED_CONFIGS + tuple(c + (1,) for c in SIMT_CONFIGS):
        try:
            simt_layout(K, bv, th)
        except ValueError:
            continue
        out.append({"variant": "simt", "BV": bv, "threads": th, "blocks": blocks, "heads": heads})
    return out


def mamba2_buffered_simt(G: int, H: int, N: int = 128, P: int = 64, *, cap: int = 16, T_new: int = 1,
                         flush_at: int = 0, BV: int = 64, threads: int = 128, blocks: int = 0,
                         heads: int = 1, in_dtype: str = "bfloat16", buf_dtype: str = "bfloat16", has_z: bool = False):
    """T_new Mamba-2 tokens after each row's n buffered entries: one read of S0, no state write.

    Writes the T_new entries (B, dt * x, G) at buffer positions n .. n+T_new-1 (lengths untouched).
    With flush_at = C > 0, a row with n + T_new == C also folds its full buffer into its state in the
    same launch (S0 is already in registers).

    One block per (value tile of BV columns, head, row); thread (rg, cg) owns rows rg*KR .. rg*KR+KR-1
    and columns 4cg .. 4cg+3 of the N x BV S0 tile. Shared rows X: C_t at 0..Tn-1, then the keys in
    buffer order at Tn + e (e < n: the buffer, e = n + s: the new B_s). Four block barriers (a fifth
    only in a step that flushes):
      0. x (and z) per value column and dt_t, g_t (fp64, thread t) before the slots are known; then the
         buffer's keys, values and G (entries i < n only), and the new keys; S0 is issued as float4
         loads into registers, first used in phase 3b.
      1. Gram C_t . k_e: lane = key row, warp = N slice (partials per warp); thread t: G_t (fp64).
      2. Scalars, one task per thread: W[t, e] = exp(G_t - G_e) (k_e . C_t) for e <= n + t, exp(G_t),
         the flush weights exp(G_C - G_e) (simt_parts.exp_of_f64: no fp64 transcendentals).
      3. (a) one thread per value column: sum_e W[t, e] v_e (buffer, then the new values dt_s x_s);
         the new keys and G are written. (b) every thread: S0^T C_t over its rows; row groups of a
         warp summed by shuffles, warps in shared memory.
      4. One thread per value column: y_t = exp(G_t) S0^T C_t + history + D x_t (* silu(z_t)); the new
         values are written.
    `heads` > 1: one block serves that many heads of one group, `threads` threads each. The heads of a
    group share B and C, so the block stages the keys and computes the Gram once for all of them;
    gates, values, history and S0 stay per head.
    """
    check_shape(G, H, N, P, BV)
    if not 1 <= T_new <= cap:
        raise ValueError(f"T_new={T_new} must be in [1, cap={cap}]")
    if flush_at and not T_new <= flush_at <= cap:
        raise ValueError(f"flush_at={flush_at} must be in [T_new={T_new}, cap={cap}] (or 0)")
    if heads < 1 or (H // G) % heads or (heads > 1 and threads % 32):
        raise ValueError(f"heads={heads} must divide the {H // G} heads of a group (and threads={threads} be whole "
                         "warps when > 1)")
    K, V = N, P
    CG, KG, KR, NW1 = simt_layout(K, BV, threads)  # one head's layout (NW1 warps)
    HB = heads
    NW = NW1 * HB            # the block's warps (the Gram's K slices)
    T = _tl()
    B = T.dynamic("batch")
    NS = T.dynamic("num_state_slots")
    NB = T.dynamic("num_buffer_slots")
    r = H // G
    f32, f64 = "float32", "float64"
    Tn = T_new
    C = flush_at
    load_state, s0_products, fused_flush = state_macros(T, KR=KR, CG=CG, C=C, tokens=Tn, queries=Tn,
                                                        key_row0=Tn)
    NT1 = threads
    NT = NT1 * HB
    stage = row_stager(T, NT)
    XR = Tn + cap            # X rows: C_t (0..Tn-1), keys in buffer order (Tn + e, e < n + Tn <= cap)
    KP = K + 4               # padded row: float4 reads of 32 different rows hit distinct banks
    KS = K // NW             # N slice of one warp in the Gram
    K8, BV8 = K // 8, BV // 8
    round_keys = in_dtype != buf_dtype  # the fused flush folds the new keys as stored
    ceil = lambda a, b: -(-a // b)  # noqa: E731
    IT_TOK, IT_BK, IT_BV, IT_G = ceil(Tn * K8, NT), ceil(cap * K8, NT), ceil(cap * BV8, NT), ceil(cap, NT1)
    IT_ROWS, IT_KN, IT_OUT = ceil(cap, 32), ceil(Tn * K, NT), ceil(Tn * BV, NT1)
    NA, NE = Tn * cap, Tn    # phase-2 tasks: W, exp(G_t), then C flush weights
    NTASK = NA + NE + C
    IT_TASK = ceil(NTASK, NT1)  # per head

    @T.prim_func
    def mamba2_buffered_simt_step(
        x: T.Tensor((B, Tn, H, V), in_dtype),
        dt: T.Tensor((B, Tn, H), in_dtype),
        A_log: T.Tensor((H,), f32),
        dt_bias: T.Tensor((H,), f32),
        Bm: T.Tensor((B, Tn, G, K), in_dtype),
        Cm: T.Tensor((B, Tn, G, K), in_dtype),
        D: T.Tensor((H,), f32),
        z: T.Tensor((B, Tn, H, V), in_dtype),
        state: T.Tensor((NS, H, K, V), f32),
        state_slots: T.Tensor((B,), "int32"),
        buf_k: T.Tensor((NB, cap, G, K), buf_dtype),
        buf_v: T.Tensor((NB, cap, H, V), buf_dtype),
        buf_g: T.Tensor((NB, cap, H), f32),
        buffer_slots: T.Tensor((B,), "int32"),
        lengths: T.Tensor((B,), "int32"),
        y: T.Tensor((B, Tn, H, V), in_dtype),
    ):
        with T.Kernel(V // BV, H // HB, B, threads=NT) as (bv, hb, bb):
            # the block barriers below are all there is (TileLang's inserted ones would sit in
            # thread-divergent branches)
            T.annotate_pass_configs({"tl.disable_thread_storage_sync": True})
            if blocks:
                T.annotate_min_blocks_per_sm(blocks)
            tx = T.get_thread_binding()
            X = T.alloc_shared((XR, KP), f32)
            # per head (rows j cap .. or j Tn .. for the block's head j): Db, Gb, FW, gld, dts, Gd, W, Es
            Db = T.alloc_shared((HB * cap, BV), f32)  # buffer values (and the new ones for a flush)
            Gb = T.alloc_shared((HB * cap,), f32)
            gld = T.alloc_shared((HB * Tn,), f64)     # g_t
            dts = T.alloc_shared((HB * Tn,), f64)     # dt_t
            Gd = T.alloc_shared((HB * Tn,), f64)      # G_t = G_{n-1} + g_0 + ... + g_t
            Pd = T.alloc_shared((NW, cap, Tn), f32)   # Gram partial sums per warp (shared by the heads)
            Ps = T.alloc_shared((NW, Tn, BV), f32)    # S0^T C_t partial sums per warp (a head's warps)
            W = T.alloc_shared((HB * Tn, cap), f32)   # exp(G_t - G_e) (k_e . C_t), e <= n + t
            Es = T.alloc_shared((HB * Tn,), f32)      # exp(G_t)
            FW = T.alloc_shared((HB * cap,), f32)     # flush weights exp(G_C - G_e)

            Sr = T.alloc_local((KR * 4,), f32)
            acc = T.alloc_local((Tn * 4,), f32)
            gacc = T.alloc_local((max(Tn, 2),), f32)
            dacc = T.alloc_local((4,), f64)
            xv = T.alloc_local((4,), f32)
            yv = T.alloc_local((4,), f32)
            tb = T.alloc_local((8,), in_dtype)
            bb8 = T.alloc_local((8,), buf_dtype)
            xr = T.alloc_local((Tn,), f32)
            zr = T.alloc_local((Tn,), f32)
            vn = T.alloc_local((Tn,), f32)
            hq = T.alloc_local((Tn,), f32)

            j = tx // NT1 if HB > 1 else 0   # this thread's head in the block
            t1 = tx % NT1 if HB > 1 else tx  # and its thread in that head's layout
            hv = hb * HB + j if HB > 1 else hb
            hk = hb * HB // r
            jt, jc = j * Tn, j * cap         # the head's first row in the per-head arrays
            v0 = bv * BV
            cg = t1 % CG
            rg = t1 // CG
            lane = tx % 32
            w = tx // 32
            sslot = state_slots[bb]
            bslot = buffer_slots[bb]
            n = lengths[bb]

            # ---- phase 0a: the row's own inputs need no slot: C_t (X rows 0..Tn-1), x and z of this
            # thread's value column, dt_t and g_t in fp64 (thread t)
            stage(X, 0, Cm, bb, Tn, hk, 0, K8, IT_TOK, tx, tb)
            if t1 < BV:
                for t in T.unroll(Tn):
                    xr[t] = T.cast(x[bb, t, hv, v0 + t1], f32)
                    if has_z:
                        zr[t] = T.cast(z[bb, t, hv, v0 + t1], f32)
            if t1 < Tn:
                dacc[0] = T.cast(dt[bb, t1, hv], f64) + T.cast(dt_bias[hv], f64)
                dacc[1] = T.if_then_else(dacc[0] > SOFTPLUS_THRESHOLD, dacc[0], T.log1p(T.exp(dacc[0])))
                dts[jt + t1] = dacc[1]
                gld[jt + t1] = T.max(-T.exp(T.cast(A_log[hv], f64)) * dacc[1], LOG_DECAY_FLOOR)  # clamp_log_decay

            if bslot >= 0:
                # ---- phase 0b: the buffer (entries i < n only; the rest is never read) and the new keys
                # behind it, then the S0 slice into registers (streams in while phases 1-3a run)
                stage(X, Tn, buf_k, bslot, n, hk, 0, K8, IT_BK, tx, bb8)
                stage(X, Tn + n, Bm, bb, Tn, hk, 0, K8, IT_TOK, tx, tb)
                if HB > 1:
                    for jj in T.unroll(HB):
                        stage(Db, jj * cap, buf_v, bslot, n, hb * HB + jj, v0, BV8, IT_BV, tx, bb8)
                else:
                    stage(Db, 0, buf_v, bslot, n, hv, v0, BV8, IT_BV, tx, bb8)
                for it in T.unroll(IT_G):
                    if it * NT1 + t1 < n:
                        Gb[jc + it * NT1 + t1] = buf_g[bslot, it * NT1 + t1, hv]
                load_state(Sr, state, sslot, hv, rg, cg, v0)
                T.sync_threads()

                # ---- phase 1: Gram partials C_t . k_e, lane = key row e, warp = N slice; thread t: G_t
                for rb in T.unroll(IT_ROWS):
                    if lane + 32 * rb < n + Tn:
                        for cc in T.unroll(Tn):
                            gacc[cc] = 0.0
                        for ch in T.unroll(KS // 4):
                            for e in T.vectorized(4):
                                xv[e] = X[Tn + lane + 32 * rb, w * KS + ch * 4 + e]
                            for cc in T.unroll(Tn):
                                for e in T.vectorized(4):
                                    yv[e] = X[cc, w * KS + ch * 4 + e]
                                for e in T.unroll(4):
                                    gacc[cc] = gacc[cc] + xv[e] * yv[e]
                        for cc in T.unroll(Tn):
                            Pd[w, lane + 32 * rb, cc] = gacc[cc]
                if t1 < Tn:
                    dacc[2] = T.if_then_else(n > 0, T.cast(Gb[jc + T.max(n - 1, 0)], f64), T.cast(0.0, f64))
                    for s in T.unroll(Tn):
                        if s <= t1:
                            dacc[2] = dacc[2] + gld[jt + s]
                    Gd[jt + t1] = dacc[2]
                T.sync_threads()

                # ---- phase 2: scalars, one task per thread; decays exp(G_t - G_e) in fp64 arithmetic without
                # fp64 transcendentals (simt_parts.exp_of_f64)
                for it in T.unroll(IT_TASK):
                    idx = it * NT1 + t1
                    if idx < NA:
                        te = idx % cap
                        tt = idx // cap
                        if te <= n + tt:
                            gacc[0] = 0.0
                            for ww in T.unroll(NW):
                                gacc[0] = gacc[0] + Pd[ww, te, tt]
                            W[jt + tt, te] = exp_of_f64(T, Gd[jt + tt] - T.if_then_else(
                                te < n, T.cast(Gb[jc + T.min(te, cap - 1)], f64),
                                Gd[jt + T.max(T.min(te - n, Tn - 1), 0)])) * gacc[0]
                    elif idx < NA + NE:
                        Es[jt + idx - NA] = exp_of_f64(T, Gd[jt + idx - NA])
                    elif idx < NTASK:
                        te = idx - NA - NE
                        if n + Tn == C:
                            FW[jc + te] = flush_weight(T, Gd, Gb, te, n, Tn, cap, jt, jc)
                T.sync_threads()

                # ---- phase 3a: one thread per value column: the history over the buffer and new entries
                if t1 < BV:
                    for t in T.unroll(Tn):
                        vn[t] = T.cast(T.cast(dts[jt + t], f64) * T.cast(xr[t], f64), f32)
                        hq[t] = 0.0
                    for i in T.serial(n):
                        for t in T.unroll(Tn):
                            hq[t] = hq[t] + W[jt + t, i] * Db[jc + i, t1]
                    for t in T.unroll(Tn):
                        for s in T.unroll(Tn):
                            if s <= t:
                                hq[t] = hq[t] + W[jt + t, n + s] * vn[s]
                # the new entries' keys and G (lengths are the host's business)
                if bv == 0:
                    if t1 < Tn:
                        buf_g[bslot, n + t1, hv] = T.cast(Gd[jt + t1], f32)
                    if hb * HB % r == 0:  # the group's keys, once: by the block of its first head
                        for it in T.unroll(IT_KN):
                            idx = it * NT + tx
                            if idx < Tn * K:
                                buf_k[bslot, n + idx // K, hk, idx % K] = T.cast(X[Tn + n + idx // K, idx % K],
                                                                                 buf_dtype)
                if C > 0 and round_keys:
                    if n + Tn == C and sslot >= 0:  # the new keys as stored, for the fused flush
                        for it in T.unroll(IT_KN):
                            idx = it * NT + tx
                            if idx < Tn * K:
                                X[Tn + n + idx // K, idx % K] = T.cast(
                                    T.cast(X[Tn + n + idx // K, idx % K], buf_dtype), f32)
                # ---- phase 3b: S0^T C_t over this thread's rows
                s0_products(acc, Sr, X, xv, Ps, rg, cg, w, lane)

                # ---- phase 4: one thread per value column: outputs and the new values
                if t1 < BV:
                    for t in T.unroll(Tn):
                        acc[t] = 0.0
                        for ww in T.unroll(NW1):  # this head's warps
                            acc[t] = acc[t] + Ps[j * NW1 + ww, t, t1]
                        acc[t] = Es[jt + t] * acc[t] + hq[t] + D[hv] * xr[t]
                        if has_z:
                            acc[t] = acc[t] * zr[t] / (1.0 + T.exp(-zr[t]))
                        y[bb, t, hv, v0 + t1] = T.cast(acc[t], in_dtype)
                        buf_v[bslot, n + t, hv, v0 + t1] = T.cast(vn[t], buf_dtype)
                        if C > 0:
                            Db[jc + n + t, t1] = T.cast(T.cast(vn[t], buf_dtype), f32)

                # ---- fused flush: S0 <- exp(G_C) S0 + sum_e exp(G_C - G_e) k_e v_e^T (entries as stored)
                if C > 0:
                    if n + Tn == C and sslot >= 0:
                        fused_flush(Sr, X, xv, yv, Db, FW, Gd, gacc, state, sslot, hv, rg, cg, v0, jc, jt)
            else:
                for it in T.unroll(IT_OUT):
                    idx = it * NT1 + t1
                    if idx < Tn * BV:
                        y[bb, idx // BV, hv, v0 + idx % BV] = T.cast(0.0, in_dtype)

    return mamba2_buffered_simt_step
