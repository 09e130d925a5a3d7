"""Decode attention of each row's new tokens over its KV cache, read in place (GQA, causal).

Templates for the semantics of kvbuffer.kernels.attention.attention_reference (the runtime's torch
path, kvbuffer.runtime.mixing.attention, reads the same cache through a gathered window);
`attention_decode` builds the form keys.attention_on_tensor_cores picks:

- `attention_decode_simt` (thread level): grid (S splits, Hkv x NQB query blocks, B). A block holds QB query rows of one
  KV head (row r = t * G + g: token t, query head hk * G + g) and reads split s of the row's visible
  positions, warp by warp: a warp takes U consecutive positions at a time, every lane E = D / 32
  contiguous elements of each K and V row (one vector load each: 16 bytes for D = 256 in bf16), so a
  warp reads every row it touches once, coalesced, and nothing is staged. Scores are the lanes'
  partial dot products summed by a butterfly of shuffles (every lane ends with the full score), in the
  log2 domain (q is pre-multiplied by scale * log2 e); the running max, sum and fp32 accumulator of
  each query row live in registers (online softmax). The block's warps are merged through shared
  memory; with S = 1 the block writes the normalised output, else its partials (accumulator, max,
  sum) to the workspace for `attention_combine`.
- `attention_decode_mma`: the same pass where a KV head has 8 to 48 query rows (G x T: Nemotron-3's
  decode step of G = 16, a verify's rows), q and the cache in one 16-bit dtype
  (kvbuffer.kernels.keys.attention_on_tensor_cores): the rows are one tensor-core tile, scores and
  P V are tensor-core products over tiles of positions in shared memory, one block a KV head. There
  the thread-level pass spends a 5-shuffle tree per query row per position (80 for G = 16), which
  bounds it far below the cache's read. Same ABI and partials; `attention_decode` picks the form.
- `attention_combine`: one thread per output element merges the S partials (flash-decoding).

Causality: token t of row b sees positions 0 .. cached[b] + t; its T new keys and values are already
in the cache. A split covers ceil(n / S) of the row's n = cached[b] + T positions. Positions past a
row's visible range are clamped to a valid one before the load and weighted 0, so no load is out of
bounds and no lane branches (the tensor-core form's K tiles lean on TileLang's bounds guard past
max_len, its V loads are clamped, and both are masked past the split). Padding rows (slot -1) read nothing and get a zero output.

Tensor ABI (contiguous; `act` = the activations' dtype, `kv` = the cache's):
    attention_decode:  q (B, T, H, D) act, k_cache, v_cache (NS, max_len, Hkv, D) kv, slots (B,) int32,
                       cached (B,) int32, part (WB, S, T*H, D) fp32, stats (WB, S, T*H, 2) fp32,
                       out (B, T, H, D) act, scale (float scalar)
                       S = 1: out is written, part / stats unread (pass WB = 1); S > 1: part / stats
                       (WB = B) are written, out is not.
    attention_combine: part (B, S, T*H, D), stats (B, S, T*H, 2), slots (B,) int32, out (B, T, H, D) act
Batch B, pool size NS, cache length max_len and the split count S are dynamic.
"""

# no `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations

import math
import types

from ..kernels.keys import ATTENTION_HEAD_DIMS, ATTENTION_MAX_TOKENS, attention_on_tensor_cores, attention_query_block

DTYPES = ("bfloat16", "float16", "float32")
F32 = "float32"
LOG2E = 1.4426950408889634
MMA_SHARED_KV = 64 * 1024  # the tensor-core form's K + V tiles: within the 99 KB a block gets on sm_86 / sm_89
NEG = -1.0e30            # the running max before any position (finite: exp2(NEG - NEG) = 1, weighted by 0)


def _tl():
    import tilelang.language as T  # noqa: N812  (TileLang's own convention)

    return T


def _decode_abi(T, Tn: int, H: int, Hkv: int, D: int, dtype: str, kv_dtype: str):
    """Both decode passes' one ABI (the module docstring's): the dynamic sizes (batch, pool slots, cache
    length, splits, workspace rows) and a tensor type for each argument, one object each (two
    arguments annotated with one object would be one buffer)."""
    B, NS, ML, S, WB = (T.dynamic(n) for n in ("batch", "num_slots", "max_len", "splits", "work_rows"))
    args = types.SimpleNamespace(
        q=T.Tensor((B, Tn, H, D), dtype), k_cache=T.Tensor((NS, ML, Hkv, D), kv_dtype),
        v_cache=T.Tensor((NS, ML, Hkv, D), kv_dtype), slots=T.Tensor((B,), "int32"), cached=T.Tensor((B,), "int32"),
        part=T.Tensor((WB, S, Tn * H, D), F32), stats=T.Tensor((WB, S, Tn * H, 2), F32),
        out=T.Tensor((B, Tn, H, D), dtype))
    return (B, NS, ML, S, WB), args


def check_attention(H: int, Hkv: int, D: int, T_len: int = 1, dtype: str = "bfloat16", kv_dtype: str = "bfloat16",
                    threads: int = 128, unroll: int = 4) -> None:
    """Raise ValueError for parameters the templates do not build."""
    if Hkv < 1 or H < Hkv or H % Hkv:
        raise ValueError(f"query heads H={H} must be a positive multiple of the KV heads Hkv={Hkv}")
    if D not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"head dim D must be 32, 64, 128 or 256 (D / 32 elements a lane), got {D}")
    if not 1 <= T_len <= ATTENTION_MAX_TOKENS:
        raise ValueError(f"T={T_len} new tokens per row: the kernel takes 1 .. {ATTENTION_MAX_TOKENS}")
    for name, dt in (("dtype", dtype), ("kv_dtype", kv_dtype)):
        if dt not in DTYPES:
            raise ValueError(f"{name} must be one of {DTYPES}, got {dt!r}")
    if threads % 32 or not 32 <= threads <= 512:
        raise ValueError(f"threads must be a multiple of 32 in [32, 512], got {threads}")
    if unroll not in (1, 2, 4, 8):
        raise ValueError(f"unroll must be 1, 2, 4 or 8 positions a warp step, got {unroll}")


def get_configs() -> list[dict]:
    return [{"threads": t, "unroll": u} for t in (128, 256) for u in (4, 2, 8)]


def attention_decode(H: int, Hkv: int, D: int, T_len: int = 1, *, dtype: str = "bfloat16",
                     kv_dtype: str = "bfloat16", threads: int = 128, unroll: int = 4):
    """Attention of T_len new tokens per row over its cache (see the module docstring): the tensor-core
    form (`attention_decode_mma`) where keys.attention_on_tensor_cores says so, else the thread-level one."""
    check_attention(H, Hkv, D, T_len, dtype, kv_dtype, threads, unroll)
    if attention_on_tensor_cores(H // Hkv, T_len, D, dtype, kv_dtype):
        return attention_decode_mma(H, Hkv, D, T_len, dtype=dtype, threads=threads, unroll=unroll)
    return attention_decode_simt(H, Hkv, D, T_len, dtype=dtype, kv_dtype=kv_dtype, threads=threads, unroll=unroll)


def attention_decode_simt(H: int, Hkv: int, D: int, T_len: int = 1, *, dtype: str = "bfloat16",
                          kv_dtype: str = "bfloat16", threads: int = 128, unroll: int = 4):
    """The thread-level form of attention_decode, any shape the checks take."""
    check_attention(H, Hkv, D, T_len, dtype, kv_dtype, threads, unroll)
    T = _tl()
    (B, NS, ML, S, WB), abi = _decode_abi(T, T_len, H, Hkv, D, dtype, kv_dtype)
    G = H // Hkv
    Tn, E, U, NW = T_len, D // 32, unroll, threads // 32
    QB = attention_query_block(G, Tn, D)
    NQB = G * Tn // QB
    EPI = math.ceil(QB * D / threads)  # epilogue elements per thread

    @T.macro
    def warp_sum(x):
        for k in T.unroll(5):
            x[0] = x[0] + T.shfl_xor(x[0], 16 >> k)

    @T.prim_func
    def attention_decode_kernel(
        q: abi.q,
        k_cache: abi.k_cache,
        v_cache: abi.v_cache,
        slots: abi.slots,
        cached: abi.cached,
        part: abi.part,
        stats: abi.stats,
        out: abi.out,
        scale: T.float32,
    ):
        with T.Kernel(S, Hkv * NQB, B, threads=threads) as (bs, bh, bb):
            tx = T.get_thread_binding()
            Ms = T.alloc_shared((NW, QB), F32)
            Ls = T.alloc_shared((NW, QB), F32)
            As = T.alloc_shared((NW, QB, D), F32)
            qr = T.alloc_local((QB * E,), F32)
            acc = T.alloc_local((QB * E,), F32)
            m = T.alloc_local((QB,), F32)
            lsum = T.alloc_local((QB,), F32)
            kr = T.alloc_local((U * E,), kv_dtype)
            vr = T.alloc_local((U * E,), kv_dtype)
            sc = T.alloc_local((U * QB,), F32)
            red = T.alloc_local((1,), F32)
            mx = T.alloc_local((1,), F32)
            qb8 = T.alloc_local((E,), dtype)
            iv = T.alloc_local((4,), "int32")  # n, chunk, start, end: computed once (each is an index expression)
            w = tx // 32
            lane = tx % 32
            hk = bh // NQB
            r0 = (bh % NQB) * QB
            slot = slots[bb]
            if slot >= 0:
                iv[0] = cached[bb] + Tn
                iv[1] = (iv[0] + S - 1) // S
                iv[2] = bs * iv[1]
                iv[3] = T.min(iv[0], iv[2] + iv[1])
                n, chunk, start, end = iv[0], iv[1], iv[2], iv[3]
                for r in T.unroll(QB):
                    t = (r0 + r) // G
                    for e in T.vectorized(E):
                        qb8[e] = q[bb, t, hk * G + (r0 + r) % G, lane * E + e]
                    for e in T.unroll(E):
                        qr[r * E + e] = T.cast(qb8[e], F32) * scale * LOG2E
                        acc[r * E + e] = 0.0
                    m[r] = NEG
                    lsum[r] = 0.0
                for it in T.serial(T.ceildiv(chunk, NW * U)):
                    p0 = start + (it * NW + w) * U
                    for u in T.unroll(U):
                        pc = T.min(p0 + u, n - 1)  # a valid position; weighted 0 past the split
                        for e in T.vectorized(E):
                            kr[u * E + e] = k_cache[slot, pc, hk, lane * E + e]
                        for e in T.vectorized(E):
                            vr[u * E + e] = v_cache[slot, pc, hk, lane * E + e]
                    for u in T.unroll(U):
                        for r in T.unroll(QB):
                            red[0] = 0.0
                            for e in T.unroll(E):
                                red[0] = red[0] + qr[r * E + e] * T.cast(kr[u * E + e], F32)
                            warp_sum(red)
                            # visible: inside the split and not after this query's token
                            sc[u * QB + r] = T.if_then_else(
                                (p0 + u < end) & (p0 + u <= n - Tn + (r0 + r) // G), red[0], NEG)
                    for r in T.unroll(QB):
                        mx[0] = m[r]
                        for u in T.unroll(U):
                            mx[0] = T.max(mx[0], sc[u * QB + r])
                        red[0] = T.exp2(m[r] - mx[0])
                        m[r] = mx[0]
                        lsum[r] = lsum[r] * red[0]
                        for e in T.unroll(E):
                            acc[r * E + e] = acc[r * E + e] * red[0]
                        for u in T.unroll(U):
                            # a masked score (NEG) weighs 0 unless nothing was visible yet (then m is NEG
                            # too and the accumulator, 0 times v, stays 0 until a visible position rescales it)
                            sc[u * QB + r] = T.if_then_else(sc[u * QB + r] > NEG, T.exp2(sc[u * QB + r] - mx[0]), 0.0)
                            lsum[r] = lsum[r] + sc[u * QB + r]
                            for e in T.unroll(E):
                                acc[r * E + e] = acc[r * E + e] + sc[u * QB + r] * T.cast(vr[u * E + e], F32)
                for r in T.unroll(QB):
                    for e in T.vectorized(E):
                        As[w, r, lane * E + e] = acc[r * E + e]
                if lane == 0:
                    for r in T.unroll(QB):
                        Ms[w, r] = m[r]
                        Ls[w, r] = lsum[r]
            T.sync_threads()
            for i in T.unroll(EPI):
                idx = i * threads + tx
                if idx < QB * D:
                    r = idx // D
                    d = idx % D
                    t = (r0 + r) // G
                    h = hk * G + (r0 + r) % G
                    if slot >= 0:
                        mx[0] = NEG
                        for ww in T.unroll(NW):
                            mx[0] = T.max(mx[0], Ms[ww, r])
                        red[0] = 0.0
                        lsum[0] = 0.0
                        for ww in T.unroll(NW):
                            lsum[0] = lsum[0] + Ls[ww, r] * T.exp2(Ms[ww, r] - mx[0])
                            red[0] = red[0] + As[ww, r, d] * T.exp2(Ms[ww, r] - mx[0])
                        if S == 1:
                            out[bb, t, h, d] = T.cast(red[0] / lsum[0], dtype)
                        else:
                            part[bb, bs, t * H + h, d] = red[0]
                            if d == 0:
                                stats[bb, bs, t * H + h, 0] = mx[0]
                                stats[bb, bs, t * H + h, 1] = lsum[0]
                    elif S == 1:
                        out[bb, t, h, d] = T.cast(0.0, dtype)

    return attention_decode_kernel


def attention_decode_mma(H: int, Hkv: int, D: int, T_len: int = 1, *, dtype: str = "bfloat16", threads: int = 128,
                         unroll: int = 4):
    """The decode pass with a KV head's query rows as one tensor-core tile: the thread-level kernel's
    ABI and partials, one block a (split, KV head, row) for all G x T_len query rows.

    Block (split s, KV head hk, row b) holds the rows r = t * G + g (zero rows pad them to a multiple
    of 16) and walks the split's positions 16 x `unroll` at a time: K and V tiles copied to shared
    memory, the scores q K^T one tensor-core product (fp32), masked past the split (and, for T_len > 1,
    past each row's own token) to NEG, an online softmax in the log2 domain over the tile's rows
    (fp32), then P V a second product (P rounded to the input dtype, as flash attention does) into an
    fp32 accumulator. V's positions past the split are zeroed as they are loaded: the cache there holds
    whatever a slot last held (NaN included), and 0 x NaN is NaN. The tiles are plain vector loads in a
    serial loop (TileLang did not lower a pipelined loop with that masked load); other blocks on the SM
    hide their latency. The partials (accumulator, max, sum) and the S = 1 output are the thread-level
    kernel's. The engine takes it where keys.attention_on_tensor_cores says (8 to 48 rows a KV head);
    with fewer rows (a decode step of G = 4) it builds and runs too, for tests and the benchmark.
    """
    check_attention(H, Hkv, D, T_len, dtype, dtype, threads, unroll)
    G, Tn = H // Hkv, T_len
    R = G * Tn
    BH, BN = -(-R // 16) * 16, 16 * unroll  # query rows a tile (the product's M), positions a tile
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"attention_decode_mma takes 16-bit q and cache (the products' inputs), got {dtype}")
    if BH > 48:
        raise ValueError(f"attention_decode_mma takes up to 48 query rows (G x T) a KV head, in warp-level "
                         f"products of 16 rows (64 would make TileLang pick warpgroup products); got {R}")
    if threads != 128 or unroll < 2:
        raise ValueError(f"attention_decode_mma runs 128 threads (four warps side by side over the 16-row "
                         f"tiles) over tiles of 16 x unroll >= 32 positions, got threads={threads}, unroll={unroll}")
    if 2 * BN * D * 2 > MMA_SHARED_KV:
        raise ValueError(f"attention_decode_mma's K and V tiles of 16 x unroll = {BN} positions take "
                         f"{2 * BN * D * 2} bytes of shared memory, more than {MMA_SHARED_KV} "
                         f"(what every arch offers a block); use a smaller unroll")
    T = _tl()
    (B, NS, ML, S, WB), abi = _decode_abi(T, Tn, H, Hkv, D, dtype, dtype)

    # row r's token and query head, and its row of the partials (t * H + h); at T_len = 1 the row is the head
    def q_token(i):
        return 0 if Tn == 1 else T.min(i, R - 1) // G

    def q_head(i):
        return T.min(i, G - 1) if Tn == 1 else T.min(i, R - 1) % G

    def out_token(i):
        return 0 if Tn == 1 else i // G

    def out_head(i, hk):
        return hk * G + (i if Tn == 1 else i % G)

    def part_row(i, hk):
        return out_head(i, hk) if Tn == 1 else (i // G) * H + out_head(i, hk)

    def visible(i, j, p0, end, n):
        if Tn == 1:
            return p0 + j < end
        return (p0 + j < end) & (p0 + j <= n - Tn + T.min(i // G, Tn - 1))

    @T.prim_func
    def attention_decode_kernel(
        q: abi.q,
        k_cache: abi.k_cache,
        v_cache: abi.v_cache,
        slots: abi.slots,
        cached: abi.cached,
        part: abi.part,
        stats: abi.stats,
        out: abi.out,
        scale: T.float32,
    ):
        with T.Kernel(S, Hkv, B, threads=threads) as (bs, hk, bb):
            q_s = T.alloc_shared((BH, D), dtype)
            k_s = T.alloc_shared((BN, D), dtype)
            v_s = T.alloc_shared((BN, D), dtype)
            sc = T.alloc_fragment((BH, BN), F32)
            p_s = T.alloc_shared((BH, BN), dtype)  # P as the second product's A: every warp reads all of it
            acc = T.alloc_fragment((BH, D), F32)
            m = T.alloc_fragment((BH,), F32)
            m_prev = T.alloc_fragment((BH,), F32)
            resc = T.alloc_fragment((BH,), F32)
            tsum = T.alloc_fragment((BH,), F32)
            lsum = T.alloc_fragment((BH,), F32)
            slot = slots[bb]
            row = T.max(slot, 0)
            n = cached[bb] + Tn
            chunk = (n + S - 1) // S
            start = bs * chunk
            end = T.min(n, start + chunk)
            tiles = T.if_then_else(slot >= 0, T.ceildiv(T.max(end - start, 0), BN), 0)
            for i, d in T.Parallel(BH, D):
                q_s[i, d] = T.if_then_else(i < R, q[bb, q_token(i), hk * G + q_head(i), d], T.cast(0.0, dtype))
            T.fill(acc, 0.0)
            T.fill(lsum, 0.0)
            T.fill(m, NEG)
            for t in T.serial(tiles):
                p0 = start + t * BN
                T.copy(k_cache[row, p0:p0 + BN, hk, :], k_s, disable_tma=True)
                for j, d in T.Parallel(BN, D):
                    v_s[j, d] = T.if_then_else(p0 + j < end, v_cache[row, T.min(p0 + j, ML - 1), hk, d],
                                               T.cast(0.0, dtype))
                T.clear(sc)
                T.gemm(q_s, k_s, sc, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for i, j in T.Parallel(BH, BN):
                    sc[i, j] = T.if_then_else(visible(i, j, p0, end, n), sc[i, j] * (scale * LOG2E), NEG)
                T.copy(m, m_prev)
                T.reduce_max(sc, m, dim=1, clear=False)
                for i in T.Parallel(BH):
                    resc[i] = T.exp2(m_prev[i] - m[i])
                for i, j in T.Parallel(BH, BN):
                    # a masked score weighs 0 (m is NEG too while nothing was visible)
                    sc[i, j] = T.if_then_else(sc[i, j] > NEG, T.exp2(sc[i, j] - m[i]), 0.0)
                T.reduce_sum(sc, tsum, dim=1)
                for i in T.Parallel(BH):
                    lsum[i] = lsum[i] * resc[i] + tsum[i]
                for i, d in T.Parallel(BH, D):
                    acc[i, d] = acc[i, d] * resc[i]
                T.copy(sc, p_s)
                T.gemm(p_s, v_s, acc, policy=T.GemmWarpPolicy.FullCol)
            for i, d in T.Parallel(BH, D):
                if i < R:
                    if S == 1:
                        out[bb, out_token(i), out_head(i, hk), d] = T.if_then_else(
                            slot >= 0, T.cast(acc[i, d] / lsum[i], dtype), T.cast(0.0, dtype))
                    elif slot >= 0:
                        part[bb, bs, part_row(i, hk), d] = acc[i, d]
            for i in T.Parallel(BH):
                if i < R and S > 1 and slot >= 0:
                    stats[bb, bs, part_row(i, hk), 0] = m[i]
                    stats[bb, bs, part_row(i, hk), 1] = lsum[i]

    return attention_decode_kernel


def attention_combine(H: int, D: int, T_len: int = 1, *, dtype: str = "bfloat16", threads: int = 128):
    """out = the S splits' partials merged: sum_s 2^(M_s - M) A_s / sum_s 2^(M_s - M) L_s (zeros for padding)."""
    if T_len < 1 or T_len > ATTENTION_MAX_TOKENS or H < 1 or D < 1:
        raise ValueError(f"need H >= 1, D >= 1 and 1 <= T <= {ATTENTION_MAX_TOKENS}, got H={H}, D={D}, T={T_len}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
    T = _tl()
    B = T.dynamic("batch")
    S = T.dynamic("splits")
    Tn = T_len
    TH = Tn * H

    @T.prim_func
    def attention_combine_kernel(
        part: T.Tensor((B, S, TH, D), F32),
        stats: T.Tensor((B, S, TH, 2), F32),
        slots: T.Tensor((B,), "int32"),
        out: T.Tensor((B, Tn, H, D), dtype),
    ):
        with T.Kernel(T.ceildiv(TH * D, threads), B, threads=threads) as (bx, bb):
            tx = T.get_thread_binding()
            mx = T.alloc_local((1,), F32)
            num = T.alloc_local((1,), F32)
            den = T.alloc_local((1,), F32)
            idx = bx * threads + tx
            rr = idx // D
            d = idx % D
            if idx < TH * D:
                if slots[bb] >= 0:
                    mx[0] = NEG
                    for s in T.serial(S):
                        mx[0] = T.max(mx[0], stats[bb, s, rr, 0])
                    num[0] = 0.0
                    den[0] = 0.0
                    for s in T.serial(S):
                        num[0] = num[0] + part[bb, s, rr, d] * T.exp2(stats[bb, s, rr, 0] - mx[0])
                        den[0] = den[0] + stats[bb, s, rr, 1] * T.exp2(stats[bb, s, rr, 0] - mx[0])
                    out[bb, rr // H, rr % H, d] = T.cast(num[0] / den[0], dtype)
                else:
                    out[bb, rr // H, rr % H, d] = T.cast(0.0, dtype)

    return attention_combine_kernel
