"""The decode attention kernels (tiles/attention.py) as tuner templates, family "attention".

Their shape is kvbuffer.kernels.keys.attention_shape: {"family": "attention", "H", "Hkv", "D", "dtype"
(q and the output), "kv_dtype" (the cache)}. The kernels depend on the buffer layout only through the
tokens a row feeds (T = drafts + 1 for a verify), and on no chunk size:

    attention_decode           decode step (T = 1): the pass over the cache, per split
    attention_combine          the merge of the splits' partials (T = 1)
    attention_decode_verify    the same for a verify of T drafts + the last token (speculative layouts)
    attention_combine_verify

Inputs: rows with awkward cached lengths around CONTEXT, slots out of order, the split count the
launcher picks at that batch on this GPU (kvbuffer.kernels.attention.splits_for), so the timings are
the engine's. The check compares against kvbuffer.kernels.attention.attention_reference (the decode
pass with several splits: against the partials that reference's math gives per split).
"""

from __future__ import annotations

import importlib.util

from kvbuffer.kernels.keys import AttnDims, KernelKey
from kvbuffer.kernels.specs import SPECS

from .template import Template, from_spec

ATTENTION_TILES = "kvbuffer.tiles.attention"
CONTEXT = 512  # cached positions per row when tuning (rows hold CONTEXT / 2 .. CONTEXT)
LOG2E = 1.4426950408889634


def _tokens(T: int | None, drafts: int) -> int:
    return drafts + 1 if T is None else T


def _key(op: str, T: int | None):
    return lambda shape, chunk, drafts: KernelKey(
        "attention", op, AttnDims(shape["H"], shape["Hkv"], shape["D"]), shape["dtype"], shape["kv_dtype"],
        T=_tokens(T, drafts))


def _splits(shape, batch: int, T: int, device) -> int:
    import torch

    from kvbuffer.kernels.attention import decode_blocks, splits_for

    blocks = decode_blocks({k: shape[k] for k in ("H", "Hkv", "D", "dtype", "kv_dtype")} | {"T": T}, batch)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if torch.device(device).type == "cuda" else 132
    return splits_for(blocks, CONTEXT + T, sms)


def _cache(shape, batch, T, device, gen):
    """q, k_cache, v_cache, slots (a permutation), cached (CONTEXT / 2 .. CONTEXT positions)."""
    import torch

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
        import torch

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
    import torch

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
    from kvbuffer.kernels.attention import attention_reference

    q, kc, vc, slots, cached, part = (args[n] for n in ("q", "k_cache", "v_cache", "slots", "cached", "part"))
    if part.shape[1] == 1:
        return {"out": attention_reference(q.double(), kc.double(), vc.double(), slots, cached, args["scale"])}
    want_part, want_stats = split_partials(q, kc, vc, slots, cached, args["scale"], part.shape[1])
    return {"part": want_part, "stats": want_stats}


def _combine_inputs(T: int | None):
    def inputs(shape, batch, chunk_size, device, gen, drafts=0):
        import torch

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
    import torch

    part, stats, slots, out = (args[n] for n in ("part", "stats", "slots", "out"))
    w = torch.exp2(stats[..., 0].double() - stats[..., 0].double().max(dim=1, keepdim=True).values)  # (B, S, TH)
    merged = (w[..., None] * part.double()).sum(1) / (w * stats[..., 1].double()).sum(1)[..., None]
    merged = torch.where(slots[:, None, None] >= 0, merged, torch.zeros((), dtype=merged.dtype, device=merged.device))
    return {"out": merged.reshape(out.shape)}


def attention_templates() -> list[Template]:
    if importlib.util.find_spec(ATTENTION_TILES) is None:
        return []
    decode, combine = SPECS[("attention", "decode")], SPECS[("attention", "combine")]

    def pair(suffix: str, T: int | None, **extra):
        return [from_spec(decode, f"attention_decode{suffix}", "attention", _key("decode", T), _decode_inputs(T),
                          _decode_reference, uses_chunk=False, **extra),
                from_spec(combine, f"attention_combine{suffix}", "attention", _key("combine", T), _combine_inputs(T),
                          _combine_reference, uses_chunk=False, **extra)]

    return pair("", 1) + pair("_verify", None, layouts=True, min_drafts=1)
