"""Chunked Gated DeltaNet prefill: four TileLang templates for packed variable-length prompts.

Contract of the op they make up (kvbuffer.kernels.prefill.chunk_prefill):
    q, k (N, Hk, K) bf16, L2-normalised, q also scaled by K**-0.5; v (N, Hv, V) bf16; g (N, Hv) fp32 log
    decay (<= 0); beta (N, Hv) fp32; cu_seqlens (B + 1,) int32; state (num_slots, Hv, K, V) fp32;
    state_slots (B,) int32. Sequence i (tokens cu_seqlens[i] .. cu_seqlens[i+1] - 1) starts from
    state[state_slots[i]] (zero for slot -1), runs the recurrence of reference.core over its tokens, writes
    o (N, Hv, V) bf16 and its final state back into its slot in place (nothing for slot -1). Value head h
    reads key head h // (Hv // Hk). Each step's log decay is clamped at LOG_DECAY_FLOOR, as everywhere.

The chunkwise (WY / UT) form, chunks of BT = 64 tokens, G the within-chunk cumulative log decay:
    A = strictly lower (beta_t exp(G_t - G_s) k_t . k_s),  Tinv = (I + A)^-1
    w = Tinv (beta exp(G) k),  u = Tinv (beta v),  delta = u - w h       (h: the state at the chunk's start)
    o_t = exp(G_t) h^T q_t + sum_{s <= t} exp(G_t - G_s) (k_s . q_t) delta_s
    h <- exp(G_last) h + sum_s exp(G_last - G_s) k_s delta_s^T
Four launches: `gdn_prefill_chunks` (the chunk table), `gdn_prefill_prep` (per chunk and value head: G, A
on tensor cores, Tinv in fp32 by forward substitution or blockwise (16 x 16 diagonal blocks inverted, then
merged by tensor-core products), w and u on tensor cores), `gdn_prefill_states` (per
value tile, head and sequence: the chunks in order, the state in an fp32 fragment; writes each chunk's
starting state h (bf16) and the deltas), `gdn_prefill_output` (per chunk, head and value tile: o from h and
the deltas). The tensor-core operands are bf16 (k, v, q as given; Tinv, w, u, h and the deltas rounded to
bf16), accumulation fp32.

Decay-only form (Mamba-2's SSD, no beta and no delta correction; `delta_rule=False` in gdn_prefill_states
and gdn_prefill_output), its front and D skip inside: from the raw x (N, H, P), dt (N, H), B, C (N, G, N_state)
and the layer's A_log, dt_bias, D (H,), each token's dt = min(max(softplus(dt + dt_bias), dt_min), dt_max) and
log decay g = -exp(A_log) dt; the values dt x are folded (delta = dt x), so there is no prep launch: the state
pass forms dt and G itself (writing both per token for the output pass), and the output pass weighs the
intra-chunk products by dt_s, reads x where it reads the deltas and adds D x: y (N, H, P) bf16. A sequence on
slot -1 is a padding row there: dt = 0 and no D skip, so its outputs are zero.

Chunk slots: chunk c of sequence i owns slot cu_seqlens[i] // BT + i + c (unique, below
ceil(N / BT) + B), so the sequential kernel finds its chunks' slots without a table, and the table
(`chunks`: first token, token count and sequence per slot, 0 tokens for a slot owning no chunk) is built on
the device from cu_seqlens alone: no host round trip, so the op can be captured in a CUDA graph.
"""

from ..reference.core import LOG_DECAY_FLOOR
from .linear_decode import _softplus, _tl

BT = 64  # tokens per chunk
GW = 4  # pipelined state passes load G (Mamba-2: dt) as (BT, GW) boxes, 16 bytes a row (a TMA copy)
CHUNK_FIELDS = 3  # a chunk table row: first token, tokens, sequence


def _check(Hk: int, Hv: int, K: int, V: int, BV: int) -> None:
    if Hk < 1 or Hv % Hk:
        raise ValueError(f"Hv={Hv} must be a positive multiple of Hk={Hk}")
    if K % 16 or V % 16 or K > 256 or V > 256:
        raise ValueError(f"K={K} and V={V} must be multiples of 16 up to 256")
    if BV % 16 or V % BV:
        raise ValueError(f"BV={BV} must be a multiple of 16 that divides V={V}")


def _chunk_grid(NC, Hv: int, heads_inner: int, *rest):
    """The grid of a per-(chunk slot, value head[, rest]) launch, and the block's chunk slot and head from
    its first two indices: heads_inner runs the value heads of one chunk on consecutive blocks (the
    keys they share read once from DRAM, the rest from the L2), else the chunks of one head."""
    if heads_inner not in (0, 1):
        raise ValueError(f"heads_inner={heads_inner} must be 0 or 1")
    if heads_inner:
        return (NC * Hv, 1, *rest), lambda b0, b1: (b0 // Hv, b0 % Hv)
    return (NC, Hv, *rest), lambda b0, b1: (b0, b1)


def gdn_prefill_chunks(*, threads: int = 128):
    """The chunk table: chunks[s] = (first token, tokens, sequence) of the chunk owning chunk slot s, (0, 0, 0)
    for none.

    Args: cu_seqlens (B + 1,), chunks (chunk slots, 3) int32.
    """
    T = _tl()
    B = T.dynamic("batch")
    NC = T.dynamic("chunk_slots")

    @T.prim_func
    def gdn_prefill_chunks_kernel(
        cu_seqlens: T.Tensor((B + 1,), "int32"),
        chunks: T.Tensor((NC, CHUNK_FIELDS), "int32"),
    ):
        with T.Kernel(T.ceildiv(NC, threads), threads=threads) as bx:
            tx = T.get_thread_binding()
            first = T.alloc_local((1,), "int32")
            count = T.alloc_local((1,), "int32")
            seq = T.alloc_local((1,), "int32")
            s = bx * threads + tx
            first[0] = 0
            count[0] = 0
            seq[0] = 0
            for i in T.serial(B):
                base = cu_seqlens[i] // BT + i
                if s >= base and (s - base) * BT < cu_seqlens[i + 1] - cu_seqlens[i]:
                    first[0] = cu_seqlens[i] + (s - base) * BT
                    count[0] = T.min(BT, cu_seqlens[i + 1] - first[0])
                    seq[0] = i
            if s < NC:
                chunks[s, 0] = first[0]
                chunks[s, 1] = count[0]
                chunks[s, 2] = seq[0]

    return gdn_prefill_chunks_kernel


SOLVES = ("substitution", "blockwise")  # how the prep forms Tinv = (I + A)^-1 (gdn_prefill_prep's `solve`)
SOLVE_BLOCK = 16  # the blockwise solve's diagonal blocks


def gdn_prefill_prep(Hk: int, Hv: int, K: int = 128, V: int = 128, *, threads: int = 128,
                     solve: str = "substitution", heads_inner: int = 0, staged: int = 0):
    """Per (chunk slot, value head): gcum = G (clamped, within the chunk), w, u (bf16) for the chunk's tokens.

    `solve` forms Tinv = (I + A)^-1 (fp32, rounded to bf16 for the products):
    - "substitution": forward substitution, one column a thread, 64 rows in series;
    - "blockwise": the 16 x 16 diagonal blocks inverted by substitution (16 rows in series), Dinv their
      block-diagonal inverse, then with N = Dinv A_off (A's blocks below the diagonal, so N^4 = 0)
      Tinv = (I - N + N^2 - N^3) Dinv: four 64 x 64 products on tensor cores (fp32 operands: TF32).
    `heads_inner`: the grid's order (_chunk_grid).
    `staged` 1: w, then u, each product rounded into the shared tile its right-hand side held and written
    from there by rows (16-byte stores), so one accumulator is live at a time (fewer registers, more blocks
    an SM); 0: both products, then both written from the accumulators. The same values either way.
    Args: k, v, g, beta, chunks, w (N, Hv, K), u (N, Hv, V), gcum (N, Hv).
    """
    _check(Hk, Hv, K, V, 16)
    if solve not in SOLVES:
        raise ValueError(f"solve={solve!r} must be one of {SOLVES}")
    if staged not in (0, 1):
        raise ValueError(f"staged={staged} must be 0 or 1")
    T = _tl()
    N = T.dynamic("num_tokens")
    NC = T.dynamic("chunk_slots")
    r = Hv // Hk
    f32, bf16 = "float32", "bfloat16"
    SB = SOLVE_BLOCK
    grid, chunk_and_head = _chunk_grid(NC, Hv, heads_inner)

    @T.macro
    def front(k, g, beta, gcum, gl, Gs, bs, ks, gram, t0, L, hk, hv):
        """G, beta and the Gram k k^T of one chunk."""
        for i in T.Parallel(BT):
            gl[i] = T.if_then_else(i < L, T.max(g[T.min(t0 + i, N - 1), hv], LOG_DECAY_FLOOR), 0.0)
            bs[i] = T.if_then_else(i < L, beta[T.min(t0 + i, N - 1), hv], 0.0)
        T.cumsum(gl, Gs)
        for i in T.Parallel(BT):
            if i < L:
                gcum[t0 + i, hv] = Gs[i]
        for i, d in T.Parallel(BT, K):
            ks[i, d] = T.if_then_else(i < L, k[T.min(t0 + i, N - 1), hk, d], T.cast(0.0, bf16))
        T.gemm(ks, ks, gram, transpose_B=True, clear_accum=True)

    @T.macro
    def rhs(v, bs, Gs, ks, vs, t0, L, hv):
        """The right-hand sides beta exp(G) k (over k, in place) and beta v, formed after the solve: the
        solve's fp32 tiles and these share shared memory, so more blocks fit an SM."""
        for i, d in T.Parallel(BT, K):
            ks[i, d] = T.cast(T.cast(ks[i, d], f32) * bs[i] * T.exp(Gs[i]), bf16)
        for i, d in T.Parallel(BT, V):
            vs[i, d] = T.cast(T.if_then_else(i < L, T.cast(v[T.min(t0 + i, N - 1), hv, d], f32), 0.0) * bs[i], bf16)

    @T.macro
    def products(Ai, kb, vs, wf, uf, w, u, t0, L, hv):
        """w = Tinv (beta exp(G) k), u = Tinv (beta v), the chunk's rows written."""
        if staged:
            T.gemm(Ai, kb, wf, clear_accum=True)
            T.copy(wf, kb)
            for i, d in T.Parallel(BT, K):
                if i < L:
                    w[t0 + i, hv, d] = kb[i, d]
            T.gemm(Ai, vs, uf, clear_accum=True)
            T.copy(uf, vs)
            for i, d in T.Parallel(BT, V):
                if i < L:
                    u[t0 + i, hv, d] = vs[i, d]
        else:
            T.gemm(Ai, kb, wf, clear_accum=True)
            T.gemm(Ai, vs, uf, clear_accum=True)
            for i, d in T.Parallel(BT, K):
                if i < L:
                    w[t0 + i, hv, d] = T.cast(wf[i, d], bf16)
            for i, d in T.Parallel(BT, V):
                if i < L:
                    u[t0 + i, hv, d] = T.cast(uf[i, d], bf16)

    @T.prim_func
    def gdn_prefill_prep_kernel(
        k: T.Tensor((N, Hk, K), bf16),
        v: T.Tensor((N, Hv, V), bf16),
        g: T.Tensor((N, Hv), f32),
        beta: T.Tensor((N, Hv), f32),
        chunks: T.Tensor((NC, CHUNK_FIELDS), "int32"),
        w: T.Tensor((N, Hv, K), bf16),
        u: T.Tensor((N, Hv, V), bf16),
        gcum: T.Tensor((N, Hv), f32),
    ):
        with T.Kernel(*grid, threads=threads) as (b0, b1):
            s, hv = chunk_and_head(b0, b1)
            tx = T.get_thread_binding()
            gl = T.alloc_shared((BT,), f32)
            Gs = T.alloc_shared((BT,), f32)
            bs = T.alloc_shared((BT,), f32)
            ks = T.alloc_shared((BT, K), bf16)
            vs = T.alloc_shared((BT, V), bf16)
            At = T.alloc_shared((BT, BT), f32)
            Xs = T.alloc_shared((BT, BT), f32)
            Ai = T.alloc_shared((BT, BT), bf16)
            gram = T.alloc_fragment((BT, BT), f32)
            wf = T.alloc_fragment((BT, K), f32)
            uf = T.alloc_fragment((BT, V), f32)
            xb = T.alloc_local((16,), f32)
            xj = T.alloc_local((1,), f32)

            t0 = chunks[s, 0]
            L = chunks[s, 1]
            if L > 0:
                hk = hv // r
                front(k, g, beta, gcum, gl, Gs, bs, ks, gram, t0, L, hk, hv)
                for i, j in T.Parallel(BT, BT):  # stored transposed: At[s, t] = A[t, s]
                    At[j, i] = T.if_then_else(i > j, bs[i] * T.exp(Gs[i] - Gs[j]) * gram[i, j], 0.0)
                # Tinv by forward substitution in fp32, one column a thread, 16 rows at a time in registers:
                # the rows of the earlier blocks come from shared memory, one load per row for 16 FMAs
                if tx < BT:
                    for blk in T.serial(BT // 16):
                        for ii in T.unroll(16):
                            xb[ii] = T.if_then_else(blk * 16 + ii == tx, 1.0, 0.0)
                        for j in T.serial(blk * 16):
                            xj[0] = Xs[j, tx]
                            for ii in T.unroll(16):
                                xb[ii] = xb[ii] - At[j, blk * 16 + ii] * xj[0]
                        for ii in T.unroll(16):
                            for jj in T.unroll(16):
                                if jj < ii:
                                    xb[ii] = xb[ii] - At[blk * 16 + jj, blk * 16 + ii] * xb[jj]
                        for ii in T.unroll(16):
                            Xs[blk * 16 + ii, tx] = xb[ii]
                for i, j in T.Parallel(BT, BT):  # after the solve: Ai may take the place of A
                    Ai[i, j] = T.cast(Xs[i, j], bf16)
                rhs(v, bs, Gs, ks, vs, t0, L, hv)
                products(Ai, ks, vs, wf, uf, w, u, t0, L, hv)

    @T.prim_func
    def blockwise_prep_kernel(
        k: T.Tensor((N, Hk, K), bf16),
        v: T.Tensor((N, Hv, V), bf16),
        g: T.Tensor((N, Hv), f32),
        beta: T.Tensor((N, Hv), f32),
        chunks: T.Tensor((NC, CHUNK_FIELDS), "int32"),
        w: T.Tensor((N, Hv, K), bf16),
        u: T.Tensor((N, Hv, V), bf16),
        gcum: T.Tensor((N, Hv), f32),
    ):
        with T.Kernel(*grid, threads=threads) as (b0, b1):
            s, hv = chunk_and_head(b0, b1)
            tx = T.get_thread_binding()
            gl = T.alloc_shared((BT,), f32)
            Gs = T.alloc_shared((BT,), f32)
            bs = T.alloc_shared((BT,), f32)
            ks = T.alloc_shared((BT, K), bf16)
            vs = T.alloc_shared((BT, V), bf16)
            Ad = T.alloc_shared((BT, BT), f32)   # A's diagonal blocks; later N^2
            Ao = T.alloc_shared((BT, BT), f32)   # A's blocks below the diagonal; later I - N + N^2 - N^3
            Dm = T.alloc_shared((BT, BT), f32)   # Dinv
            Nm = T.alloc_shared((BT, BT), f32)   # N = Dinv A_off
            Ai = T.alloc_shared((BT, BT), bf16)
            gram = T.alloc_fragment((BT, BT), f32)
            mf = T.alloc_fragment((BT, BT), f32)  # the solve's products (TF32)
            wf = T.alloc_fragment((BT, K), f32)
            uf = T.alloc_fragment((BT, V), f32)
            xb = T.alloc_local((SB,), f32)

            t0 = chunks[s, 0]
            L = chunks[s, 1]
            if L > 0:
                hk = hv // r
                front(k, g, beta, gcum, gl, Gs, bs, ks, gram, t0, L, hk, hv)
                for i, j in T.Parallel(BT, BT):
                    Ad[i, j] = T.if_then_else(i // SB == j // SB, T.if_then_else(
                        i > j, bs[i] * T.exp(Gs[i] - Gs[j]) * gram[i, j], 0.0), 0.0)
                    Ao[i, j] = T.if_then_else(i // SB > j // SB, bs[i] * T.exp(Gs[i] - Gs[j]) * gram[i, j], 0.0)
                # Dinv: column tx % SB of diagonal block tx // SB by forward substitution, zeros off the block
                if tx < BT:
                    for ii in T.unroll(SB):
                        xb[ii] = T.if_then_else(ii == tx % SB, 1.0, 0.0)
                    for ii in T.unroll(SB):
                        for jj in T.unroll(SB):
                            if jj < ii:
                                xb[ii] = xb[ii] - Ad[tx // SB * SB + ii, tx // SB * SB + jj] * xb[jj]
                    for blk in T.unroll(BT // SB):
                        for ii in T.unroll(SB):
                            Dm[blk * SB + ii, tx] = T.if_then_else(blk == tx // SB, xb[ii], 0.0)
                T.gemm(Dm, Ao, mf, clear_accum=True)          # N
                T.copy(mf, Nm)
                T.gemm(Nm, Nm, mf, clear_accum=True)          # N^2
                T.copy(mf, Ad)
                T.gemm(Ad, Nm, mf, clear_accum=True)          # N^3
                for i, j in T.Parallel(BT, BT):
                    Ao[i, j] = T.if_then_else(i == j, 1.0, 0.0) - Nm[i, j] + Ad[i, j] - mf[i, j]
                T.gemm(Ao, Dm, mf, clear_accum=True)          # Tinv
                T.copy(mf, Ai)
                rhs(v, bs, Gs, ks, vs, t0, L, hv)
                products(Ai, ks, vs, wf, uf, w, u, t0, L, hv)

    return blockwise_prep_kernel if solve == "blockwise" else gdn_prefill_prep_kernel


def gdn_prefill_states(Hk: int, Hv: int, K: int = 128, V: int = 128, *, BV: int = 32, threads: int = 128,
                       stages: int = 0, delta_rule: bool = True):
    """Per (value tile, value head, sequence): the chunks in order from state[slot] (zero for slot -1).

    Delta rule: writes h[chunk slot] (the state at each chunk's start, bf16), delta = u - w h (bf16) and
    the final state back into its slot (none for slot -1).
    Args: k, w, u, gcum, cu_seqlens, state, state_slots, h (chunk slots, Hv, K, V), delta (N, Hv, V).
    Decay-only (delta_rule=False, Mamba-2: no prep launch, the values dt x folded as they are): each token's
    dt (the front, module docstring) and the chunk's cumulative decay G are formed here, and written to
    dts and gcum by the first value tile; a sequence on slot -1 gets dt = 0 (a padding row).
    Args: x, dt, A_log, dt_bias, k (= B), cu_seqlens, state, state_slots, h, gcum, dts (N, Hv), dt_min, dt_max.
    `stages` > 0: the chunk's loads (w, k, u and G; decay-only: k, x and dt) are whole-tile copies in a
    T.Pipelined loop of that many stages (TileLang lowers them to TMA loads from a producer warpgroup, the
    next chunk's loads overlapping this chunk's products; G or dt as (64, GW) boxes of GW heads, a TMA row
    being at least 16 bytes, so Hv must be a multiple of GW); rows past the sequence are read as they are
    (the next sequence's tokens, or zeros past the end) and selected out of the deltas, and in a
    sequence's last chunk its keys past the end are cleared after their copy lands, so a NaN or inf in
    the next sequence cannot reach this one's state. Same arguments.
    """
    _check(Hk, Hv, K, V, BV)
    if stages < 0:
        raise ValueError(f"stages={stages} must be 0 (the plain pass) or more (pipelined)")
    if stages and Hv % GW:
        raise ValueError(f"stages={stages}: the pipelined pass loads {GW} heads' decays at once, so Hv={Hv} "
                         f"must be a multiple of {GW}")
    T = _tl()
    N = T.dynamic("num_tokens")
    B = T.dynamic("batch")
    NS = T.dynamic("num_state_slots")
    NC = T.dynamic("chunk_slots")
    r = Hv // Hk
    f32, bf16 = "float32", "bfloat16"

    @T.macro
    def load_state(hf, state, slot, hv, v0):
        for i, j in T.Parallel(K, BV):
            hf[i, j] = T.if_then_else(slot >= 0, state[T.max(slot, 0), hv, i, v0 + j], 0.0)

    @T.macro
    def start_chunk(hf, hs, h, base, c, hv, v0):
        # h[chunk slot] <- the state at the chunk's start (bf16, also the products' operand)
        T.copy(hf, hs)
        T.copy(hs, h[base + c, hv, 0:K, v0:v0 + BV])

    @T.macro
    def fold(hf, ks, ds, df, Gs, wv, decay, L):
        # h <- exp(G_last) h + (exp(G_last - G_s) k_s)^T delta_s (df is 0 past the chunk's tokens); the weights
        # first, then one copy to shared (one barrier, where a store a barrier is what an element loop gets)
        for i in T.Parallel(BT):
            wv[i] = T.exp(Gs[L - 1] - Gs[i])
        decay[0] = T.exp(Gs[L - 1])
        for i, j in T.Parallel(BT, BV):
            df[i, j] = df[i, j] * wv[i]
        T.copy(df, ds)
        for i, j in T.Parallel(K, BV):
            hf[i, j] = hf[i, j] * decay[0]
        T.gemm(ks, ds, hf, transpose_A=True)

    @T.macro
    def keys_past_the_end_cleared(ks, L):
        # pipelined: a sequence's last chunk loads whole 64-row tiles, so rows past its end hold the next
        # sequence's keys; the fold weighs them by zero, and 0 x NaN is NaN, so they are cleared (read
        # and selected, so the copy's wait comes first), in that chunk only
        if L < BT:
            for i, d in T.Parallel(BT, K):
                ks[i, d] = T.if_then_else(i < L, ks[i, d], T.cast(0.0, bf16))

    @T.macro
    def store_state(hf, state, slot, hv, v0):
        if slot >= 0:
            for i, j in T.Parallel(K, BV):
                state[slot, hv, i, v0 + j] = hf[i, j]

    @T.macro
    def scan_step(src, dst, off):
        for i in T.Parallel(BT):
            dst[i] = src[i] + T.if_then_else(i >= off, src[T.max(i - off, 0)], 0.0)

    @T.macro
    def running_sum(gl, Gs, tmp):
        # Gs = the inclusive prefix sum of gl in log2(BT) = 6 doubling steps through shared memory: T.cumsum's
        # scan assumes it runs on the block's first threads, which a pipelined pass's consumer warpgroup is not
        scan_step(gl, tmp, 1)
        scan_step(tmp, Gs, 2)
        scan_step(Gs, tmp, 4)
        scan_step(tmp, Gs, 8)
        scan_step(Gs, tmp, 16)
        scan_step(tmp, Gs, 32)

    @T.macro
    def decay_fold(hf, ks, xs, ds, dv, gl, Gs, wv, decay, A_log, gcum, dts, t0, L, hv, bv, scan):
        # decay-only: G the running sum of the log decays max(-exp(A_log) dt, floor) (G and dt written per
        # token by the first value tile, for the output pass); h <- exp(G_last) h + (exp(G_last - G_s) k_s)^T
        # (dt_s x_s), x past the chunk selected out (not weighed by zero: a NaN there stays out).
        # `scan`: None for T.cumsum, else running_sum's shared scratch (BT,)
        for i in T.Parallel(BT):
            gl[i] = T.max(-T.exp(A_log[hv]) * dv[i], LOG_DECAY_FLOOR)
        if scan is None:
            T.cumsum(gl, Gs)
        else:
            running_sum(gl, Gs, scan)
        for i in T.Parallel(BT):
            if bv == 0 and i < L:
                gcum[t0 + i, hv] = Gs[i]
                dts[t0 + i, hv] = dv[i]
        for i in T.Parallel(BT):
            wv[i] = dv[i] * T.exp(Gs[L - 1] - Gs[i])
        for i, j in T.Parallel(BT, BV):
            ds[i, j] = T.if_then_else(i < L, T.cast(T.cast(xs[i, j], f32) * wv[i], bf16), T.cast(0.0, bf16))
        decay[0] = T.exp(Gs[L - 1])
        for i, j in T.Parallel(K, BV):
            hf[i, j] = hf[i, j] * decay[0]
        T.gemm(ks, ds, hf, transpose_A=True)

    @T.prim_func
    def gdn_prefill_states_kernel(
        k: T.Tensor((N, Hk, K), bf16),
        w: T.Tensor((N, Hv, K), bf16),
        u: T.Tensor((N, Hv, V), bf16),
        gcum: T.Tensor((N, Hv), f32),
        cu_seqlens: T.Tensor((B + 1,), "int32"),
        state: T.Tensor((NS, Hv, K, V), f32),
        state_slots: T.Tensor((B,), "int32"),
        h: T.Tensor((NC, Hv, K, V), bf16),
        delta: T.Tensor((N, Hv, V), bf16),
    ):
        with T.Kernel(V // BV, Hv, B, threads=threads) as (bv, hv, bb):
            hf = T.alloc_fragment((K, BV), f32)
            hs = T.alloc_shared((K, BV), bf16)
            ws = T.alloc_shared((BT, K), bf16)
            ks = T.alloc_shared((BT, K), bf16)
            us = T.alloc_shared((BT, BV), bf16)
            ds = T.alloc_shared((BT, BV), bf16)
            df = T.alloc_fragment((BT, BV), f32)
            Gs = T.alloc_shared((BT,), f32)
            wv = T.alloc_shared((BT,), f32)
            decay = T.alloc_local((1,), f32)
            hk = hv // r
            v0 = bv * BV
            slot = state_slots[bb]
            bos = cu_seqlens[bb]
            eos = cu_seqlens[bb + 1]
            base = bos // BT + bb
            load_state(hf, state, slot, hv, v0)
            for c in T.serial(T.ceildiv(eos - bos, BT)):
                t0 = bos + c * BT
                L = T.min(BT, eos - t0)
                # every load of the chunk first, so their latencies overlap each other and the state's copy
                for i, d in T.Parallel(BT, K):
                    ws[i, d] = T.if_then_else(i < L, w[T.min(t0 + i, N - 1), hv, d], T.cast(0.0, bf16))
                    ks[i, d] = T.if_then_else(i < L, k[T.min(t0 + i, N - 1), hk, d], T.cast(0.0, bf16))
                for i, j in T.Parallel(BT, BV):
                    us[i, j] = T.if_then_else(i < L, u[T.min(t0 + i, N - 1), hv, v0 + j], T.cast(0.0, bf16))
                for i in T.Parallel(BT):
                    Gs[i] = T.if_then_else(i < L, gcum[T.min(t0 + i, N - 1), hv], 0.0)
                start_chunk(hf, hs, h, base, c, hv, v0)
                T.gemm(ws, hs, df, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    df[i, j] = T.if_then_else(i < L, T.cast(us[i, j], f32) - df[i, j], 0.0)
                for i, j in T.Parallel(BT, BV):
                    if i < L:
                        delta[t0 + i, hv, v0 + j] = T.cast(df[i, j], bf16)
                fold(hf, ks, ds, df, Gs, wv, decay, L)
            store_state(hf, state, slot, hv, v0)

    @T.prim_func
    def decay_only_states_kernel(
        x: T.Tensor((N, Hv, V), bf16),
        dt: T.Tensor((N, Hv), f32),
        A_log: T.Tensor((Hv,), f32),
        dt_bias: T.Tensor((Hv,), f32),
        k: T.Tensor((N, Hk, K), bf16),
        cu_seqlens: T.Tensor((B + 1,), "int32"),
        state: T.Tensor((NS, Hv, K, V), f32),
        state_slots: T.Tensor((B,), "int32"),
        h: T.Tensor((NC, Hv, K, V), bf16),
        gcum: T.Tensor((N, Hv), f32),
        dts: T.Tensor((N, Hv), f32),
        dt_min: T.float32,
        dt_max: T.float32,
    ):
        with T.Kernel(V // BV, Hv, B, threads=threads) as (bv, hv, bb):
            hf = T.alloc_fragment((K, BV), f32)
            hs = T.alloc_shared((K, BV), bf16)
            ks = T.alloc_shared((BT, K), bf16)
            xs = T.alloc_shared((BT, BV), bf16)
            ds = T.alloc_shared((BT, BV), bf16)
            dv = T.alloc_shared((BT,), f32)
            gl = T.alloc_shared((BT,), f32)
            Gs = T.alloc_shared((BT,), f32)
            wv = T.alloc_shared((BT,), f32)
            decay = T.alloc_local((1,), f32)
            hk = hv // r
            v0 = bv * BV
            slot = state_slots[bb]
            bos = cu_seqlens[bb]
            eos = cu_seqlens[bb + 1]
            base = bos // BT + bb
            load_state(hf, state, slot, hv, v0)
            for c in T.serial(T.ceildiv(eos - bos, BT)):
                t0 = bos + c * BT
                L = T.min(BT, eos - t0)
                # every load of the chunk first (B, x, dt), so their latencies overlap each other and the
                # state's copy; the front: dt = clamp(softplus(dt + dt_bias)) (0 past the chunk, and for a
                # padding row)
                for i, d in T.Parallel(BT, K):
                    ks[i, d] = T.if_then_else(i < L, k[T.min(t0 + i, N - 1), hk, d], T.cast(0.0, bf16))
                for i, j in T.Parallel(BT, BV):
                    xs[i, j] = T.if_then_else(i < L, x[T.min(t0 + i, N - 1), hv, v0 + j], T.cast(0.0, bf16))
                for i in T.Parallel(BT):
                    dv[i] = T.if_then_else(i < L, T.if_then_else(slot >= 0, T.min(T.max(
                        _softplus(T, dt[T.min(t0 + i, N - 1), hv] + dt_bias[hv]), dt_min), dt_max), 0.0), 0.0)
                start_chunk(hf, hs, h, base, c, hv, v0)
                decay_fold(hf, ks, xs, ds, dv, gl, Gs, wv, decay, A_log, gcum, dts, t0, L, hv, bv, None)
            store_state(hf, state, slot, hv, v0)

    @T.prim_func
    def pipelined_states_kernel(
        k: T.Tensor((N, Hk, K), bf16),
        w: T.Tensor((N, Hv, K), bf16),
        u: T.Tensor((N, Hv, V), bf16),
        gcum: T.Tensor((N, Hv), f32),
        cu_seqlens: T.Tensor((B + 1,), "int32"),
        state: T.Tensor((NS, Hv, K, V), f32),
        state_slots: T.Tensor((B,), "int32"),
        h: T.Tensor((NC, Hv, K, V), bf16),
        delta: T.Tensor((N, Hv, V), bf16),
    ):
        with T.Kernel(V // BV, Hv, B, threads=threads) as (bv, hv, bb):
            hf = T.alloc_fragment((K, BV), f32)
            hs = T.alloc_shared((K, BV), bf16)
            ws = T.alloc_shared((BT, K), bf16)
            ks = T.alloc_shared((BT, K), bf16)
            us = T.alloc_shared((BT, BV), bf16)
            ds = T.alloc_shared((BT, BV), bf16)
            df = T.alloc_fragment((BT, BV), f32)
            G4 = T.alloc_shared((BT, GW), f32)
            wv = T.alloc_shared((BT,), f32)
            decay = T.alloc_local((1,), f32)
            hk = hv // r
            g0 = hv - hv % GW
            gc = hv % GW
            v0 = bv * BV
            slot = state_slots[bb]
            bos = cu_seqlens[bb]
            eos = cu_seqlens[bb + 1]
            base = bos // BT + bb
            load_state(hf, state, slot, hv, v0)
            for c in T.Pipelined(T.ceildiv(eos - bos, BT), num_stages=stages):
                T.copy(w[bos + c * BT:bos + c * BT + BT, hv, 0:K], ws)
                T.copy(k[bos + c * BT:bos + c * BT + BT, hk, 0:K], ks)
                T.copy(u[bos + c * BT:bos + c * BT + BT, hv, v0:v0 + BV], us)
                T.copy(gcum[bos + c * BT:bos + c * BT + BT, g0:g0 + GW], G4)
                # the fold's weights exp(G_last - G_s) (0 past the sequence: G there is not ours) and exp(G_last),
                # first: the barriers of the state's copy below order them before their use
                for i in T.Parallel(BT):
                    wv[i] = T.if_then_else(i < eos - bos - c * BT, T.exp(
                        G4[T.min(BT, eos - bos - c * BT) - 1, gc] - G4[i, gc]), 0.0)
                decay[0] = T.exp(G4[T.min(BT, eos - bos - c * BT) - 1, gc])
                start_chunk(hf, hs, h, base, c, hv, v0)
                T.gemm(ws, hs, df, clear_accum=True)
                keys_past_the_end_cleared(ks, eos - bos - c * BT)
                for i, j in T.Parallel(BT, BV):
                    df[i, j] = T.if_then_else(i < eos - bos - c * BT, T.cast(us[i, j], f32) - df[i, j], 0.0)
                for i, j in T.Parallel(BT, BV):
                    if i < eos - bos - c * BT:
                        delta[bos + c * BT + i, hv, v0 + j] = T.cast(df[i, j], bf16)
                for i, j in T.Parallel(BT, BV):
                    df[i, j] = df[i, j] * wv[i]
                T.copy(df, ds)  # one copy (one barrier), not a barrier a store
                for i, j in T.Parallel(K, BV):
                    hf[i, j] = hf[i, j] * decay[0]
                T.gemm(ks, ds, hf, transpose_A=True)
            store_state(hf, state, slot, hv, v0)

    @T.prim_func
    def pipelined_decay_only_kernel(
        x: T.Tensor((N, Hv, V), bf16),
        dt: T.Tensor((N, Hv), f32),
        A_log: T.Tensor((Hv,), f32),
        dt_bias: T.Tensor((Hv,), f32),
        k: T.Tensor((N, Hk, K), bf16),
        cu_seqlens: T.Tensor((B + 1,), "int32"),
        state: T.Tensor((NS, Hv, K, V), f32),
        state_slots: T.Tensor((B,), "int32"),
        h: T.Tensor((NC, Hv, K, V), bf16),
        gcum: T.Tensor((N, Hv), f32),
        dts: T.Tensor((N, Hv), f32),
        dt_min: T.float32,
        dt_max: T.float32,
    ):
        with T.Kernel(V // BV, Hv, B, threads=threads) as (bv, hv, bb):
            hf = T.alloc_fragment((K, BV), f32)
            hs = T.alloc_shared((K, BV), bf16)
            ks = T.alloc_shared((BT, K), bf16)
            xs = T.alloc_shared((BT, BV), bf16)
            ds = T.alloc_shared((BT, BV), bf16)
            D4 = T.alloc_shared((BT, GW), f32)
            dv = T.alloc_shared((BT,), f32)
            gl = T.alloc_shared((BT,), f32)
            Gs = T.alloc_shared((BT,), f32)
            wv = T.alloc_shared((BT,), f32)
            decay = T.alloc_local((1,), f32)
            scan = T.alloc_shared((BT,), f32)
            hk = hv // r
            g0 = hv - hv % GW
            gc = hv % GW
            v0 = bv * BV
            slot = state_slots[bb]
            bos = cu_seqlens[bb]
            eos = cu_seqlens[bb + 1]
            base = bos // BT + bb
            load_state(hf, state, slot, hv, v0)
            for c in T.Pipelined(T.ceildiv(eos - bos, BT), num_stages=stages):
                T.copy(k[bos + c * BT:bos + c * BT + BT, hk, 0:K], ks)
                T.copy(x[bos + c * BT:bos + c * BT + BT, hv, v0:v0 + BV], xs)
                T.copy(dt[bos + c * BT:bos + c * BT + BT, g0:g0 + GW], D4)
                # the front (0 past the sequence, and for a padding row), as the plain pass's
                for i in T.Parallel(BT):
                    dv[i] = T.if_then_else(i < eos - bos - c * BT, T.if_then_else(slot >= 0, T.min(T.max(
                        _softplus(T, D4[i, gc] + dt_bias[hv]), dt_min), dt_max), 0.0), 0.0)
                start_chunk(hf, hs, h, base, c, hv, v0)
                keys_past_the_end_cleared(ks, eos - bos - c * BT)
                decay_fold(hf, ks, xs, ds, dv, gl, Gs, wv, decay, A_log, gcum, dts, bos + c * BT,
                           T.min(BT, eos - bos - c * BT), hv, bv, scan)
            store_state(hf, state, slot, hv, v0)

    if not delta_rule:
        return pipelined_decay_only_kernel if stages else decay_only_states_kernel
    return pipelined_states_kernel if stages else gdn_prefill_states_kernel


def gdn_prefill_output(Hk: int, Hv: int, K: int = 128, V: int = 128, *, BV: int = 128, threads: int = 128,
                       delta_rule: bool = True, heads_inner: int = 0, staged: int = 0):
    """Per (chunk slot, value head, value tile): o = exp(G) q h + causal(exp(G_t - G_s) q k^T) delta (bf16).

    Args: q, k, h, delta, gcum, chunks, o (N, Hv, V).
    Decay-only (delta_rule=False, Mamba-2): delta_s = dt_s x_s, with dt_s weighing the intra-chunk products,
    and y = o + D x, neither for a padding row (its sequence on slot -1).
    Args: q (= C), k (= B), h, x, D (Hv,), gcum, dts, chunks, state_slots, o (= y).
    `heads_inner`: the grid's order (_chunk_grid). `staged` 1: o rounded into the shared tile the deltas (x)
    held and written from there by rows (16-byte stores); 0: written from the accumulator. The same values.
    """
    _check(Hk, Hv, K, V, BV)
    if staged not in (0, 1):
        raise ValueError(f"staged={staged} must be 0 or 1")
    T = _tl()
    N = T.dynamic("num_tokens")
    B = T.dynamic("batch")
    NC = T.dynamic("chunk_slots")
    r = Hv // Hk
    f32, bf16 = "float32", "bfloat16"
    grid, chunk_and_head = _chunk_grid(NC, Hv, heads_inner, V // BV)

    @T.macro
    def load_chunk(qs, ks, ds, Gs, q, k, delta, gcum, t0, L, hk, hv, v0):
        for i, d in T.Parallel(BT, K):
            qs[i, d] = T.if_then_else(i < L, q[T.min(t0 + i, N - 1), hk, d], T.cast(0.0, bf16))
            ks[i, d] = T.if_then_else(i < L, k[T.min(t0 + i, N - 1), hk, d], T.cast(0.0, bf16))
        for i, j in T.Parallel(BT, BV):
            ds[i, j] = T.if_then_else(i < L, delta[T.min(t0 + i, N - 1), hv, v0 + j], T.cast(0.0, bf16))
        for i in T.Parallel(BT):
            Gs[i] = T.if_then_else(i < L, gcum[T.min(t0 + i, N - 1), hv], 0.0)

    @T.macro
    def write_o(of, tile, o, t0, L, hv, v0):
        """The chunk's L rows of o from the accumulator; staged: by way of `tile` (shared, read already)."""
        if staged:
            T.copy(of, tile)
            for i, j in T.Parallel(BT, BV):
                if i < L:
                    o[t0 + i, hv, v0 + j] = tile[i, j]
        else:
            for i, j in T.Parallel(BT, BV):
                if i < L:
                    o[t0 + i, hv, v0 + j] = T.cast(of[i, j], bf16)

    @T.prim_func
    def gdn_prefill_output_kernel(
        q: T.Tensor((N, Hk, K), bf16),
        k: T.Tensor((N, Hk, K), bf16),
        h: T.Tensor((NC, Hv, K, V), bf16),
        delta: T.Tensor((N, Hv, V), bf16),
        gcum: T.Tensor((N, Hv), f32),
        chunks: T.Tensor((NC, CHUNK_FIELDS), "int32"),
        o: T.Tensor((N, Hv, V), bf16),
    ):
        with T.Kernel(*grid, threads=threads) as (b0, b1, bv):
            s, hv = chunk_and_head(b0, b1)
            qs = T.alloc_shared((BT, K), bf16)
            ks = T.alloc_shared((BT, K), bf16)
            hs = T.alloc_shared((K, BV), bf16)
            ds = T.alloc_shared((BT, BV), bf16)
            ps = T.alloc_shared((BT, BT), bf16)
            Gs = T.alloc_shared((BT,), f32)
            sc = T.alloc_fragment((BT, BT), f32)
            of = T.alloc_fragment((BT, BV), f32)
            t0 = chunks[s, 0]
            L = chunks[s, 1]
            if L > 0:
                hk = hv // r
                v0 = bv * BV
                load_chunk(qs, ks, ds, Gs, q, k, delta, gcum, t0, L, hk, hv, v0)
                T.copy(h[s, hv, 0:K, v0:v0 + BV], hs)
                T.gemm(qs, ks, sc, transpose_B=True, clear_accum=True)
                T.gemm(qs, hs, of, clear_accum=True)
                for i, j in T.Parallel(BT, BT):
                    ps[i, j] = T.cast(T.if_then_else(i >= j, T.exp(Gs[i] - Gs[j]) * sc[i, j], 0.0), bf16)
                for i, j in T.Parallel(BT, BV):
                    of[i, j] = of[i, j] * T.exp(Gs[i])
                T.gemm(ps, ds, of)
                write_o(of, ds, o, t0, L, hv, v0)

    @T.prim_func
    def decay_only_output_kernel(
        q: T.Tensor((N, Hk, K), bf16),
        k: T.Tensor((N, Hk, K), bf16),
        h: T.Tensor((NC, Hv, K, V), bf16),
        x: T.Tensor((N, Hv, V), bf16),
        D: T.Tensor((Hv,), f32),
        gcum: T.Tensor((N, Hv), f32),
        dts: T.Tensor((N, Hv), f32),
        chunks: T.Tensor((NC, CHUNK_FIELDS), "int32"),
        state_slots: T.Tensor((B,), "int32"),
        o: T.Tensor((N, Hv, V), bf16),
    ):
        with T.Kernel(*grid, threads=threads) as (b0, b1, bv):
            s, hv = chunk_and_head(b0, b1)
            qs = T.alloc_shared((BT, K), bf16)
            ks = T.alloc_shared((BT, K), bf16)
            hs = T.alloc_shared((K, BV), bf16)
            xs = T.alloc_shared((BT, BV), bf16)
            ps = T.alloc_shared((BT, BT), bf16)
            Gs = T.alloc_shared((BT,), f32)
            dv = T.alloc_shared((BT,), f32)
            sc = T.alloc_fragment((BT, BT), f32)
            of = T.alloc_fragment((BT, BV), f32)
            t0 = chunks[s, 0]
            L = chunks[s, 1]
            if L > 0:
                hk = hv // r
                v0 = bv * BV
                skip = T.if_then_else(state_slots[chunks[s, 2]] >= 0, D[hv], 0.0)
                load_chunk(qs, ks, xs, Gs, q, k, x, gcum, t0, L, hk, hv, v0)
                for i in T.Parallel(BT):
                    dv[i] = T.if_then_else(i < L, dts[T.min(t0 + i, N - 1), hv], 0.0)
                T.copy(h[s, hv, 0:K, v0:v0 + BV], hs)
                T.gemm(qs, ks, sc, transpose_B=True, clear_accum=True)
                T.gemm(qs, hs, of, clear_accum=True)
                for i, j in T.Parallel(BT, BT):
                    ps[i, j] = T.cast(T.if_then_else(i >= j, T.exp(Gs[i] - Gs[j]) * sc[i, j] * dv[j], 0.0), bf16)
                for i, j in T.Parallel(BT, BV):
                    of[i, j] = of[i, j] * T.exp(Gs[i])
                T.gemm(ps, xs, of)
                if staged:
                    for i, j in T.Parallel(BT, BV):
                        of[i, j] = of[i, j] + skip * T.cast(xs[i, j], f32)
                    write_o(of, xs, o, t0, L, hv, v0)
                else:
                    for i, j in T.Parallel(BT, BV):
                        if i < L:
                            o[t0 + i, hv, v0 + j] = T.cast(of[i, j] + skip * T.cast(xs[i, j], f32), bf16)

    return gdn_prefill_output_kernel if delta_rule else decay_only_output_kernel


def gdn_prefill_configs() -> list[dict]:
    """Tunables of the templates, the defaults first. states_BV sets the state pass's grid (V / BV x Hv x B
    blocks, one sequence each): a small BV feeds the SMs when few sequences run (B = 1), a large one
    halves the chunk loads per block when many do; states_stages > 0 pipelines the state pass's chunk
    loads (gdn_prefill_states' `stages`); output_BV is the output's value tile; prep_solve how the prep
    forms Tinv (gdn_prefill_prep's `solve`; "substitution" where a config names none); staged_stores how the
    prep and the output write their results (their `staged`; 0 where a config names none); heads_inner the
    prep's and the output's grid order (_chunk_grid; 0 where a config names none)."""
    first = [{"states_BV": 32, "output_BV": 128}, {"states_BV": 16, "output_BV": 64},
             {"states_BV": 64, "output_BV": 128}]
    blockwise = [dict(c, prep_solve="blockwise") for c in first]
    rest = [{"states_BV": bv, "output_BV": obv} for bv in (16, 32, 64, 128) for obv in (128, 64)]
    piped = [{"states_BV": bv, "states_stages": 2, "output_BV": 128} for bv in (32, 64, 16)]
    piped_blockwise = [dict(c, prep_solve="blockwise") for c in piped[:2]]
    heads_inner = [dict(c, heads_inner=1) for c in piped[:2]]
    staged = [dict(c, staged_stores=1) for c in piped + heads_inner + first[:1]]
    return first + blockwise + piped + piped_blockwise + heads_inner + staged + [c for c in rest if c not in first]


configs = gdn_prefill_configs
