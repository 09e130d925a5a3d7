"""A mixture-of-experts layer's matmuls at any token count: rows sorted by expert, each expert's rows
times its own weight, every chosen expert's weight streamed from memory once per block of rows.

    x (M, K) rows sorted by expert; weight (E, N, K); ends (E,) int32, expert e's rows are
    ends[e - 1] .. ends[e] (ends[-1] = M); y (M, N), y[r] = x[r] . weight[e(r)]^T

This is torch._grouped_mm(x, weight.transpose(1, 2), offs=ends), the call kvbuffer's routed experts
make past a few tokens. At decode batch sizes an expert gets few rows (Nemotron-3-Nano at B = 512:
3,072 rows over 128 experts, ~24 each) and the layer is bound by reading the experts' weights. The
grouped matmul tiles the rows by 64 or 128, so most of a tile is padding and the tensor cores, not
the weight stream, set its pace; this template puts the weight in the tensor-core product's M side
and the expert's rows in its N side (a "swapped" product, y^T = W x^T), so a block of `block_t` rows
(16-64) is the only padding (measured against it: docs/kernels.md, "Routed experts at decode batch
sizes"). A block streams its weight tile once per `block_t` of its expert's rows, so an expert with
more rows reads its weight again: the engine stops at a few hundred tokens (GROUPED_TOKENS).

Grid: (N / block_n, E). Block (n, e) loops over expert e's rows, `block_t` at a time; for each it
runs a pipelined loop over K of (block_n x 64) weight tiles and (block_t x 64) row tiles
in shared memory into a (block_n x block_t) fp32 accumulator, then writes the rows it holds
through shared memory, coalesced along N. An expert with no rows costs its blocks nothing but a
launch. A tile past N or past M reads zeros and writes nothing. Copies stay off TMA
(`disable_tma`), so a built artifact loads without TileLang's compiler library (docs/artifacts.md;
its cost is in the same docs/kernels.md section). All tensors contiguous, in `dtype` (bf16 or fp16) but `ends`.
"""

# no `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations

from ..kernels.keys import GEMV_DTYPES as DTYPES, GROUPED_K as BK  # the rules the runtime checks too

F32 = "float32"

# the untuned default: the best or close to it at every shape and batch measured (docs/kernels.md)
DEFAULT = {"block_n": 128, "block_t": 32, "stages": 4, "threads": 128}


def _tl():
    import tilelang.language as T  # noqa: N812  (TileLang's own convention)

    return T


def check_grouped(N: int, K: int, *, block_n: int = 128, block_t: int = 32, stages: int = 4, threads: int = 128,
                  dtype: str = "bfloat16") -> None:
    """Raise ValueError for parameters the template does not build."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if K < BK or K % BK:
        raise ValueError(f"K must be a positive multiple of {BK} (the K step), got K={K}")
    if N < 1:
        raise ValueError(f"N must be >= 1, got {N}")
    if block_n not in (64, 128, 256) or block_t not in (16, 32, 64):
        raise ValueError(f"block_n must be 64, 128 or 256 and block_t 16, 32 or 64, got {block_n}, {block_t}")
    if threads not in (128, 256) or block_n < threads // 2:
        raise ValueError(f"threads must be 128 or 256 with block_n >= threads / 2 (64 weight rows a "
                         f"warpgroup), got threads={threads}, block_n={block_n}")
    if not 2 <= stages <= 6:
        raise ValueError(f"stages must be in [2, 6], got {stages}")


def get_configs() -> list[dict]:
    """Tunables `kvbuffer tune` times, the default first."""
    out = [DEFAULT]
    for block_n, block_t, stages, threads in ((128, 16, 4, 128), (128, 64, 4, 128), (64, 32, 6, 128),
                                              (256, 32, 3, 256), (128, 32, 6, 128)):
        out.append({"block_n": block_n, "block_t": block_t, "stages": stages, "threads": threads})
    return out


def grouped_experts(N: int, K: int, *, block_n: int = 128, block_t: int = 32, stages: int = 4, threads: int = 128,
                    dtype: str = "bfloat16"):
    """y (M, N): each row of x (M, K, sorted by expert) through its expert's weight (E, N, K), expert e
    holding rows ends[e - 1] .. ends[e]; fp32 accumulation. M and E are dynamic. Args: x, weight, ends, y."""
    check_grouped(N, K, block_n=block_n, block_t=block_t, stages=stages, threads=threads, dtype=dtype)
    T = _tl()
    BN, BT = block_n, block_t
    M, E = T.dynamic("rows"), T.dynamic("experts")

    @T.prim_func
    def grouped_experts_kernel(x: T.Tensor((M, K), dtype), weight: T.Tensor((E, N, K), dtype),
                               ends: T.Tensor((E,), "int32"), y: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, BN), E, threads=threads) as (bx, e):
            w_s = T.alloc_shared((BN, BK), dtype)
            x_s = T.alloc_shared((BT, BK), dtype)
            acc = T.alloc_fragment((BN, BT), F32)
            out_s = T.alloc_shared((BN, BT), dtype)
            start = T.if_then_else(e == 0, 0, ends[T.max(e - 1, 0)])
            end = ends[e]
            n0 = bx * BN
            for t in T.serial(T.ceildiv(end - start, BT)):
                r0 = start + t * BT
                T.clear(acc)
                for k in T.Pipelined(K // BK, num_stages=stages):
                    T.copy(weight[e, n0:n0 + BN, k * BK:(k + 1) * BK], w_s, disable_tma=True)
                    T.copy(x[r0:r0 + BT, k * BK:(k + 1) * BK], x_s, disable_tma=True)
                    T.gemm(w_s, x_s, acc, transpose_B=True)
                T.copy(acc, out_s)
                for j, i in T.Parallel(BT, BN):
                    if r0 + j < end and n0 + i < N:
                        y[r0 + j, n0 + i] = out_s[i, j]

    return grouped_experts_kernel
