"""Decode attention over the KV cache, read in place: the family's specs, compile (`build_*`), the
reference, validated launch, CUDA launch, engine op, custom op and tuner inputs, in one module.

The kernels (tiles/attention.py) compute, for T new tokens per row, causal GQA attention over the
row's cache positions 0 .. cached[b] + t, the new keys and values already written there. Long
contexts at small batches are split across blocks (flash-decoding): `attention_decode` then writes
per-split partials and `attention_combine` merges them; `splits_for` picks the split count on the
host from the batch and the longest context, so nothing is read back from the device.

    torch.ops.kvbuffer.attention_decode(q, k_cache, v_cache, slots, cached, scale, context_len=0) -> out

reads the KV cache (its T new tokens already written) and mutates nothing; context_len bounds the rows'
positions on the host (0: the cache's max_len) and only sets how the CUDA kernel splits them.
`attention_reference` is the same math in torch, in any dtype (the tests run it in fp64).

The tuner's shape is kvbuffer.kernels.keys.attention_shape: {"family": "attention", "H", "Hkv", "D",
"dtype" (q and the output), "kv_dtype" (the cache)}; its variants are the decode step's pass and
combine (T = 1) and a verify's (T = drafts + 1, speculative layouts), on rows with awkward cached
lengths around CONTEXT, slots out of order and the split count the launcher picks at that batch on
this GPU, checked against attention_reference (the decode pass with several splits: against the
partials that reference's math gives per split, split_partials).
"""

from __future__ import annotations

import functools
import math

import torch

from ..checks import check_same_device, check_slots, check_tensor
from ..errors import ArtifactError, ShapeError
from . import autobuild
from .calls import EngineOp, capturing, implement, on_torch_stream
from .compiled import ACT_DTYPES, CompiledOp, check_contiguous, check_on_cuda, expect_kind
from .keys import (ATTENTION_MAX_TOKENS, ATTENTION_OPS, AttnDims, KernelKey, attention_row_blocks, attention_shape,
                   dtype_name)
from .lookup import kernel_for
from .specs import Family, KernelSpec, TunerVariant, configs_of, model_command, register

# ----------------------------------------------------------------------------------------------
# the specs


def _decode_args(k: KernelKey) -> dict:
    d = k.dims
    return dict(H=d.H, Hkv=d.Hkv, D=d.D, T_len=k.T, dtype=k.in_dtype, kv_dtype=k.buf_dtype)


def _combine_args(k: KernelKey) -> dict:
    return dict(H=k.dims.H, D=k.dims.D, T_len=k.T, dtype=k.in_dtype)


def _layouts(key: KernelKey) -> list:
    return [(None, key.T - 1)]


def _tune_template(key: KernelKey) -> str | None:
    """The decode step (T = 1) and the verify of T - 1 drafts + 1, each with its combine."""
    if not 1 <= key.T <= ATTENTION_MAX_TOKENS:
        return None
    return f"attention_{key.op}" + ("_verify" if key.T > 1 else "")


def _record_shapes(key: KernelKey) -> list:
    return [attention_shape(key.dims.H, key.dims.Hkv, key.dims.D, key.in_dtype, key.buf_dtype)]


RECORDS = dict(layouts=_layouts, tune_template=_tune_template, record_shapes=_record_shapes,
               tune_command=model_command(_layouts))

# their reference is attention_reference (the CPU op's)
DECODE = KernelSpec("attention_decode", "attention", "attention", "decode", "attention_decode",
                    template_args=_decode_args, defaults=lambda k: {"threads": 128, "unroll": 4},
                    configs=configs_of("attention", "get_configs"), params=lambda k: dict(_decode_args(k), T=k.T),
                    args=("q", "k_cache", "v_cache", "slots", "cached", "part", "stats", "out", "scale"),
                    custom_ops=("attention_decode",), **RECORDS)
COMBINE = KernelSpec("attention_combine", "attention", "attention", "combine", "attention_combine",
                     template_args=_combine_args, defaults=lambda k: {"threads": 128},
                     configs=lambda: [{"threads": t} for t in (128, 256)],
                     params=lambda k: dict(_combine_args(k), T=k.T), args=("part", "stats", "slots", "out"),
                     custom_ops=("attention_decode",), **RECORDS)
SPECS = (DECODE, COMBINE)


# ----------------------------------------------------------------------------------------------
# compile, the reference and validated launch


MIN_SPLIT_POSITIONS = 32  # a split reads at least this many positions (a warp step of 4 warps x 4 positions x 2)
BLOCKS_PER_SM = 1         # splits are added until the grid has about this many blocks per SM (docs/kernels.md)


def build_attention_decode(H: int, Hkv: int, D: int, T: int = 1, *, dtype: str = "bfloat16",
                           kv_dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile the per-split pass of T new tokens per row over the cache (tunables: threads, unroll)."""
    key = KernelKey("attention", "decode", AttnDims(H, Hkv, D), dtype, kv_dtype, T=T)
    return DECODE.build(key, {**DECODE.defaults(key), **tunables})


def build_attention_combine(H: int, D: int, T: int = 1, *, dtype: str = "bfloat16", **tunables) -> CompiledOp:
    """Compile the merge of the splits' partials (tunables: threads)."""
    key = KernelKey("attention", "combine", AttnDims(H, H, D), dtype, T=T)
    return COMBINE.build(key, {**COMBINE.defaults(key), **tunables})


def decode_blocks(op: CompiledOp, batch: int) -> int:
    """Blocks of the decode kernel per split: batch x Hkv x the blocks a KV head's rows take (the
    form keys.attention_on_tensor_cores picks for the op's shape and dtypes)."""
    G = op["H"] // op["Hkv"]
    return batch * op["Hkv"] * attention_row_blocks(G, op["T"], op["D"], op["dtype"], op["kv_dtype"])


def splits_for(blocks: int, context: int, sm_count: int) -> int:
    """How many splits each row's positions get: 1 once `blocks` (B x Hkv x query blocks) fill the GPU,
    else enough for about BLOCKS_PER_SM blocks per SM, each reading at least MIN_SPLIT_POSITIONS of
    the `context` positions (the longest row's, an upper bound known on the host)."""
    want = math.ceil(BLOCKS_PER_SM * sm_count / max(blocks, 1))
    return max(1, min(want, math.ceil(context / MIN_SPLIT_POSITIONS)))


def attention_reference(q, k_cache, v_cache, slots, cached, scale: float) -> torch.Tensor:
    """The kernels' math in torch, in q's dtype (fp64 for the tests): out (B, T, H, D), zeros for padding rows."""
    B, T, H, D = q.shape
    Hkv = k_cache.shape[2]
    out = torch.zeros_like(q)
    for b in range(B):
        slot = int(slots[b])
        if slot < 0:
            continue
        n = int(cached[b]) + T
        keys = k_cache[slot, :n].to(q.dtype).repeat_interleave(H // Hkv, dim=1)  # (n, H, D)
        vals = v_cache[slot, :n].to(q.dtype).repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("thd,nhd->thn", q[b], keys) * scale
        ahead = torch.arange(n, device=q.device)[None, :] > (n - T + torch.arange(T, device=q.device))[:, None]
        scores = scores.masked_fill(ahead[:, None, :], float("-inf"))
        out[b] = torch.einsum("thn,nhd->thd", torch.softmax(scores, dim=-1), vals)
    return out


def _check_inputs(op: CompiledOp, q, k_cache, v_cache, slots, cached, checked: bool):
    p = op.params
    dev = q.device if isinstance(q, torch.Tensor) else None
    check_tensor("q", q, (None, p["T"], p["H"], p["D"]), (ACT_DTYPES[p["dtype"]],), dev)
    check_on_cuda("q", dev)
    B = q.shape[0]
    kv = (ACT_DTYPES[p["kv_dtype"]],)
    check_tensor("k_cache", k_cache, (None, None, p["Hkv"], p["D"]), kv, dev)
    check_tensor("v_cache", v_cache, tuple(k_cache.shape), kv, dev)
    check_tensor("slots", slots, (B,), (torch.int32,), dev)
    check_tensor("cached", cached, (B,), (torch.int32,), dev)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots), ("cached", cached)):
        check_contiguous(name, t)
    if checked and B:  # these read the device back
        check_slots("slots", slots, B, k_cache.shape[0], dev)
        check_cached_range(slots, cached, p["T"], k_cache.shape[1])
    return B


def check_cached_range(slots, cached, T: int, max_len: int) -> None:
    """Every real row's T new tokens must lie in its cache: 0 <= cached, cached + T <= max_len (reads
    the device back). Summed in int64: an int32 `cached` near 2**31 - 1 must not wrap into range."""
    end = cached.long() + T
    bad = (slots >= 0) & ((end < T) | (end > max_len))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ShapeError(f"cached + T must lie in [T, max_len={max_len}] for every real row (T={T}), "
                         f"got cached {int(cached[row])} in row {row}")


def attention_decode(op: CompiledOp, combine: CompiledOp | None, q, k_cache, v_cache, slots, cached, scale: float,
                     out=None, *, splits: int = 1, checked: bool = True) -> torch.Tensor:
    """out (B, T, H, D) = softmax(q k^T * scale) v over each row's cache positions 0 .. cached[b] + t.

    q (B, T, H, D); k_cache, v_cache (NS, max_len, Hkv, D), the T new tokens already at cached[b] ..;
    slots, cached (B,) int32, slot -1 a padding row (zero output, nothing read). splits > 1 needs the
    `combine` kernel built for the same H, D, T and dtype. checked=False skips the checks that read
    the device back (slot range, cached in range): for engine-built rows and CUDA-graph capture.
    """
    expect_kind(op, "attention_decode")
    B = _check_inputs(op, q, k_cache, v_cache, slots, cached, checked)
    p = op.params
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive int, got {splits!r}")
    if splits > 1:
        expect_kind(combine, "attention_combine")
        mismatch = {k: (combine[k], p[k]) for k in ("H", "D", "T", "dtype") if combine[k] != p[k]}
        if mismatch:
            raise ShapeError(f"the combine kernel was built for other parameters (combine, decode): {mismatch}")
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor("out", out, tuple(q.shape), (q.dtype,), q.device)
        check_contiguous("out", out)
    if not B:
        return out
    rows = B if splits > 1 else 1  # with one split the workspace is not read: a 1-row stand-in
    part = torch.empty(rows, splits, p["T"] * p["H"], p["D"], dtype=torch.float32, device=q.device)
    stats = torch.empty(rows, splits, p["T"] * p["H"], 2, dtype=torch.float32, device=q.device)
    op.fn(q, k_cache, v_cache, slots, cached, part, stats, out, float(scale))
    if splits > 1:
        combine.fn(part, stats, slots, out)
    return out


def attention_batch_checks(q, k_cache, v_cache, slots, cached) -> None:
    """What every call must satisfy whatever the kernel: GQA heads, one head dim, T within the kernels'."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots), ("cached", cached)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ShapeError(f"q must be (B, T, H, D) and k_cache (NS, max_len, Hkv, D), got {tuple(q.shape)} and "
                         f"{tuple(k_cache.shape)}")
    B, T, H, D = q.shape
    if k_cache.shape[3] != D or H % k_cache.shape[2]:
        raise ShapeError(f"q's heads ({H}) must be a multiple of the cache's ({k_cache.shape[2]}) and both head "
                         f"dims equal, got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ShapeError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if not 1 <= T <= ATTENTION_MAX_TOKENS:
        raise ShapeError(f"the attention kernels take 1 .. {ATTENTION_MAX_TOKENS} new tokens per row, got T={T}")
    if slots.shape != (B,) or cached.shape != (B,):
        raise ShapeError(f"slots and cached must have shape ({B},), got {tuple(slots.shape)} and "
                         f"{tuple(cached.shape)}")


# ----------------------------------------------------------------------------------------------
# the CUDA launch: the kernels looked up for the arguments' shapes, then run on torch's stream


def attention_key(spec: KernelSpec, q, k_cache) -> KernelKey:
    """The kernel an attention_decode call needs of `spec` (DECODE, the pass over the cache, or COMBINE)."""
    B, T, H, D = q.shape
    return KernelKey(spec.family, spec.op, AttnDims(H, k_cache.shape[2], D), dtype_name(q), dtype_name(k_cache), T=T)


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_decode(q, k_cache, v_cache, slots, cached, scale, context_len=0, *, checked=True):
    """Attention of q's T new tokens over each row's cache, read in place; context_len (0: the cache's
    max_len) bounds the rows' positions on the host and sets the split count."""
    B = q.shape[0]
    op = kernel(attention_key(DECODE, q, k_cache), B)
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    splits = splits_for(decode_blocks(op, B), context_len or k_cache.shape[1], _sm_count(device))
    combine = kernel(attention_key(COMBINE, q, k_cache), B) if splits > 1 else None
    return on_torch_stream(attention_decode, op, combine, q, k_cache, v_cache, slots, cached, scale, splits=splits,
                           checked=checked and not capturing())


def kernel(key: KernelKey, batch: int):
    """kernel_for, building the attention kernels of `key`'s token count once into the artifact cache
    when they are missing (autobuild.ensure_attention_kernels), outside a CUDA-graph capture: a compiled
    forward skips the Backend's eager check, and its warm-up must not fail on an unbuilt verify."""
    try:
        return kernel_for(key, batch)
    except ArtifactError:
        if capturing() or autobuild.ensure_attention_kernels(key) is not None:
            raise
        return kernel_for(key, batch)


# ----------------------------------------------------------------------------------------------
# the custom op (CPU: the reference, with its checks; CUDA: launch_decode) and the engine's call


@torch.library.custom_op("kvbuffer::attention_decode", mutates_args=(), device_types="cpu")
def decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              cached: torch.Tensor, scale: float, context_len: int = 0) -> torch.Tensor:
    """attention_reference: q (B, T, H, D) over each row's cache positions 0 .. cached[b] + t -> (B, T, H, D);
    slot -1 rows give zeros."""
    _meta_checks(dict(q=q, k_cache=k_cache, v_cache=v_cache, slots=slots, cached=cached))
    check_slots("slots", slots, q.shape[0], k_cache.shape[0], k_cache.device)
    check_cached_range(slots, cached, q.shape[1], k_cache.shape[1])
    return attention_reference(q, k_cache, v_cache, slots, cached, scale).contiguous()


def _meta_checks(args: dict) -> None:
    check_same_device(args)
    attention_batch_checks(args["q"], args["k_cache"], args["v_cache"], args["slots"], args["cached"])


implement(decode_op, lambda a: attention_batch_checks(a["q"], a["k_cache"], a["v_cache"], a["slots"], a["cached"]),
          lambda a: torch.empty_like(a["q"]), launch_decode)
ATTENTION_DECODE = EngineOp(launch_decode, lambda: torch.ops.kvbuffer.attention_decode)


# ----------------------------------------------------------------------------------------------
# the tuner's inputs and expected outputs, by argument name


CONTEXT = 512  # cached positions per row when tuning (rows hold CONTEXT / 2 .. CONTEXT)
LOG2E = 1.4426950408889634


def _tokens(T: int | None, drafts: int) -> int:
    return drafts + 1 if T is None else T


def _key(op: str, T: int | None):
    return lambda shape, chunk, drafts: KernelKey(
        "attention", op, AttnDims(shape["H"], shape["Hkv"], shape["D"]), shape["dtype"], shape["kv_dtype"],
        T=_tokens(T, drafts))


def _splits(shape, batch: int, T: int, device) -> int:
    blocks = decode_blocks({k: shape[k] for k in ("H", "Hkv", "D", "dtype", "kv_dtype")} | {"T": T}, batch)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if torch.device(device).type == "cuda" else 132
    return splits_for(blocks, CONTEXT + T, sms)


def _cache(shape, batch, T, device, gen):
    """q, k_cache, v_cache, slots (a permutation), cached (CONTEXT / 2 .. CONTEXT positions)."""
    dt, kvt = getattr(torch, shape["dtype"]), getattr(torch, shape["kv_dtype"])
    H, Hkv, D = shape["H"], shape["Hkv"], shape["D"]
    kc = torch.randn(batch, CONTEXT + T, Hkv, D, generator=gen, device=device).to(kvt)
    vc = torch.randn(batch, CONTEXT + T, Hkv, D, generator=gen, device=device).to(kvt)
    q = torch.randn(batch, T, H, D, generator=gen, device=device).to(dt)
    slots = torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)
    cached = torch.randint(CONTEXT // 2, CONTEXT + 1, (batch,), generator=gen, device=device, dtype=torch.int32)
    return q, kc, vc, slots, cached


def _decode_inputs(T: int | None):
    def inputs(shape, batch, chunk_size, device, gen, drafts=0):
        tokens = _tokens(T, drafts)
        q, kc, vc, slots, cached = _cache(shape, batch, tokens, device, gen)
        S = _splits(shape, batch, tokens, device)
        rows, TH = batch if S > 1 else 1, tokens * shape["H"]
        part = torch.zeros(rows, S, TH, shape["D"], device=device)
        stats = torch.zeros(rows, S, TH, 2, device=device)
        return dict(q=q, k_cache=kc, v_cache=vc, slots=slots, cached=cached, part=part, stats=stats,
                    out=torch.zeros_like(q), scale=shape["D"] ** -0.5)
    return inputs


def split_partials(q, kc, vc, slots, cached, scale: float, splits: int):
    """What the decode pass writes with several splits, in fp64: per (row, split, t * H + h) the
    accumulator sum_p 2^(s_p - M) v_p, the max M of the visible log2-domain scores s_p (-1e30: none)
    and the sum sum_p 2^(s_p - M). A split covers ceil(n / S) of the row's n = cached + T positions."""
    B, T, H, D = q.shape
    G = H // kc.shape[2]
    part = torch.zeros(B, splits, T * H, D, dtype=torch.float64, device=q.device)
    stats = torch.zeros(B, splits, T * H, 2, dtype=torch.float64, device=q.device)
    stats[..., 0] = -1e30
    for b in range(B):
        slot, n = int(slots[b]), int(cached[b]) + T
        chunk = -(-n // splits)
        keys = kc[slot, :n].double().repeat_interleave(G, dim=1)  # (n, H, D)
        vals = vc[slot, :n].double().repeat_interleave(G, dim=1)
        s = torch.einsum("thd,nhd->thn", q[b].double(), keys) * scale * LOG2E  # (T, H, n)
        for t in range(T):
            for sp in range(splits):
                lo, hi = sp * chunk, min(n, sp * chunk + chunk, n - T + t + 1)
                if lo >= hi:
                    continue
                m = s[t, :, lo:hi].max(dim=-1).values  # (H,)
                w = torch.exp2(s[t, :, lo:hi] - m[:, None])
                part[b, sp, t * H:(t + 1) * H] = torch.einsum("hn,nhd->hd", w, vals[lo:hi])
                stats[b, sp, t * H:(t + 1) * H, 0] = m
                stats[b, sp, t * H:(t + 1) * H, 1] = w.sum(-1)
    return part, stats


def _decode_reference(shape, chunk_size, args):
    q, kc, vc, slots, cached, part = (args[n] for n in ("q", "k_cache", "v_cache", "slots", "cached", "part"))
    if part.shape[1] == 1:
        return {"out": attention_reference(q.double(), kc.double(), vc.double(), slots, cached, args["scale"])}
    want_part, want_stats = split_partials(q, kc, vc, slots, cached, args["scale"], part.shape[1])
    return {"part": want_part, "stats": want_stats}


def _combine_inputs(T: int | None):
    def inputs(shape, batch, chunk_size, device, gen, drafts=0):
        tokens = _tokens(T, drafts)
        S = max(2, _splits(shape, batch, tokens, device))
        TH = tokens * shape["H"]
        part = torch.randn(batch, S, TH, shape["D"], generator=gen, device=device)
        stats = torch.stack([4 * torch.randn(batch, S, TH, generator=gen, device=device),
                             1 + torch.rand(batch, S, TH, generator=gen, device=device)], dim=-1)
        slots = torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)
        out = torch.zeros(batch, tokens, shape["H"], shape["D"], device=device).to(getattr(torch, shape["dtype"]))
        return dict(part=part, stats=stats, slots=slots, out=out)
    return inputs


def _combine_reference(shape, chunk_size, args):
    part, stats, slots, out = (args[n] for n in ("part", "stats", "slots", "out"))
    w = torch.exp2(stats[..., 0].double() - stats[..., 0].double().max(dim=1, keepdim=True).values)  # (B, S, TH)
    merged = (w[..., None] * part.double()).sum(1) / (w * stats[..., 1].double()).sum(1)[..., None]
    merged = torch.where(slots[:, None, None] >= 0, merged, torch.zeros((), dtype=merged.dtype, device=merged.device))
    return {"out": merged.reshape(out.shape)}


def _variants(package: str) -> list[TunerVariant]:
    def pair(suffix: str, T: int | None, **extra) -> list[TunerVariant]:
        options = dict(package=package, uses_chunk=False, **extra)
        return [TunerVariant(DECODE, f"attention_decode{suffix}", "attention", _key("decode", T), _decode_inputs(T),
                             _decode_reference, options),
                TunerVariant(COMBINE, f"attention_combine{suffix}", "attention", _key("combine", T), _combine_inputs(T),
                             _combine_reference, options)]

    return pair("", 1) + pair("_verify", None, layouts=True, min_drafts=1)


FAMILY = register(Family("attention", AttnDims, ATTENTION_OPS, SPECS, {"attention_decode": launch_decode}, _variants))
