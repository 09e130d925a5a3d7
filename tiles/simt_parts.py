"""Pieces shared by the thread-level buffered templates (GDN: gdn.py, Mamba-2: mamba2_simt.py).

Both give each thread KR rows x 4 columns of a row's K x BV state tile, held in registers `Sr`:
thread (rg, cg) owns rows rg*KR .. rg*KR+KR-1 and columns 4cg .. 4cg+3. `X` in shared memory holds
the query-side rows first (`queries` of them) and the keys in buffer order from `key_row0` on.
The macros below are the parts that do not depend on the family: reading S0, S0^T over the query
rows, and the fused flush.
"""


def simt_layout(K: int, BV: int, threads: int) -> tuple[int, int, int, int]:
    """(CG, KG, KR, NW): CG column groups of 4 columns, KG row groups of KR rows, NW warps."""
    if BV % 4 or not 4 <= BV <= 128:
        raise ValueError(f"BV={BV} must be a multiple of 4 in [4, 128]")
    CG = BV // 4
    if threads % 32 or threads % CG or threads < BV:
        raise ValueError(f"threads={threads} must be a multiple of 32 and of BV/4, and at least BV={BV}")
    KG, NW = threads // CG, threads // 32
    if K % KG or K // KG > 64:
        raise ValueError(f"K={K} over {KG} row groups must give at most 64 rows per thread")
    if K % (4 * NW):
        raise ValueError(f"K={K} must split into 4-element chunks over {NW} warps")
    return CG, KG, K // KG, NW


def mma_layout(K: int, BV: int, threads: int) -> tuple[int, int, int, int]:
    """(CG, KG, KR, NW) of the tensor-core layout: one warp per 32 columns and every row of them, so
    threads == BV; lane l holds the 4 columns 4 (8 w + l // 4) .. +3 and the KR = K / 4 rows of row group
    l % 4, the pattern of an m16n8k8 B fragment (mma_products)."""
    if BV not in (32, 64, 128) or threads != BV:
        raise ValueError(f"the tensor-core layout needs BV in (32, 64, 128) and threads == BV, got BV={BV}, "
                         f"threads={threads}")
    if K % 8 or K // 4 > 64:
        raise ValueError(f"the tensor-core layout needs K a multiple of 8 and at most 256, got K={K}")
    NW = threads // 32
    if K % (4 * NW):
        raise ValueError(f"K={K} must split into 4-element chunks over {NW} warps")
    return BV // 4, 4, K // 4, NW


def fitted_tunables(K: int, V: int, best: dict) -> dict:
    """`best` (measured at the models' head dims) when a K x V head admits it; otherwise the largest BV
    that divides V, with 2 * BV threads, no register cap (blocks = 0) and one head per block (the
    small-head shape the GPU tests run)."""
    try:
        if V % best["BV"] == 0:
            simt_layout(K, best["BV"], best["threads"])
            return dict(best)
    except ValueError:
        pass
    bv = next(b for b in (64, 32, 16) if V % b == 0)
    return ({k: v for k, v in best.items() if k == "variant"} | {"BV": bv, "threads": min(128, 2 * bv), "blocks": 0}
            | ({"heads": 1} if "heads" in best else {}))


LOG2E = 1.4426950408889634


def exp_of_f64(T, d):
    """exp(d) as fp32 for an fp64 log-decay difference d <= 0, without fp64 transcendentals.

    d (G_t - G_i) sums many steps, so rounding it to fp32 first would cost |d| 2^-24 of relative error.
    Split d log2(e) = m + f in fp64 (m an integer, |f| <= 1/2): 2^m is exact in fp32 and exp2 of the
    small f keeps fp32 accuracy (a few ulp). d log2(e) is floored at -256 (exp is 0 in fp32 well
    before), so d = -inf gives 0, not inf - inf. A TileLang expression (no statements)."""
    t = T.max(d * LOG2E, -256.0)
    m = T.floor(t + 0.5)
    return T.exp2(T.cast(t - m, "float32")) * T.exp2(T.cast(m, "float32"))


def flush_weight(T, Gd, Gb, te, n, tokens: int, cap: int, g0=0, b0=0):
    """exp(G_C - G_e) for entry te of a buffer that reaches C in this launch: e < n are the stored entries
    (G in Gb from b0, fp32), the rest the launch's new tokens (G in Gd from g0, fp64); G_C is the last
    new token's. The offsets pick one head's rows where a block holds several."""
    return exp_of_f64(T, Gd[g0 + tokens - 1] - T.if_then_else(
        te < n, T.cast(Gb[b0 + T.min(te, cap - 1)], "float64"), Gd[g0 + T.max(T.min(te - n, tokens - 1), 0)]))


def rows_per_vector(KR: int) -> int:
    """Rows a thread reads from shared memory in one vector load."""
    return 4 if KR % 4 == 0 else (2 if KR % 2 == 0 else 1)


def row_stager(T, NT: int):
    """A TileLang macro: rows of one head of a (batch or slot, row, head, column) tensor into a float32
    shared array, 8-element vector loads spread over the block's NT threads (tokens, buffer keys and
    values alike): stage(dst, dst_row0, src, b, rows, head, col0, cols8, iters, tx, reg), where
    dst[dst_row0 + i, j] = src[b, i, head, col0 + j] for i < rows, j < 8 * cols8, and reg holds 8 values
    of src's dtype."""

    @T.macro
    def stage(dst, dst_row0, src, b, rows, head, col0, cols8, iters, tx, reg):
        for it in T.unroll(iters):
            idx = it * NT + tx
            if idx < rows * cols8:
                for c in T.vectorized(8):
                    reg[c] = src[b, idx // cols8, head, col0 + (idx % cols8) * 8 + c]
                for c in T.vectorized(8):
                    dst[dst_row0 + idx // cols8, (idx % cols8) * 8 + c] = T.cast(reg[c], "float32")

    return stage


def query_products(T, *, KR: int, CG: int, queries: int, query0: int = 0, barrier: bool = True):
    """A TileLang macro: products(acc, Sr, X, xv, Ps, rg, cg, w, lane) writes S0^T X[q] over this
    thread's rows for the query rows q = query0 .. query0 + queries - 1; the row groups of a warp are
    summed by shuffles, each warp's partials go to Ps[w, q, column]; with `barrier`, a block barrier
    ends it. acc holds 4 * queries values, so a verify that runs its queries in two calls (the first
    without the barrier) keeps half the accumulators live."""
    RV = rows_per_vector(KR)
    RGW = 32 // CG if CG < 32 else 1  # row groups per warp

    @T.macro
    def add_lanes(acc, distance):
        """acc += the same registers of the lane `distance` away (a warp shuffle)."""
        for i in T.unroll(queries * 4):
            acc[i] = acc[i] + T.shfl_xor(acc[i], distance)

    @T.macro
    def products(acc, Sr, X, xv, Ps, rg, cg, w, lane):
        for i in T.unroll(queries * 4):
            acc[i] = 0.0
        for r4 in T.unroll(KR // RV):
            for cc in T.unroll(queries):
                for e in T.vectorized(RV):
                    xv[e] = X[query0 + cc, rg * KR + r4 * RV + e]
                for e in T.unroll(RV):
                    for c in T.unroll(4):
                        acc[cc * 4 + c] = acc[cc * 4 + c] + Sr[(r4 * RV + e) * 4 + c] * xv[e]
        # sum the row groups a warp holds: lanes CG, 2 CG, ... apart (a butterfly over RGW groups)
        if RGW > 1:
            add_lanes(acc, CG)
        if RGW > 2:
            add_lanes(acc, 2 * CG)
        if RGW > 4:
            add_lanes(acc, 4 * CG)
        if RGW > 8:
            add_lanes(acc, 8 * CG)
        if RGW > 16:
            add_lanes(acc, 16 * CG)
        if lane < CG:
            for cc in T.unroll(queries):
                for c in T.vectorized(4):
                    Ps[w, query0 + cc, cg * 4 + c] = acc[cc * 4 + c]
        if barrier:
            T.sync_threads()

    return products


def state_macros(T, *, KR: int, CG: int, C: int, tokens: int, queries: int, key_row0: int):
    """(load_state, s0_products, fused_flush) TileLang macros for one template's constants. fused_flush's
    last two arguments are the first row of this thread's head in Db (and FW) and in Gd: 0 for a block
    of one head, the head's offset where a block holds several heads' rows."""
    RV = rows_per_vector(KR)
    f32 = "float32"

    @T.macro
    def load_state(Sr, state, sslot, hv, rg, cg, v0):
        """This thread's S0 rows as float4 loads (zeros for a row without a state)."""
        if sslot >= 0:
            for rr in T.unroll(KR):
                for c in T.vectorized(4):
                    Sr[rr * 4 + c] = state[sslot, hv, rg * KR + rr, v0 + cg * 4 + c]
        else:
            for rr in T.unroll(KR * 4):
                Sr[rr] = 0.0

    s0_products = query_products(T, KR=KR, CG=CG, queries=queries)

    @T.macro
    def fused_flush(Sr, X, xv, yv, Db, FW, Gd, gacc, state, sslot, hv, rg, cg, v0, d0, g0):
        """S0 <- exp(G_C) S0 + sum_e FW[d0 + e] k_e v_e^T over the C entries as stored (keys in X from
        key_row0, values in Db from row d0; G_C = Gd[g0 + tokens - 1]), written back to the state."""
        T.sync_threads()
        gacc[0] = T.cast(T.exp(Gd[g0 + tokens - 1]), f32)
        for i in T.unroll(KR * 4):
            Sr[i] = Sr[i] * gacc[0]
        for e in T.serial(C):
            for c in T.vectorized(4):
                yv[c] = Db[d0 + e, cg * 4 + c]
            for r4 in T.unroll(KR // RV):
                for c in T.vectorized(RV):
                    xv[c] = X[key_row0 + e, rg * KR + r4 * RV + c]
                for rr in T.unroll(RV):
                    for c in T.unroll(4):
                        Sr[(r4 * RV + rr) * 4 + c] = Sr[(r4 * RV + rr) * 4 + c] + FW[d0 + e] * xv[rr] * yv[c]
        for rr in T.unroll(KR):
            for c in T.vectorized(4):
                state[sslot, hv, rg * KR + rr, v0 + cg * 4 + c] = Sr[rr * 4 + c]

    return load_state, s0_products, fused_flush


TF32_HI_MASK = 0xFFFFE000  # an fp32 with its low 13 mantissa bits cleared is exactly a TF32 value


def mma_products(T, *, KR: int, queries: int, split_x: bool):
    """A TileLang macro, the tensor-core S0^T X[q] of mma_layout: products(acc, Sr, X, Ps, rg, w, lane, fa,
    fb, bits) writes S0^T X[q] for q < queries straight to Ps[0, q, column] (a warp holds every row of its
    columns, so nothing is summed across warps) and ends with a block barrier.

    m16n8k8 TF32 MMAs per (k-step, n-tile): A = X's first `queries` rows (A rows past them repeat the
    last one; their output rows are dropped), B = the thread's S0 registers. The k order is free as
    long as A and B agree, so k-step s takes rows rg KR + 2s and rg KR + 2s + 1 of lane l's row group
    rg = l % 4, and n-tile j the columns 4 (8 w + c) + j, c = 0..7: no data moves between threads.
    fp32 accuracy (3xTF32): S0 = hi + lo, hi its TF32 part (low 13 mantissa bits cleared) and lo the
    rest as TF32, two MMAs; bf16 or fp16 activations are exact in TF32, fp32 ones (`split_x`) are split
    too and a third MMA adds lo(X) hi(S0). fa: 8 floats (A's hi, then lo), fb: 8, bits: 8 uint32.
    Ps rows are padded to BV + 1 so the D fragments' stores hit 32 different banks.
    """
    f32, u32 = "float32", "uint32"
    assert queries <= 16, "one m16 tile of query rows"
    last = queries - 1  # A rows past the queries read the last one: X's later rows may be written meanwhile
    mask = T.uint32(TF32_HI_MASK)

    @T.macro
    def products(acc, Sr, X, Ps, rg, w, lane, fa, fb, bits):
        m = lane // 4
        for i in T.unroll(16):
            acc[i] = 0.0
        for s in T.unroll(KR // 2):
            row = rg * KR + 2 * s
            fa[0] = X[T.min(m, last), row]
            fa[2] = X[T.min(m, last), row + 1]
            fa[1] = X[T.min(m + 8, last), row]
            fa[3] = X[T.min(m + 8, last), row + 1]
            if split_x:
                for i in T.unroll(4):
                    bits[0] = T.reinterpret(fa[i], u32) & mask
                    bits[1] = T.reinterpret(fa[i] - T.reinterpret(bits[0], f32), u32) & mask
                    fa[i] = T.reinterpret(bits[0], f32)
                    fa[4 + i] = T.reinterpret(bits[1], f32)
            # hi(S0) for the four n-tiles, then lo(S0): four independent accumulators between dependent MMAs
            for j in T.unroll(4):
                for e in T.unroll(2):
                    bits[2 * j + e] = T.reinterpret(Sr[(2 * s + e) * 4 + j], u32) & mask
                    fb[2 * j + e] = T.reinterpret(bits[2 * j + e], f32)
                T.ptx_mma(f32, "m16n8k8", "row", "col", "tf32", "tf32", f32, fa.data, 0, fb.data, 2 * j,
                          acc.data, j * 4, T.bool(False))
            if split_x:
                for j in T.unroll(4):
                    T.ptx_mma(f32, "m16n8k8", "row", "col", "tf32", "tf32", f32, fa.data, 4, fb.data, 2 * j,
                              acc.data, j * 4, T.bool(False))
            for j in T.unroll(4):
                for e in T.unroll(2):
                    bits[2 * j + e] = T.reinterpret(Sr[(2 * s + e) * 4 + j] - fb[2 * j + e], u32) & mask
                    fb[2 * j + e] = T.reinterpret(bits[2 * j + e], f32)
                T.ptx_mma(f32, "m16n8k8", "row", "col", "tf32", "tf32", f32, fa.data, 0, fb.data, 2 * j,
                          acc.data, j * 4, T.bool(False))
        # D fragment: rows m and m + 8, columns 2 (l % 4) and 2 (l % 4) + 1 of each n-tile
        for j in T.unroll(4):
            for h in T.unroll(2):
                if m + 8 * h < queries:
                    for e in T.unroll(2):
                        Ps[0, m + 8 * h, 32 * w + 4 * (2 * (lane % 4) + e) + j] = acc[j * 4 + 2 * h + e]
        T.sync_threads()

    return products
