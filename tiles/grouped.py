"""A mixture-of-experts layer's matmuls at any token count: rows sorted by expert, each expert's rows
times its own weight, every chosen expert's weight streamed from memory once for up to 64 (or 128) of its rows.

    x (M, K) rows sorted by expert; weight (E, N, K); ends (E,) int32, expert e's rows are
    ends[e - 1] .. ends[e] (ends[-1] = M); y (M, N), y[r] = x[r] . weight[e(r)]^T

This is torch._grouped_mm(x, weight.transpose(1, 2), offs=ends), the call kvbuffer's routed experts
make past a few tokens. At decode batch sizes an expert gets few rows (Nemotron-3-Nano at B = 512:
3,072 rows over 128 experts, ~24 each) and the layer is bound by reading the experts' weights. The
grouped matmul tiles the rows by 64 or 128, so most of a tile is padding and the tensor cores, not
the weight stream, set its pace; this template puts the weight in the tensor-core product's M side
and the expert's rows in its N side (a "swapped" product, y^T = W x^T), so a block of `block_t` rows
(16-64) is the only padding (measured against it: docs/kernels.md, "Routed experts at decode batch
sizes"). Routing is uneven (a popular expert gets several times the mean), so a block holds
`row_blocks` accumulators of `block_t` rows each against one weight tile and runs only those its
expert's rows fill: an expert of up to row_blocks * block_t rows has its weight read once, and one
of a few rows costs one block's products. Only an expert past that reads its weight again, once per
row_blocks * block_t rows, where the product is dense enough for the tensor cores to set the pace.

Grid: (N / block_n, E). Block (n, e) loops over expert e's rows, row_blocks * block_t at a time; for
each pass it runs a pipelined loop over K of (block_n x 64) weight tiles and (row_blocks * block_t x 64)
row tiles in shared memory, each filled row block's product into its own (block_n x block_t) fp32
accumulator, then writes the rows it holds through shared memory, coalesced along N. The row tile
is copied whole, filled or not: TileLang turns a copy under a condition into plain loads and the
pipeline waits on every tile (docs/kernels.md has the cost); rows past the expert's come from L2.
An expert with no rows costs its blocks nothing but a launch. A tile past N or past M reads zeros
and writes nothing. Copies stay off TMA (`disable_tma`), so a built artifact loads without
TileLang's compiler library (docs/artifacts.md; its cost is in the same docs/kernels.md section).
All tensors contiguous, in `dtype` (bf16 or fp16) but `ends`.
"""

# no `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations

from ..kernels.keys import GEMV_DTYPES as DTYPES, GROUPED_K as BK  # the rules the runtime checks too

F32 = "float32"

# the untuned default (docs/kernels.md, "Routed experts at decode batch sizes": busy experts of a few hundred
# rows favour 4 row blocks)
DEFAULT = {"block_n": 128, "block_t": 32, "row_blocks": 2, "stages": 4, "threads": 128}


def _tl():
    import tilelang.language as T  # noqa: N812  (TileLang's own convention)

    return T


def check_grouped(N: int, K: int, *, block_n: int = 128, block_t: int = 32, row_blocks: int = 2, stages: int = 4,
                  threads: int = 128, dtype: str = "bfloat16") -> None:
    """Raise ValueError for parameters the template does not build."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if K < BK or K % BK:
        raise ValueError(f"K must be a positive multiple of {BK} (the K step), got K={K}")
    if N < 1:
        raise ValueError(f"N must be >= 1, got {N}")
    if block_n not in (64, 128, 256) or block_t not in (16, 32, 64):
        raise ValueError(f"block_n must be 64, 128 or 256 and block_t 16, 32 or 64, got {block_n}, {block_t}")
    if row_blocks not in (1, 2, 4) or row_blocks * block_t > 128:
        raise ValueError(f"row_blocks must be 1, 2 or 4 with row_blocks * block_t <= 128 (the accumulators' "
                         f"registers), got row_blocks={row_blocks}, block_t={block_t}")
    if threads not in (128, 256) or block_n < threads // 2:
        raise ValueError(f"threads must be 128 or 256 with block_n >= threads / 2 (64 weight rows a "
                         f"warpgroup), got threads={threads}, block_n={block_n}")
    if not 2 <= stages <= 6:
        raise ValueError(f"stages must be in [2, 6], got {stages}")


def get_configs() -> list[dict]:
    """Tunables `kvbuffer tune` times, the default first."""
    out = [DEFAULT]
    for block_n, block_t, row_blocks, stages, threads in ((128, 32, 4, 3, 128), (128, 32, 4, 4, 128),
                                                          (128, 16, 4, 4, 128), (128, 32, 2, 3, 128),
                                                          (128, 32, 1, 4, 128), (64, 32, 2, 6, 128)):
        out.append({"block_n": block_n, "block_t": block_t, "row_blocks": row_blocks, "stages": stages,
                    "threads": threads})
    return out


def grouped_experts(N: int, K: int, *, block_n: int = 128, block_t: int = 32, row_blocks: int = 2, stages: int = 4,
                    threads: int = 128, dtype: str = "bfloat16"):
    """y (M, N): each row of x (M, K, sorted by expert) through its expert's weight (E, N, K), expert e
    holding rows ends[e - 1] .. ends[e]; fp32 accumulation. M and E are dynamic. Args: x, weight, ends, y."""
    check_grouped(N, K, block_n=block_n, block_t=block_t, row_blocks=row_blocks, stages=stages, threads=threads,
                  dtype=dtype)
    T = _tl()
    BN, BT, parts = block_n, block_t, [*range(row_blocks)]  # a Python list: the builder unrolls its loops
    PASS = row_blocks * BT
    M, E = T.dynamic("rows"), T.dynamic("experts")

    @T.prim_func
    def grouped_experts_kernel(x: T.Tensor((M, K), dtype), weight: T.Tensor((E, N, K), dtype),
                               ends: T.Tensor((E,), "int32"), y: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, BN), E, threads=threads) as (bx, e):
            w_s = T.alloc_shared((BN, BK), dtype)
            x_s = T.alloc_shared((PASS, BK), dtype)
            accs = [T.alloc_fragment((BN, BT), F32) for _ in parts]
            out_s = T.alloc_shared((BN, BT), dtype)
            start = T.if_then_else(e == 0, 0, ends[T.max(e - 1, 0)])
            end = ends[e]
            n0 = bx * BN
            for t in T.serial(T.ceildiv(end - start, PASS)):
                r0 = start + t * PASS
                left = end - r0  # this expert's rows from r0 on; row block p runs when it holds any
                for p in parts:
                    T.clear(accs[p])
                for k in T.Pipelined(K // BK, num_stages=stages):
                    T.copy(weight[e, n0:n0 + BN, k * BK:(k + 1) * BK], w_s, disable_tma=True)
                    # every row block's rows, filled or not: a copy under a condition would leave cp.async
                    # and the pipeline would wait for each tile (the unused rows come from L2)
                    T.copy(x[r0:r0 + PASS, k * BK:(k + 1) * BK], x_s, disable_tma=True)
                    for p in parts:
                        if left > p * BT:
                            T.gemm(w_s, x_s[p * BT:(p + 1) * BT, :], accs[p], transpose_B=True)
                for p in parts:
                    if left > p * BT:
                        T.copy(accs[p], out_s)
                        for j, i in T.Parallel(BT, BN):
                            if p * BT + j < left and n0 + i < N:
                                y[r0 + p * BT + j, n0 + i] = out_s[i, j]

    return grouped_experts_kernel
