"""What one compiled kernel is specialised for (`KernelKey`), and what that key means to the cache.

One key type serves every family: Gated DeltaNet ("gdn"), Mamba-2 ("mamba2"), the short conv
("conv1d"), decode attention over the KV cache ("attention") and the one-token projections
("gemv": y = x W^T; "experts": the same through each row's chosen experts; "grouped": rows sorted by
expert, each expert's rows through its weight; "fp8_gemv": y = x W^T with W an FP8 weight scaled by
block). Its `op` names the kernel within the family; its `dims` carry the family's own dimension
names (GDN's Hk, Hv, K, V; Mamba-2's G, H, N, P; the conv's D, W, span; attention's H, Hkv, D; a
projection's N, K, and an FP8 weight's scale block bn, bk). Batch, pool and cache sizes are dynamic,
so they are not part of a key. What a key means to the cache (its tune template, record shapes,
layouts, build command) is its KernelSpec's (kvbuffer.kernels.specs). PREFILL_CHUNKS, the
prompt-chunk lengths the engine feeds the kernels and `kvbuffer tune` builds, is written here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

PREFILL_CHUNKS = (8, 4, 2)  # multi-token prompt chunks (flush fused at C); a prompt's rest goes 1 token at a time
LINEAR_OPS = ("recurrent", "buffered", "flush", "recurrent_drafts", "chunk_prefill")
CONV_OPS = ("advance", "verify", "accept")
CONV_UPDATE_KINDS = {"advance": "conv_advance", "verify": "conv_verify"}  # CompiledOp.kind per conv mode
ATTENTION_OPS = ("decode", "combine")  # the per-split pass over the cache, and the merge of the splits
ATTENTION_MAX_TOKENS = 8  # new tokens per row the attention kernels take: a decode step up to a verify of 7 drafts
ATTENTION_HEAD_DIMS = (32, 64, 128, 256)  # D / 32 elements a lane
# the projection kernels by op: y = x W^T at one token; the same through each of a row's top-k experts' W;
# rows sorted by expert through their expert's W (a mixture-of-experts layer at any token count); the
# one-row product with an FP8 weight scaled by block; a block-FP8 GEMM's activations quantized per token
# and 128 columns (dims N = K, block (1, 128))
GEMV_KERNELS = {"gemv": "gemv", "experts": "gemv_experts", "grouped": "grouped_experts", "fp8_gemv": "fp8_gemv",
                "fp8_quant": "fp8_quant_act"}
GEMV_OPS = tuple(GEMV_KERNELS)
GEMV_DTYPES = ("bfloat16", "float16")  # the one-row kernel's dtypes (weight, input and output alike)
GEMV_CHUNK = 8  # elements of its 16-byte loads: K must be a multiple
FP8_DTYPE = "float8_e4m3fn"  # the FP8 one-row kernel's weight dtype (its x and output: GEMV_DTYPES)
FP8_CHUNK = 16  # FP8 weights of its 16-byte loads: K and the scale block's bk must be multiples
GROUPED_K = 64  # the grouped experts kernel's K step (tiles/grouped.py's tiles are 64 wide in K): K must be a multiple
ATTENTION_REGISTER_BUDGET = 64  # fp32 registers a lane spends on its query rows (and as many on their accumulators)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def dtype_name(t: torch.Tensor) -> str:
    return DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch."))


def check_conv_mode(mode: str) -> None:
    if mode not in CONV_UPDATE_KINDS:
        raise ValueError(f"mode must be 'advance' or 'verify', got {mode!r}")


def prefill_plan(fill: int, tokens: int, flush_at: int, kernels: bool) -> list[int]:
    """How a prefill of `tokens` tokens after `fill` buffered ones is cut: no chunk crosses a flush
    point; on the compiled kernels each chunk is one of PREFILL_CHUNKS or a single token."""
    plan = []
    while tokens:
        take = min(flush_at - fill, tokens)
        if kernels:
            take = next(s for s in (*PREFILL_CHUNKS, 1) if s <= take)
        plan.append(take)
        fill, tokens = (fill + take) % flush_at, tokens - take
    return plan


@dataclass(frozen=True)
class GDNDims:
    Hk: int  # key heads
    Hv: int  # value heads
    K: int   # key head dim
    V: int   # value head dim

    def record_fields(self) -> dict:
        return {"Hk": self.Hk, "Hv": self.Hv, "K": self.K, "V": self.V}


@dataclass(frozen=True)
class Mamba2Dims:
    G: int  # groups (B and C heads)
    H: int  # heads
    N: int  # state size
    P: int  # head dim

    def record_fields(self) -> dict:
        """Tuning records store every linear family under the generic names Hk, Hv, K, V."""
        return {"Hk": self.G, "Hv": self.H, "K": self.N, "V": self.P}


@dataclass(frozen=True)
class ConvDims:
    D: int     # channels
    W: int     # kernel width
    span: int  # pool positions per channel, W - 1 + max drafts


@dataclass(frozen=True)
class AttnDims:
    H: int    # query heads
    Hkv: int  # key / value heads (H // Hkv query heads share one)
    D: int    # head dim


def attention_shape(H: int, Hkv: int, D: int, dtype: str, kv_dtype: str) -> dict:
    """The tuning record shape of the attention kernels: heads, activations' and cache's dtypes."""
    return {"family": "attention", "H": int(H), "Hkv": int(Hkv), "D": int(D), "dtype": dtype, "kv_dtype": kv_dtype}


@dataclass(frozen=True)
class GemvDims:
    N: int       # output features (rows of the weight)
    K: int       # input features
    bn: int = 0  # an FP8 weight's scale block, rows (0: a weight without scales)
    bk: int = 0  # ... and columns: q[i, j] weighs scale[i // bn, j // bk]

    @property
    def block(self) -> tuple[int, int]:
        return self.bn, self.bk


def gemv_fits(K: int, dtype: str) -> bool:
    """Whether the one-row kernel takes a weight of K columns in `dtype` (a name, "bfloat16")."""
    return dtype in GEMV_DTYPES and K % GEMV_CHUNK == 0


def fp8_gemv_fits(K: int, block: tuple[int, int], dtype: str) -> bool:
    """Whether the FP8 one-row kernel takes an FP8 weight of K columns scaled per `block` (bn, bk) with
    x and the output in `dtype`: whole 16-byte chunks, each inside one scale block."""
    bn, bk = block
    return dtype in GEMV_DTYPES and K % FP8_CHUNK == 0 and bn >= 1 and bk >= FP8_CHUNK and bk % FP8_CHUNK == 0


def grouped_fits(K: int, dtype: str) -> bool:
    """Whether the grouped experts kernel takes experts' weights of K columns in `dtype`."""
    return dtype in GEMV_DTYPES and K % GROUPED_K == 0


def projection_shape(family: str, N: int, K: int, dtype: str, block: tuple[int, int] | None = None) -> dict:
    """The tuning record shape of a projection kernel (family "gemv", "experts", "grouped" or
    "fp8_gemv"): the weight's rows and columns (for the experts kernels one expert's, any number of
    experts and rows), and the dtype of the weight, the input and the output (fp8_gemv: of the input and
    the output; its weight is FP8 with the scale `block` (bn, bk))."""
    shape = {"family": family, "N": int(N), "K": int(K), "dtype": dtype}
    if block is not None:
        shape.update(bn=int(block[0]), bk=int(block[1]))
    return shape


GEMV_FAMILIES = GEMV_OPS  # each projection kernel's record family is its op's name


Dims = Union[GDNDims, Mamba2Dims, ConvDims, AttnDims, GemvDims]
_DIMS = {"gdn": GDNDims, "mamba2": Mamba2Dims, "conv1d": ConvDims, "attention": AttnDims, "gemv": GemvDims}
_OPS = {"gdn": LINEAR_OPS, "mamba2": LINEAR_OPS, "conv1d": CONV_OPS, "attention": ATTENTION_OPS, "gemv": GEMV_OPS}


@dataclass(frozen=True)
class KernelKey:
    """One compiled kernel's specialisation.

    family: "gdn" | "mamba2" | "conv1d" | "attention" | "gemv". op: "recurrent" | "buffered" | "flush"
    | "recurrent_drafts" | "chunk_prefill" (linear families), "advance" | "verify" | "accept" (conv1d), "decode" | "combine" (attention),
    "gemv" | "experts" | "grouped" | "fp8_gemv" (gemv). in_dtype: activations (conv: x and the pool;
    attention: q and the output; gemv: x, the weight and the output, fp8_gemv: x and the output; "" for
    a linear flush).
    buf_dtype: buffer entries (attention: the KV cache; "" for the recurrent step and the conv).
    w_dtype: the conv's weight and bias; fp8_gemv's weight, FP8_DTYPE ("" otherwise). cap: buffer entries
    per slot. T: tokens per row (conv advance: 0 = any count; gemv: rows of x, 1 for the experts
    kernels, whose rows are dynamic). C: flush_at (0: no fused flush).
    """

    family: str
    op: str
    dims: Dims
    in_dtype: str = ""
    buf_dtype: str = ""
    w_dtype: str = ""
    cap: int = 0
    T: int = 1
    C: int = 0
    has_z: bool = False
    has_bias: bool = False
    silu: bool = True

    def __post_init__(self):
        if self.family not in _DIMS:
            raise ValueError(f"family must be one of {tuple(_DIMS)}, got {self.family!r}")
        if not isinstance(self.dims, _DIMS[self.family]):
            raise TypeError(f"dims of a {self.family} key must be {_DIMS[self.family].__name__}, "
                            f"got {type(self.dims).__name__}")
        ops = _OPS[self.family]
        if self.op not in ops:
            raise ValueError(f"op of a {self.family} key must be one of {ops}, got {self.op!r}")

    @property
    def dtype(self) -> str:
        """The dtype a tuning record's shape names (activations, or the entries of a flush)."""
        return self.in_dtype or self.buf_dtype


def linear_dims(family: str, Hk: int, Hv: int, K: int, V: int) -> GDNDims | Mamba2Dims:
    """A linear family's dims from the generic (key heads, value heads, key dim, value dim) order."""
    return GDNDims(Hk, Hv, K, V) if family == "gdn" else Mamba2Dims(Hk, Hv, K, V)


ATTENTION_MMA_ROWS = (8, 48)  # query rows (G x T) a KV head for which the tensor-core form is taken


def attention_on_tensor_cores(G: int, T: int, D: int, dtype: str, kv_dtype: str) -> bool:
    """Whether the attention decode kernel runs a KV head's G x T query rows as one tensor-core tile
    (tiles/attention.py, `attention_decode_mma`, one block a KV head): 8 to 48 rows (padded to tiles
    of 16), q and the cache in one 16-bit dtype. Fewer rows stay thread-level, where a tile would be
    mostly padding; the thread-level form spends a shuffle tree per query row and loses at many."""
    lo, hi = ATTENTION_MMA_ROWS
    return (lo <= G * T and -(-G * T // 16) * 16 <= hi and D in ATTENTION_HEAD_DIMS and dtype == kv_dtype
            and dtype in ("bfloat16", "float16"))


def attention_row_blocks(G: int, T: int, D: int, dtype: str, kv_dtype: str) -> int:
    """Blocks of the attention decode kernel per (split, KV head, row): one for the tensor-core form,
    else the thread-level form's query blocks. Here because the launcher sizes its splits by it."""
    if attention_on_tensor_cores(G, T, D, dtype, kv_dtype):
        return 1
    return G * T // attention_query_block(G, T, D)


def attention_query_block(G: int, T: int, D: int) -> int:
    """Query rows per block of the attention decode kernel (tiles/attention.py): the largest divisor
    of G * T whose rows and accumulators fit the register budget (D / 32 elements of each per lane).
    Here because the launcher sizes its grid and splits by it too."""
    Q, E = G * T, D // 32
    cap = max(1, min(16, ATTENTION_REGISTER_BUDGET // E))
    return max(d for d in range(1, min(Q, cap) + 1) if Q % d == 0)
