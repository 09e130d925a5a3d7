"""The decode step's projections at one token: y = x W^T as a weight-streaming matrix-vector product.

At one row a projection reads its whole weight matrix for 2 FLOPs per weight, so it runs at the speed
the weights stream from memory. torch's GEMM (cuBLAS) picks a tiled kernel, often split along K
with a second reduce launch, and streams the smaller decode projections well below the copy
bandwidth; this template keeps every load in flight from the start (measured against it in
docs/kernels.md, "One-token projections"). It is what kvbuffer runs for a one-token forward (a B = 1
decode step), where the projections are most of the step.

Three kernels share the streaming loop:
- `gemv`: x (rows, K), weight (N, K), y (rows, N); rows is compile-time (1 for a decode step; a few
  more for the tests and the benchmark).
- `fp8_gemv`: the same product with an FP8 weight W = q * scale: q float8_e4m3fn (N, K), one fp32
  scale per (bn, bk) block, scale (ceil(N / bn), ceil(K / bk)), (bn, bk) compile-time ((128, 128):
  block FP8; (1, K): one scale per row). x stays in its dtype (weight-only dequantization in
  registers): a 16-byte chunk is 16 weights, its 16 products summed in fp32 and scaled once by the
  chunk's block scale (bk a multiple of 16, so a chunk lies in one block); with one scale column
  (bk >= K) each row's sum is scaled once, at the end. The dequantized model's product up to the
  fp32 summation order.
- `gemv_experts`: a mixture-of-experts layer at one token, each of a row's top-k experts through its
  own weight: x (S, K), weight (E, N, K), expert (S, J) int64, y (S, J, N) with
  y[s, j] = x[s] . weight[expert[s, j]]^T. S, J and E are dynamic. It reads only the chosen
  experts' weights, with no sort, gather or grouped-GEMM set-up in front (docs/kernels.md, "Routed
  experts at a few tokens"). An id outside [0, E) reads as zero weights: TileLang guards every load
  of a dynamically shaped tensor (checked on the CPU emulator, tests/kernels/test_gemv_experts.py);
  the launcher refuses such ids when checked. One block row per (s, j): S * J <= 65535.

Layout: a warp owns `per_warp` consecutive output columns (weight rows); lane l reads 16-byte chunks
l, l + 32, l + 64, ... of each of those rows, `unroll` chunks a row at a time, all issued before the
first multiply (x's matching elements with them), so a warp keeps per_warp x unroll x 512 bytes of
weights in flight. Products accumulate in fp32 per lane; a warp shuffle sums the lanes; lane 0
writes. K need not be a multiple of the 32 chunks a warp reads per pass: chunks past the row's end
are read clamped and weigh zero. All tensors contiguous, in `dtype` (bf16 or fp16) but the expert
ids, the FP8 weight and its fp32 scales.
"""

# no `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations

from ..kernels.keys import FP8_CHUNK, FP8_DTYPE  # the rules the runtime checks too
from ..kernels.keys import GEMV_CHUNK as CHUNK, GEMV_DTYPES as DTYPES

F32 = "float32"

# the untuned default: close to every measured shape's winner (docs/kernels.md, "One-token projections")
DEFAULT = {"per_warp": 2, "threads": 128, "unroll": 16}
# the FP8 kernel's: a chunk holds twice the weights, so half the chunks keep as many bytes in flight
FP8_DEFAULT = {"per_warp": 2, "threads": 128, "unroll": 8}


def _tl():
    import tilelang.language as T  # noqa: N812  (TileLang's own convention)

    return T


def check_gemv(N: int, K: int, rows: int = 1, *, per_warp: int = 2, threads: int = 128, unroll: int = 16,
               dtype: str = "bfloat16", chunk: int = CHUNK) -> None:
    """Raise ValueError for parameters the template does not build (`chunk`: weights a 16-byte load holds)."""
    if N < 1 or K < chunk or K % chunk:
        raise ValueError(f"need N >= 1 and K a positive multiple of {chunk} (16-byte rows), got N={N}, K={K}")
    if not 1 <= rows <= 8:
        raise ValueError(f"rows must be in [1, 8] (a matrix-vector product; more rows are a GEMM), got {rows}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
    if per_warp < 1 or unroll < 1:
        raise ValueError(f"per_warp and unroll must be >= 1, got {per_warp}, {unroll}")


def check_fp8_gemv(N: int, K: int, rows: int = 1, *, bn: int, bk: int, per_warp: int = 2, threads: int = 128,
                   unroll: int = 8, dtype: str = "bfloat16") -> None:
    """Raise ValueError for parameters the FP8 template does not build."""
    check_gemv(N, K, rows, per_warp=per_warp, threads=threads, unroll=unroll, dtype=dtype, chunk=FP8_CHUNK)
    if bn < 1 or bk < FP8_CHUNK or bk % FP8_CHUNK:
        raise ValueError(f"the scale block (bn, bk) needs bn >= 1 and bk a positive multiple of {FP8_CHUNK} (a "
                         f"16-byte chunk in one block), got ({bn}, {bk})")


def get_configs() -> list[dict]:
    """Tunables `kvbuffer tune` times, the default first."""
    out = [DEFAULT]
    for per_warp, threads, unroll in ((1, 128, 16), (4, 128, 16), (2, 256, 16), (2, 128, 8)):
        out.append({"per_warp": per_warp, "threads": threads, "unroll": unroll})
    return out


def get_fp8_configs() -> list[dict]:
    """Tunables `kvbuffer tune` times for the FP8 kernel, the default first."""
    out = [FP8_DEFAULT]
    for per_warp, threads, unroll in ((1, 128, 8), (4, 128, 8), (2, 256, 8), (2, 128, 4), (1, 128, 16)):
        out.append({"per_warp": per_warp, "threads": threads, "unroll": unroll})
    return out


def _streamed_products(T, N: int, K: int, rows: int, per_warp: int, unroll: int, stacked: bool,
                       block: tuple[int, int] | None = None):
    """The macro the kernels run: acc[m * per_warp + r] = x[x0 + m] . W[n0 + r] summed over the warp
    (every lane holds the sums), W = weight[e] when `stacked` (a 3-D weight), else weight; with a scale
    `block` (bn, bk), W = weight * scale block by block (an FP8 weight). Also returns the register
    lengths it is given: weights, x, and the chunks' scales and partial sums (0: none)."""
    R, M = per_warp, rows
    V = CHUNK if block is None else FP8_CHUNK  # weights a 16-byte chunk holds
    chunks = K // V                      # chunks a weight row has
    U = min(unroll, -(-chunks // 32))    # chunks a lane reads per row and pass
    passes = -(-chunks // (32 * U))
    ragged = chunks % (32 * U) != 0      # the last pass reads past the row's end (clamped, weighed 0)
    bn, bk = block or (1, K)
    per_chunk = block is not None and bk < K  # several scale columns: each chunk's sum takes its block's
    per_row = block is not None and not per_chunk  # one scale column: each row's sum takes it once
    S = 1 if bn % R == 0 else R  # a chunk's scales a lane loads: one when its R rows share a block row

    @T.macro
    def products(acc, wr, xr, sr, part, x, weight, scale, e, x0, n0, lane):
        for i in T.unroll(M * R):
            acc[i] = 0.0
        for p in T.serial(passes):
            # every load of the pass first, so they are all in flight together
            for u in T.unroll(U):
                c = T.min((p * U + u) * 32 + lane, chunks - 1) if ragged else (p * U + u) * 32 + lane
                for r in T.unroll(R):
                    for v in T.vectorized(V):
                        if stacked:
                            wr[(u * R + r) * V + v] = weight[e, T.min(n0 + r, N - 1), c * V + v]
                        else:
                            wr[(u * R + r) * V + v] = weight[T.min(n0 + r, N - 1), c * V + v]
                if per_chunk:
                    for r in T.unroll(S):
                        sr[u * S + r] = scale[T.min(n0 + r, N - 1) // bn, c * V // bk]
                for m in T.unroll(M):
                    for v in T.vectorized(V):
                        xr[(u * M + m) * V + v] = x[x0 + m, c * V + v]
            for u in T.unroll(U):
                if per_chunk:
                    for i in T.unroll(M * R):
                        part[i] = 0.0
                for m in T.unroll(M):
                    for v in T.unroll(V):
                        xv = T.cast(xr[(u * M + m) * V + v], F32)
                        if ragged:
                            xv = T.if_then_else((p * U + u) * 32 + lane < chunks, xv, T.float32(0))
                        for r in T.unroll(R):
                            if per_chunk:
                                part[m * R + r] = part[m * R + r] + T.cast(wr[(u * R + r) * V + v], F32) * xv
                            else:
                                acc[m * R + r] = acc[m * R + r] + T.cast(wr[(u * R + r) * V + v], F32) * xv
                if per_chunk:
                    for m in T.unroll(M):
                        for r in T.unroll(R):
                            acc[m * R + r] = acc[m * R + r] + part[m * R + r] * sr[u * S + r % S]
        if per_row:
            for m in T.unroll(M):
                for r in T.unroll(R):
                    acc[m * R + r] = acc[m * R + r] * scale[T.min(n0 + r, N - 1) // bn, 0]
        for i in T.unroll(M * R):
            for k in T.unroll(5):
                acc[i] = acc[i] + T.shfl_xor(acc[i], 16 >> k)

    scales = U * S if per_chunk else 0
    return products, U * R * V, U * M * V, scales, M * R if per_chunk else 0


def gemv(N: int, K: int, rows: int = 1, *, per_warp: int = 2, threads: int = 128, unroll: int = 16,
         dtype: str = "bfloat16"):
    """y (rows, N) = x (rows, K) . weight (N, K)^T, fp32 accumulation. Args: x, weight, y."""
    check_gemv(N, K, rows, per_warp=per_warp, threads=threads, unroll=unroll, dtype=dtype)
    T = _tl()
    R, M = per_warp, rows
    per_block = threads // 32 * R
    products, w_regs, x_regs, _, _ = _streamed_products(T, N, K, M, R, unroll, stacked=False)

    @T.prim_func
    def gemv_kernel(x: T.Tensor((M, K), dtype), weight: T.Tensor((N, K), dtype), y: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, per_block), threads=threads) as bx:
            tx = T.get_thread_binding()
            lane = tx % 32
            n0 = bx * per_block + tx // 32 * R
            acc = T.alloc_local((M * R,), F32)
            wr = T.alloc_local((w_regs,), dtype)
            xr = T.alloc_local((x_regs,), dtype)
            products(acc, wr, xr, None, None, x, weight, None, 0, 0, n0, lane)
            if lane == 0:
                for m in T.unroll(M):
                    for r in T.unroll(R):
                        if n0 + r < N:
                            y[m, n0 + r] = T.cast(acc[m * R + r], dtype)

    return gemv_kernel


def fp8_gemv(N: int, K: int, rows: int = 1, *, bn: int, bk: int, per_warp: int = 2, threads: int = 128,
             unroll: int = 8, dtype: str = "bfloat16"):
    """y (rows, N) = x (rows, K) . (q * scale)^T for q (N, K) float8_e4m3fn and scale (ceil(N / bn),
    ceil(K / bk)) fp32 (q[i, j] weighs scale[i // bn, j // bk]), fp32 accumulation, y in x's dtype.
    Args: x, q, scale, y."""
    check_fp8_gemv(N, K, rows, bn=bn, bk=bk, per_warp=per_warp, threads=threads, unroll=unroll, dtype=dtype)
    T = _tl()
    R, M = per_warp, rows
    per_block = threads // 32 * R
    grid = (-(-N // bn), -(-K // bk))
    products, w_regs, x_regs, s_regs, p_regs = _streamed_products(T, N, K, M, R, unroll, stacked=False,
                                                                  block=(bn, bk))

    @T.prim_func
    def fp8_gemv_kernel(x: T.Tensor((M, K), dtype), q: T.Tensor((N, K), FP8_DTYPE), scale: T.Tensor(grid, F32),
                        y: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, per_block), threads=threads) as bx:
            tx = T.get_thread_binding()
            lane = tx % 32
            n0 = bx * per_block + tx // 32 * R
            acc = T.alloc_local((M * R,), F32)
            wr = T.alloc_local((w_regs,), FP8_DTYPE)
            xr = T.alloc_local((x_regs,), dtype)
            sr = T.alloc_local((max(s_regs, 1),), F32)
            part = T.alloc_local((max(p_regs, 1),), F32)
            products(acc, wr, xr, sr, part, x, q, scale, 0, 0, n0, lane)
            if lane == 0:
                for m in T.unroll(M):
                    for r in T.unroll(R):
                        if n0 + r < N:
                            y[m, n0 + r] = T.cast(acc[m * R + r], dtype)

    return fp8_gemv_kernel


def gemv_experts(N: int, K: int, *, per_warp: int = 2, threads: int = 128, unroll: int = 16,
                 dtype: str = "bfloat16"):
    """y (S, J, N): y[s, j] = x[s] . weight[expert[s, j]]^T for x (S, K), weight (E, N, K) and the
    int64 expert ids (S, J), fp32 accumulation; one block row per (s, j). Args: x, weight, expert, y."""
    check_gemv(N, K, 1, per_warp=per_warp, threads=threads, unroll=unroll, dtype=dtype)
    T = _tl()
    R = per_warp
    per_block = threads // 32 * R
    S, J, E = T.dynamic("rows"), T.dynamic("experts_per_row"), T.dynamic("experts")
    products, w_regs, x_regs, _, _ = _streamed_products(T, N, K, 1, R, unroll, stacked=True)

    @T.prim_func
    def gemv_experts_kernel(x: T.Tensor((S, K), dtype), weight: T.Tensor((E, N, K), dtype),
                            expert: T.Tensor((S, J), "int64"), y: T.Tensor((S, J, N), dtype)):
        with T.Kernel(T.ceildiv(N, per_block), S * J, threads=threads) as (bx, by):
            tx = T.get_thread_binding()
            lane = tx % 32
            s, j = by // J, by % J
            n0 = bx * per_block + tx // 32 * R
            acc = T.alloc_local((R,), F32)
            wr = T.alloc_local((w_regs,), dtype)
            xr = T.alloc_local((x_regs,), dtype)
            products(acc, wr, xr, None, None, x, weight, None, expert[s, j], s, n0, lane)
            if lane == 0:
                for r in T.unroll(R):
                    if n0 + r < N:
                        y[s, j, n0 + r] = T.cast(acc[r], dtype)

    return gemv_experts_kernel
