"""The activations of a block-FP8 GEMM quantized in one pass: per token and 128 columns, to e4m3.

`fp8_quant_act`: x (M, K) bf16 / fp16 -> q (Mp, K) float8_e4m3fn and scale (K / 128, Mp) fp32, Mp = M
rounded up to ROW_MULTIPLE. `scale.t()` is the (Mp, K / 128) column-major scale_a that
torch._scaled_mm takes for 1 x 128 block-wise scaling, written in that layout here (no copy after).
Rows M .. Mp - 1 are quantized as rows of zeros. The math is kvbuffer.reference.fp8.quantize_activations,
bit for bit: per group, in fp32, amax = max |x| (a NaN propagates), s = max(amax, AMAX_FLOOR) / FP8_MAX
and q = clamp(x / s, -FP8_MAX, FP8_MAX) rounded to e4m3 (to nearest even), both divisions correctly
rounded (`__fdiv_rn`, whatever the compile flags).

Layout: a team of TEAM = 16 lanes owns one (group, row): each lane loads 8 consecutive elements (a
16-byte load), the team's max is a 4-step shuffle within its half-warp, and each lane writes its 8
bytes of q. `order` (tunable) lays the teams out: "rows", row-fastest within a group (team t: group
t // Mp, row t % Mp), so a warp's scale writes are consecutive; "groups" (the default), group-fastest
within a row (team t: row t // G, group t % G), so consecutive teams read one row's consecutive columns.
M and Mp are dynamic; K, the dtype and the block size are compile-time. One read of x and one write of q
and the scales: the kernel is bound by memory bandwidth.
"""

# no `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations

from ..kernels.keys import FP8_DTYPE  # the rules the runtime checks too
from ..reference.fp8 import AMAX_FLOOR, FP8_MAX, GROUP, ROW_MULTIPLE

F32 = "float32"
DTYPES = ("bfloat16", "float16")
TEAM = 16          # lanes per (group, row)
VEC = GROUP // TEAM  # elements a lane loads: 8 (16 bytes of bf16 / fp16)

DEFAULT = {"threads": 256, "order": "groups"}
ORDERS = ("rows", "groups")

__all__ = ["DEFAULT", "ROW_MULTIPLE", "check_fp8_quant_act", "fp8_quant_act", "get_configs"]


def check_fp8_quant_act(K: int, *, threads: int = DEFAULT["threads"], dtype: str = "bfloat16",
                        order: str = DEFAULT["order"]) -> None:
    """Raise ValueError for parameters the template does not build."""
    if K < GROUP or K % GROUP:
        raise ValueError(f"K must be a positive multiple of {GROUP} (one scale per {GROUP} columns), got {K}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def get_configs() -> list[dict]:
    """Tunables `kvbuffer tune` times, the default first."""
    return [DEFAULT] + [{"threads": t, "order": "groups"} for t in (128, 512)] + \
        [{"threads": t, "order": "rows"} for t in (256, 128, 512, 64, 1024)]


def _nan_max(T, a, b):
    """max(a, b) that returns NaN when either is NaN (CUDA's fmaxf drops it; torch's amax keeps it)."""
    s = a + b  # both are >= 0 or NaN here: s is NaN exactly when one of them is
    return T.if_then_else(T.isnan(s), s, T.max(a, b))


def fp8_quant_act(K: int, *, threads: int = DEFAULT["threads"], dtype: str = "bfloat16",
                  order: str = DEFAULT["order"]):
    """x (M, K) -> q (Mp, K) float8_e4m3fn, scale (K / GROUP, Mp) fp32 (see the module docstring).
    Args: x, q, scale."""
    check_fp8_quant_act(K, threads=threads, dtype=dtype, order=order)
    import tilelang.language as T  # noqa: N812  (TileLang's own convention)

    G = K // GROUP
    teams = threads // TEAM  # (group, row) pairs a block quantizes
    M, Mp = T.dynamic("rows"), T.dynamic("padded_rows")

    def place(team):
        """(group, row) of a team, by `order`."""
        return (team // Mp, team % Mp) if order == "rows" else (team % G, team // G)

    @T.prim_func
    def fp8_quant_act_kernel(x: T.Tensor((M, K), dtype), q: T.Tensor((Mp, K), FP8_DTYPE),
                             scale: T.Tensor((G, Mp), F32)):
        with T.Kernel(T.ceildiv(G * Mp, teams), threads=threads) as bx:
            tx = T.get_thread_binding()
            team = bx * teams + tx // TEAM
            lane = tx % TEAM
            g, row = place(team)
            xr = T.alloc_local((VEC,), dtype)
            v32 = T.alloc_local((VEC,), F32)
            amax = T.alloc_local((2,), F32)  # this lane's, and the one a shuffle brings
            qr = T.alloc_local((VEC,), FP8_DTYPE)
            col = T.min(g, G - 1) * GROUP + lane * VEC
            for v in T.vectorized(VEC):
                xr[v] = x[T.min(row, M - 1), col + v]
            amax[0] = T.float32(0)
            for v in T.unroll(VEC):
                # rows past M (and teams past the grid's end) quantize zeros
                v32[v] = T.if_then_else(row < M and team < G * Mp, T.cast(xr[v], F32), T.float32(0))
                amax[0] = _nan_max(T, amax[0], T.abs(v32[v]))
            for k in T.unroll(4):  # the shuffle alone first: every lane of the warp must run it
                amax[1] = T.shfl_xor(amax[0], (TEAM // 2) >> k)
                amax[0] = _nan_max(T, amax[0], amax[1])
            floor = T.if_then_else(amax[0] < T.float32(AMAX_FLOOR), T.float32(AMAX_FLOOR), amax[0])
            s = T.call_extern(F32, "__fdiv_rn", floor, T.float32(FP8_MAX))
            for v in T.unroll(VEC):
                y = T.call_extern(F32, "__fdiv_rn", v32[v], s)
                # a clamp that keeps NaN (fminf / fmaxf would turn it into a bound)
                y = T.if_then_else(y > T.float32(FP8_MAX), T.float32(FP8_MAX),
                                   T.if_then_else(y < T.float32(-FP8_MAX), T.float32(-FP8_MAX), y))
                qr[v] = T.cast(y, FP8_DTYPE)
            if team < G * Mp:
                for v in T.vectorized(VEC):
                    q[row, col + v] = qr[v]
                if lane == 0:
                    scale[g, row] = s

    return fp8_quant_act_kernel
