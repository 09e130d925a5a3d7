"""The decode step's projections at one token: y = x W^T as a weight-streaming matrix-vector product.

At one row a projection reads its whole weight matrix for 2 FLOPs per weight, so it runs at the speed
the weights stream from memory. torch's GEMM (cuBLAS) picks a tiled kernel, often split along K
with a second reduce launch, and streams the smaller decode projections well below the copy
bandwidth; this template keeps every load in flight from the start (measured against it in
docs/kernels.md, "One-token projections"). It is what kvbuffer runs for a one-token forward (a B = 1
decode step), where the projections are most of the step.

Two kernels share the streaming loop:
- `gemv`: x (rows, K), weight (N, K), y (rows, N); rows is compile-time (1 for a decode step; a few
  more for the tests and the benchmark).
- `gemv_experts`: a mixture-of-experts layer at one token, each of a row's top-k experts through its
  own weight: x (S, K), weight (E, N, K), expert (S, J) int64, y (S, J, N) with
  y[s, j] = x[s] . weight[expert[s, j]]^T. S, J and E are dynamic. It reads only the chosen
  experts' weights, with no sort, gather or grouped-GEMM set-up in front (docs/kernels.md, "Routed
  experts at a few tokens"). An id outside [0, E) reads as zero weights: TileLang guards every load
  of a dynamically shaped tensor (checked on the CPU emulator, tests/kernels/test_gemv_experts.py);
  the launcher refuses such ids when checked. One block row per (s, j): S * J <= 65535.

Layout: a warp owns `per_warp` consecutive output columns (weight rows); lane l reads 16-byte chunks
l, l + 32, l + 64, ... of each of those rows, `unroll` chunks a row at a time, all issued before the
first multiply, so a warp keeps per_warp x unroll x 512 bytes in flight. Products accumulate in
fp32 per lane; a warp shuffle sums the lanes; lane 0 writes. K need not be a multiple of the 256
elements a warp reads per pass: chunks past the row's end are read clamped and weigh zero.
All tensors contiguous, in `dtype` (bf16 or fp16) but the expert ids.
"""

# no `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations

from ..kernels.keys import GEMV_CHUNK as CHUNK, GEMV_DTYPES as DTYPES  # the rule the runtime checks too

F32 = "float32"

# the untuned default: close to every measured shape's winner (docs/kernels.md, "One-token projections")
DEFAULT = {"per_warp": 2, "threads": 128, "unroll": 16}


def _tl():
    import tilelang.language as T  # noqa: N812  (TileLang's own convention)

    return T


def check_gemv(N: int, K: int, rows: int = 1, *, per_warp: int = 2, threads: int = 128, unroll: int = 16,
               dtype: str = "bfloat16") -> None:
    """Raise ValueError for parameters the template does not build."""
    if N < 1 or K < CHUNK or K % CHUNK:
        raise ValueError(f"need N >= 1 and K a positive multiple of {CHUNK} (16-byte rows), got N={N}, K={K}")
    if not 1 <= rows <= 8:
        raise ValueError(f"rows must be in [1, 8] (a matrix-vector product; more rows are a GEMM), got {rows}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
    if per_warp < 1 or unroll < 1:
        raise ValueError(f"per_warp and unroll must be >= 1, got {per_warp}, {unroll}")


def get_configs() -> list[dict]:
    """Tunables `kvbuffer tune` times, the default first."""
    out = [DEFAULT]
    for per_warp, threads, unroll in ((1, 128, 16), (4, 128, 16), (2, 256, 16), (2, 128, 8)):
        out.append({"per_warp": per_warp, "threads": threads, "unroll": unroll})
    return out


def _streamed_products(T, N: int, K: int, rows: int, per_warp: int, unroll: int, dtype: str, stacked: bool):
    """The macro both kernels run: acc[m * per_warp + r] = x[x0 + m] . W[n0 + r] summed over the warp
    (every lane holds the sums), W = weight[e] when `stacked` (a 3-D weight), else weight."""
    R, M, V = per_warp, rows, CHUNK
    chunks = K // V                      # 16-byte chunks a weight row has
    U = min(unroll, -(-chunks // 32))    # chunks a lane reads per row and pass
    passes = -(-chunks // (32 * U))
    ragged = chunks % (32 * U) != 0      # the last pass reads past the row's end (clamped, weighed 0)

    @T.macro
    def products(acc, wr, xr, x, weight, e, x0, n0, lane):
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
                for m in T.unroll(M):
                    for v in T.vectorized(V):
                        xr[(u * M + m) * V + v] = x[x0 + m, c * V + v]
            for u in T.unroll(U):
                for m in T.unroll(M):
                    for v in T.unroll(V):
                        xv = T.cast(xr[(u * M + m) * V + v], F32)
                        if ragged:
                            xv = T.if_then_else((p * U + u) * 32 + lane < chunks, xv, T.float32(0))
                        for r in T.unroll(R):
                            acc[m * R + r] = acc[m * R + r] + T.cast(wr[(u * R + r) * V + v], F32) * xv
        for i in T.unroll(M * R):
            for k in T.unroll(5):
                acc[i] = acc[i] + T.shfl_xor(acc[i], 16 >> k)

    return products, U * R * V, U * M * V


def gemv(N: int, K: int, rows: int = 1, *, per_warp: int = 2, threads: int = 128, unroll: int = 16,
         dtype: str = "bfloat16"):
    """y (rows, N) = x (rows, K) . weight (N, K)^T, fp32 accumulation. Args: x, weight, y."""
    check_gemv(N, K, rows, per_warp=per_warp, threads=threads, unroll=unroll, dtype=dtype)
    T = _tl()
    R, M = per_warp, rows
    per_block = threads // 32 * R
    products, w_regs, x_regs = _streamed_products(T, N, K, M, R, unroll, dtype, stacked=False)

    @T.prim_func
    def gemv_kernel(x: T.Tensor((M, K), dtype), weight: T.Tensor((N, K), dtype), y: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, per_block), threads=threads) as bx:
            tx = T.get_thread_binding()
            lane = tx % 32
            n0 = bx * per_block + tx // 32 * R
            acc = T.alloc_local((M * R,), F32)
            wr = T.alloc_local((w_regs,), dtype)
            xr = T.alloc_local((x_regs,), dtype)
            products(acc, wr, xr, x, weight, 0, 0, n0, lane)
            if lane == 0:
                for m in T.unroll(M):
                    for r in T.unroll(R):
                        if n0 + r < N:
                            y[m, n0 + r] = T.cast(acc[m * R + r], dtype)

    return gemv_kernel


def gemv_experts(N: int, K: int, *, per_warp: int = 2, threads: int = 128, unroll: int = 16,
                 dtype: str = "bfloat16"):
    """y (S, J, N): y[s, j] = x[s] . weight[expert[s, j]]^T for x (S, K), weight (E, N, K) and the
    int64 expert ids (S, J), fp32 accumulation; one block row per (s, j). Args: x, weight, expert, y."""
    check_gemv(N, K, 1, per_warp=per_warp, threads=threads, unroll=unroll, dtype=dtype)
    T = _tl()
    R = per_warp
    per_block = threads // 32 * R
    S, J, E = T.dynamic("rows"), T.dynamic("experts_per_row"), T.dynamic("experts")
    products, w_regs, x_regs = _streamed_products(T, N, K, 1, R, unroll, dtype, stacked=True)

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
            products(acc, wr, xr, x, weight, expert[s, j], s, n0, lane)
            if lane == 0:
                for r in T.unroll(R):
                    if n0 + r < N:
                        y[s, j, n0 + r] = T.cast(acc[r], dtype)

    return gemv_experts_kernel
