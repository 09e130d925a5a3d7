"""Qwen3.5 Gated DeltaNet decode templates (recurrent and flush from tiles.linear_decode, buffered below).

The GDN entry points under their established names. The recurrent step and the flush are the generic
family (linear_decode.py: delta rule on, GDN gating front). `gdn_buffered` (buffered step, speculative
verify, prefill chunk) is GDN's own thread-level template: no T.reduce_sum, four block barriers, S0
streamed into registers while the front, the Gram and the buffer's history run (see its docstring).
Tensor ABI: linear_decode's module docstring (GDN rows); the recurrent step takes a token axis of 1.
"""

from ..reference.core import LOG_DECAY_FLOOR
from .linear_decode import _tl, check_shape as _check_shape, pow2 as _pow2  # noqa: F401
from .recurrent_drafts import linear_recurrent_drafts
from .simt_parts import (exp_of_f64, fitted_tunables, flush_weight, mma_layout, mma_products, query_products,
                          row_stager, simt_layout, state_macros)
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


def gdn_recurrent_drafts(Hk: int, Hv: int, K: int = 128, V: int = 128, *, T_new: int, BV: int = 32,
                         threads: int = 128, in_dtype: str = "bfloat16"):
    """The servers' verify of T_new fed tokens on the GDN recurrence, one state per token (the baseline;
    tiles/recurrent_drafts.py).

    Args: q, k, v, a, b, A_log, dt_bias, state, state_slots, draft_states, draft_rows, o.
    """
    return linear_recurrent_drafts("gdn", Hk, Hv, K, V, T_new=T_new, BV=BV, threads=threads, in_dtype=in_dtype)


# (BV, threads, blocks): blocks > 0 caps registers so that many blocks share an SM (0: the compiler's
# choice); best first (docs/kernels.md), since `kvbuffer tune --max-configs N` tries the first N.
# SMALL_BATCH_CONFIGS: the grid is (V / BV) x Hv x B blocks, too few for a GPU's SMs at small B with
# BV 128; BV 16 or 8 gives 8-16x the blocks and a thread holds 32 values of S0, not 128. Same kernel ABI;
# one sits early in the list so short tuning runs (--max-configs) see it too.
SMALL_BATCH_CONFIGS = ((16, 64, 0), (16, 128, 0), (8, 64, 0))
_BUFFERED_CONFIGS = ((128, 128, 0), (128, 128, 3), SMALL_BATCH_CONFIGS[0], (64, 64, 0), (64, 128, 0),
                     (64, 128, 5), (128, 256, 0), (32, 64, 0), (32, 64, 10), (32, 128, 0), (64, 256, 0),
                     (32, 256, 0)) + SMALL_BATCH_CONFIGS[1:]


# the untuned default: the Qwen3.5 shapes' winner (docs/results.md)
BUFFERED_BEST = {"BV": 128, "threads": 128, "blocks": 3}


# Tokens per row at which an untuned kernel runs the S0 products on tensor cores (the 8-token prefill
# chunk, a verify of 7 drafts; the MMA takes at most 8 tokens); below it an untuned verify runs `lean`.
# Why these defaults: docs/results.md.
TENSOR_CORE_TOKENS = 8


def default_buffered_tunables(K: int = 128, V: int = 128, T: int = 1, group: int = 1) -> dict:
    """The tunables an untuned (JIT) buffered kernel of T tokens per row gets: BUFFERED_BEST where the
    head dims allow, with its S0 products on tensor cores at T = TENSOR_CORE_TOKENS and `lean` below
    it (T >= 2). `group` (value heads per key head) is unused: a GDN block serves one head."""
    best = fitted_tunables(K, V, BUFFERED_BEST)
    if best != BUFFERED_BEST or T == 1:
        return best
    return best | ({"tensor_cores": 1} if T == TENSOR_CORE_TOKENS else {"lean": 1})


# (BV, blocks) of the tensor-core layout (threads = BV, a warp per 32 columns; tiles.simt_parts.mma_layout):
# the S0 products of a verify run as TF32 MMAs instead of T x 2 x 128 FMAs per thread
TENSOR_CORE_CONFIGS = ((128, 3), (128, 0), (64, 6), (64, 4), (64, 0), (32, 0))


def get_buffered_configs() -> list[dict]:
    """Tunables of `gdn_buffered` (K = 128): a thread holds K * BV / threads state values (16..128); and the
    tensor-core layout's (`tensor_cores`)."""
    out = []
    for bv, th, blocks in _BUFFERED_CONFIGS:
        try:
            simt_layout(128, bv, th)
        except ValueError:
            continue
        out.append({"BV": bv, "threads": th, **({"blocks": blocks} if blocks else {})})
    tc = [{"BV": bv, "threads": bv, **({"blocks": blocks} if blocks else {}), "tensor_cores": 1}
          for bv, blocks in TENSOR_CORE_CONFIGS]
    lean = [BUFFERED_BEST | {"lean": 1}]
    # the first tensor-core config fourth (after the small-batch one), so `kvbuffer tune --max-configs 4`
    # times it for a verify, and the lean BUFFERED_BEST fifth (the registry offers neither to the step:
    # tensor cores never won there, and lean needs two tokens or more)
    return out[:3] + tc[:1] + lean + out[3:] + tc[1:]


def gdn_buffered(Hk: int, Hv: int, K: int = 128, V: int = 128, *, cap: int = 16, T_new: int = 1,
                 flush_at: int = 0, BV: int = 64, threads: int = 128, blocks: int = 0, tensor_cores: int = 0,
                 lean: int = 0, in_dtype: str = "bfloat16", buf_dtype: str = "bfloat16"):
    """T_new tokens after each row's n buffered entries: one read of S0, no state write.

    Writes the T_new entries (k, delta, G) at buffer positions n .. n+T_new-1 (lengths untouched); the
    new tokens' deltas solve (I + A) Delta = R by forward substitution. With flush_at = C > 0, a row with
    n + T_new == C also folds its full buffer into its state in the same launch. `blocks` > 0 caps the
    registers per thread; `tensor_cores` = 1 runs the S0 products as TF32 MMAs (T_new <= 8, threads ==
    BV); `lean` = 1 keeps fewer values live beside S0 (CUDA cores, T_new >= 2).

    Args: q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
    lengths, o (module docstring; token axis T present).
    """
    # One block per (value tile of BV columns, value head, row); thread (rg, cg) owns rows rg*KR ..
    # rg*KR+KR-1 and columns 4cg .. 4cg+3 of the K x BV S0 tile. Four block barriers (a fifth where it flushes):
    #   0. q, k, v, a, b load before the slots are known; g_t, beta_t in fp64; the buffer goes to shared
    #      memory and S0 is issued as float4 loads into registers, first used in 3b (1-3a run meanwhile).
    #   1. Gram: lane = one of [new k, new q, buffer keys], warp = a K slice; G_t = G_{n-1} + g_0 + .. + g_t.
    #   2. Scalars, one task per thread: norms, decay weights, the T x T system, the flush weights.
    #   3. (a) per value column: the buffer's history sums; the new keys and G are written. (b) S0^T k and
    #      S0^T q of the raw k, q (scaled by the phase-2 scalars), summed by shuffles and shared memory.
    #   4. Per value column: forward substitution, outputs, the new deltas.
    # `lean` runs the 2 T products of 3b in two halves and parks v and the history sums in shared memory:
    # under the register cap a verify otherwise spills.
    _check_shape(Hk, Hv, K, V, BV)
    if not 1 <= T_new <= cap:
        raise ValueError(f"T_new={T_new} must be in [1, cap={cap}]")
    if flush_at and not T_new <= flush_at <= cap:
        raise ValueError(f"flush_at={flush_at} must be in [T_new={T_new}, cap={cap}] (or 0)")
    if tensor_cores and 2 * T_new > 16:
        raise ValueError(f"tensor_cores: the S0 products take at most 16 query rows (T_new <= 8), got T_new={T_new}")
    if lean not in (0, 1) or (lean and (tensor_cores or T_new < 2)):
        raise ValueError(f"lean={lean} must be 0, or 1 for a CUDA-core kernel of T_new >= 2 tokens")
    CG, KG, KR, NW = (mma_layout if tensor_cores else simt_layout)(K, BV, threads)
    T = _tl()
    B = T.dynamic("batch")
    NS = T.dynamic("num_state_slots")
    NB = T.dynamic("num_buffer_slots")
    r = Hv // Hk
    f32, f64 = "float32", "float64"
    q_scale = K ** -0.5
    Tn = T_new
    C = flush_at
    NT = threads
    T2 = 2 * Tn
    stage = row_stager(T, NT)
    load_state, s0_products, fused_flush = state_macros(T, KR=KR, CG=CG, C=C, tokens=Tn, queries=T2,
                                                        key_row0=T2)
    tc_products = mma_products(T, KR=KR, queries=T2, split_x=in_dtype == "float32") if tensor_cores else None
    half = Tn if lean else 2 * Tn  # query rows of phase 3b's first pass (the k's, then the q's)
    first_products = query_products(T, KR=KR, CG=CG, queries=half, barrier=not lean)
    second_products = query_products(T, KR=KR, CG=CG, queries=2 * Tn - half, query0=half)
    PW = 1 if tensor_cores else NW  # partial sums of S0^T [k, q] per column (one per warp on CUDA cores)
    XR = T2 + cap            # X rows: new k (0..Tn-1), new q (Tn..2Tn-1), buffer keys (2Tn + i)
    NR = Tn + cap            # rows of the Gram (2Tn + n <= Tn + cap)
    KP = K + 4               # padded row: float4 reads of 32 different rows hit distinct banks
    KS = K // NW             # K slice of one warp in the Gram
    K8, BV8 = K // 8, BV // 8
    ceil = lambda a, b: -(-a // b)  # noqa: E731
    IT_TOK, IT_BK, IT_BV, IT_G = ceil(Tn * K8, NT), ceil(cap * K8, NT), ceil(cap * BV8, NT), ceil(cap, NT)
    IT_ROWS, IT_KN, IT_OUT = ceil(NR, 32), ceil(Tn * K, NT), ceil(Tn * BV, NT)
    # scalar tasks (phase 2): W (2 Tn cap), the Tn x Tn system, per-token scales, flush weights
    NA, NBt, NC = 2 * Tn * cap, Tn * Tn, Tn
    NTASK = NA + NBt + NC + C
    IT_TASK = -(-NTASK // NT)

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
        with T.Kernel(V // BV, Hv, B, threads=NT) as (bv, hv, bb):
            # the block barriers below are all there is (TileLang's inserted ones would sit in
            # thread-divergent branches)
            T.annotate_pass_configs({"tl.disable_thread_storage_sync": True})
            if blocks:  # cap registers so `blocks` blocks fit on an SM (more S0 bytes in flight per SM)
                T.annotate_min_blocks_per_sm(blocks)
            tx = T.get_thread_binding()
            X = T.alloc_shared((XR, KP), f32)
            Db = T.alloc_shared((cap, BV), f32)      # buffer deltas (and the new ones for a flush)
            Gb = T.alloc_shared((cap,), f32)
            gld = T.alloc_shared((Tn,), f64)         # g_t
            Gd = T.alloc_shared((Tn,), f64)          # G_t = G_{n-1} + g_0 + ... + g_t
            betas = T.alloc_shared((Tn,), f32)
            Pd = T.alloc_shared((NW, NR, T2), f32)   # Gram partial sums per warp
            Ps = T.alloc_shared((PW, T2, BV + (1 if tensor_cores else 0)), f32)  # S0^T [k, q] (per-warp partials)
            W = T.alloc_shared((2, Tn, cap), f32)    # exp(G_t - G_i) (k_i . k^_t), (k_i . q^_t)
            Am = T.alloc_shared((Tn, Tn), f32)       # beta_t exp(G_t - G_s) (k^_s . k^_t), s < t
            Bm = T.alloc_shared((Tn, Tn), f32)       # exp(G_t - G_s) (k^_s . q^_t), s <= t
            ck = T.alloc_shared((Tn,), f32)          # exp(G_t) / |k_t|
            cq = T.alloc_shared((Tn,), f32)          # exp(G_t) K**-0.5 / |q_t|
            rks = T.alloc_shared((Tn,), f32)         # 1 / |k_t|
            FW = T.alloc_shared((cap,), f32)         # flush weights exp(G_C - G_e)
            # lean: v_t, then the history sums (k's, q's) per value column, parked for phase 4
            Hs = T.alloc_shared((3 * Tn, BV), f32) if lean else None

            Sr = T.alloc_local((KR * 4,), f32)
            acc = T.alloc_local((16 if tensor_cores else T2 * 4,), f32)
            fa = T.alloc_local((8,), f32)            # tensor cores: A and B fragments, TF32 bit masks
            fb = T.alloc_local((8,), f32)
            bits = T.alloc_local((8,), "uint32")
            gacc = T.alloc_local((max(T2, 4),), f32)
            dacc = T.alloc_local((2,), f64)
            task = T.alloc_local((1,), "int32")       # phase 2: history-weight task // n
            xv = T.alloc_local((4,), f32)
            yv = T.alloc_local((4,), f32)
            tb = T.alloc_local((8,), in_dtype)
            bb8 = T.alloc_local((8,), buf_dtype)
            vr = T.alloc_local((Tn,), f32)
            hk_ = T.alloc_local((Tn,), f32)
            hq_ = T.alloc_local((Tn,), f32)
            dl = T.alloc_local((Tn,), f32)

            hk = hv // r
            v0 = bv * BV
            lane = tx % 32
            w = tx // 32
            cg = w * 8 + lane // 4 if tensor_cores else tx % CG  # this thread's S0: columns 4 cg .. 4 cg + 3,
            rg = lane % 4 if tensor_cores else tx // CG          # rows rg KR .. rg KR + KR - 1
            sslot = state_slots[bb]
            bslot = buffer_slots[bb]
            n = lengths[bb]

            # ---- phase 0a: the row's own inputs need no slot (their loads overlap the slots' round trip):
            # raw k (X rows 0..Tn-1), raw q (rows Tn..2Tn-1), v, and g_t, beta_t in fp64 (thread t)
            stage(X, 0, k, bb, Tn, hk, 0, K8, IT_TOK, tx, tb)
            stage(X, Tn, q, bb, Tn, hk, 0, K8, IT_TOK, tx, tb)
            if tx < BV:
                for t in T.unroll(Tn):
                    if lean:
                        Hs[t, tx] = T.cast(v[bb, t, hv, v0 + tx], f32)
                    else:
                        vr[t] = T.cast(v[bb, t, hv, v0 + tx], f32)
            if tx < Tn:
                dacc[0] = T.cast(a[bb, tx, hv], f64) + T.cast(dt_bias[hv], f64)
                # clamped as in reference.core.clamp_log_decay: G stays finite at any gate
                gld[tx] = T.max(-T.exp(T.cast(A_log[hv], f64)) * T.if_then_else(
                    dacc[0] > SOFTPLUS_THRESHOLD, dacc[0], T.log1p(T.exp(dacc[0]))), LOG_DECAY_FLOOR)
                betas[tx] = T.cast(1.0 / (1.0 + T.exp(-T.cast(b[bb, tx, hv], f64))), f32)

            if bslot >= 0:
                # ---- phase 0b: the buffer (entries i < n only; the rest is never read), then the S0 slice
                # into registers (it streams in while phases 1-3a run; first used in phase 3b)
                stage(X, T2, buf_k, bslot, n, hk, 0, K8, IT_BK, tx, bb8)
                stage(Db, 0, buf_v, bslot, n, hv, v0, BV8, IT_BV, tx, bb8)
                for it in T.unroll(IT_G):
                    if it * NT + tx < n:
                        Gb[it * NT + tx] = buf_g[bslot, it * NT + tx, hv]
                load_state(Sr, state, sslot, hv, rg, cg, v0)
                T.sync_threads()

                # ---- phase 1: Gram partials, lane = row of X, warp = K slice; thread t: G_t (fp64)
                for rb in T.unroll(IT_ROWS):
                    if lane + 32 * rb < T2 + n:
                        for cc in T.unroll(T2):
                            gacc[cc] = 0.0
                        for ch in T.unroll(KS // 4):
                            for e in T.vectorized(4):
                                xv[e] = X[lane + 32 * rb, w * KS + ch * 4 + e]
                            for cc in T.unroll(T2):
                                for e in T.vectorized(4):
                                    yv[e] = X[cc, w * KS + ch * 4 + e]
                                for e in T.unroll(4):
                                    gacc[cc] = gacc[cc] + xv[e] * yv[e]
                        for cc in T.unroll(T2):
                            Pd[w, lane + 32 * rb, cc] = gacc[cc]
                if tx < Tn:
                    dacc[1] = T.if_then_else(n > 0, T.cast(Gb[T.max(n - 1, 0)], f64), T.cast(0.0, f64))
                    for s in T.unroll(Tn):
                        if s <= tx:
                            dacc[1] = dacc[1] + gld[s]
                    Gd[tx] = dacc[1]
                T.sync_threads()

                # ---- phase 2: scalars, one task per thread, packed by the row's n (the first 2 Tn n tasks are
                # the history weights of entries i < n: one pass of NT threads while 2 Tn n + Tn^2 + Tn <= NT,
                # e.g. n <= 9 at T = 5 with 128 threads). Decays exp(G_t - G_i):
                # in fp64 arithmetic without fp64 transcendentals (simt_parts.exp_of_f64), norms in fp32
                na = 2 * Tn * n
                for it in T.unroll(IT_TASK):
                    idx = it * NT + tx
                    if idx < na:
                        task[0] = T.truncdiv(idx, n)  # the one division by the runtime n (both >= 0)
                        ti = idx - task[0] * n
                        tt = task[0] % Tn
                        kind = task[0] // Tn
                        gacc[0] = 0.0
                        gacc[1] = 0.0
                        for ww in T.unroll(NW):
                            gacc[0] = gacc[0] + Pd[ww, T2 + ti, kind * Tn + tt]
                            gacc[1] = gacc[1] + Pd[ww, kind * Tn + tt, kind * Tn + tt]
                        W[kind, tt, ti] = (exp_of_f64(T, Gd[tt] - T.cast(Gb[ti], f64)) * T.rsqrt(gacc[1] + L2NORM_EPS)
                                           * T.if_then_else(kind == 0, T.float32(1.0), T.float32(q_scale)) * gacc[0])
                    elif idx < na + NBt:
                        tt = (idx - na) // Tn
                        ts = (idx - na) % Tn
                        if ts <= tt:
                            for cc in T.unroll(4):
                                gacc[cc] = 0.0
                            for ww in T.unroll(NW):
                                gacc[0] = gacc[0] + Pd[ww, ts, tt]            # k_s . k_t
                                gacc[1] = gacc[1] + Pd[ww, ts, Tn + tt]       # k_s . q_t
                                gacc[2] = gacc[2] + Pd[ww, ts, ts]            # |k_s|^2
                                gacc[3] = gacc[3] + Pd[ww, tt, tt]            # |k_t|^2
                            gacc[2] = exp_of_f64(T, Gd[tt] - Gd[ts]) * T.rsqrt(gacc[2] + L2NORM_EPS)
                            Am[tt, ts] = betas[tt] * gacc[2] * T.rsqrt(gacc[3] + L2NORM_EPS) * gacc[0]
                            gacc[3] = 0.0
                            for ww in T.unroll(NW):
                                gacc[3] = gacc[3] + Pd[ww, Tn + tt, Tn + tt]  # |q_t|^2
                            Bm[tt, ts] = gacc[2] * T.rsqrt(gacc[3] + L2NORM_EPS) * q_scale * gacc[1]
                    elif idx < na + NBt + NC:
                        tt = idx - na - NBt
                        gacc[0] = 0.0
                        gacc[1] = 0.0
                        for ww in T.unroll(NW):
                            gacc[0] = gacc[0] + Pd[ww, tt, tt]
                            gacc[1] = gacc[1] + Pd[ww, Tn + tt, Tn + tt]
                        gacc[2] = exp_of_f64(T, Gd[tt])
                        rks[tt] = T.rsqrt(gacc[0] + L2NORM_EPS)
                        ck[tt] = gacc[2] * rks[tt]
                        cq[tt] = gacc[2] * T.rsqrt(gacc[1] + L2NORM_EPS) * q_scale
                    elif idx < na + NBt + NC + C:
                        te = idx - na - NBt - NC
                        if n + Tn == C:
                            FW[te] = flush_weight(T, Gd, Gb, te, n, Tn, cap)
                T.sync_threads()

                # ---- phase 3a: one thread per value column: the buffer's history (no S0 needed yet)
                if tx < BV:
                    for t in T.unroll(Tn):
                        hk_[t] = 0.0
                        hq_[t] = 0.0
                    for i in T.serial(n):
                        for t in T.unroll(Tn):
                            hk_[t] = hk_[t] + W[0, t, i] * Db[i, tx]
                            hq_[t] = hq_[t] + W[1, t, i] * Db[i, tx]
                    if lean:
                        for t in T.unroll(Tn):
                            Hs[Tn + t, tx] = hk_[t]
                            Hs[2 * Tn + t, tx] = hq_[t]
                # the new entries' keys and G (lengths are the host's business)
                if bv == 0:
                    if tx < Tn:
                        buf_g[bslot, n + tx, hv] = T.cast(Gd[tx], f32)
                    if hv % r == 0:
                        for it in T.unroll(IT_KN):
                            idx = it * NT + tx
                            if idx < Tn * K:
                                buf_k[bslot, n + idx // K, hk, idx % K] = T.cast(
                                    X[idx // K, idx % K] * rks[idx // K], buf_dtype)
                if C > 0:
                    if n + Tn == C and sslot >= 0:  # the new keys as stored, for the fused flush
                        for it in T.unroll(IT_KN):
                            idx = it * NT + tx
                            if idx < Tn * K:
                                X[T2 + n + idx // K, idx % K] = T.cast(
                                    T.cast(X[idx // K, idx % K] * rks[idx // K], buf_dtype), f32)
                # ---- phase 3b: S0^T [k_raw, q_raw] over this thread's rows (normalised later by ck, cq)
                if tensor_cores:
                    tc_products(acc, Sr, X, Ps, rg, w, lane, fa, fb, bits)
                elif lean:
                    first_products(acc, Sr, X, xv, Ps, rg, cg, w, lane)
                    second_products(acc, Sr, X, xv, Ps, rg, cg, w, lane)
                else:
                    s0_products(acc, Sr, X, xv, Ps, rg, cg, w, lane)

                # ---- phase 4: one thread per value column: forward substitution, outputs, new deltas
                if tx < BV:
                    if lean:
                        for t in T.unroll(Tn):
                            vr[t] = Hs[t, tx]
                            hk_[t] = Hs[Tn + t, tx]
                            hq_[t] = Hs[2 * Tn + t, tx]
                    for t in T.unroll(Tn):
                        acc[t] = 0.0
                        acc[Tn + t] = 0.0
                        for ww in T.unroll(PW):
                            acc[t] = acc[t] + Ps[ww, t, tx]
                            acc[Tn + t] = acc[Tn + t] + Ps[ww, Tn + t, tx]
                    for t in T.unroll(Tn):
                        dl[t] = betas[t] * (vr[t] - ck[t] * acc[t] - hk_[t])
                        for s in T.serial(t):
                            dl[t] = dl[t] - Am[t, s] * dl[s]
                    for t in T.unroll(Tn):
                        hq_[t] = hq_[t] + cq[t] * acc[Tn + t]
                        for s in T.serial(t + 1):
                            hq_[t] = hq_[t] + Bm[t, s] * dl[s]
                        o[bb, t, hv, v0 + tx] = T.cast(hq_[t], in_dtype)
                        buf_v[bslot, n + t, hv, v0 + tx] = T.cast(dl[t], buf_dtype)
                        if C > 0:
                            Db[n + t, tx] = T.cast(T.cast(dl[t], buf_dtype), f32)

                # ---- fused flush: S0 <- exp(G_C) S0 + sum_e exp(G_C - G_e) k_e delta_e^T (entries as stored)
                if C > 0:
                    if n + Tn == C and sslot >= 0:
                        fused_flush(Sr, X, xv, yv, Db, FW, Gd, gacc, state, sslot, hv, rg, cg, v0, 0, 0)
            else:
                for it in T.unroll(IT_OUT):
                    idx = it * NT + tx
                    if idx < Tn * BV:
                        o[bb, idx // BV, hv, v0 + idx % BV] = T.cast(0.0, in_dtype)

    return gdn_buffered_step


def gdn_flush(Hk: int, Hv: int, K: int = 128, V: int = 128, *, cap: int = 16, BV: int = 32,
              threads: int = 128, buf_dtype: str = "bfloat16"):
    """Fold each row's n buffered entries into its state (the family's shared flush)."""
    return linear_flush(Hk, Hv, K, V, cap=cap, BV=BV, threads=threads, buf_dtype=buf_dtype)
