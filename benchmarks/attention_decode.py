"""Decode attention: the in-place kernel (torch.ops.kvbuffer.attention_decode's CUDA launch) vs the
runtime's torch window path (gather each row's first L positions, two matmuls), per layer call. The
decode pass's other form is timed too, the same launch with the other compiled pass: where the kernel
takes its tensor-core form (kvbuffer.kernels.keys.attention_on_tensor_cores), the thread-level one
(`simt_*`); elsewhere, for 16-bit shapes of up to 48 query rows a KV head (verifies, fewer query heads),
the tensor-core one the engine does not take yet (`mma_*`, one block for all of a KV head's rows).

Correctness first (the kernel against the window path on the same inputs), then each timed as a CUDA
graph of many launches with the caches rotated past L2 (kvbuffer.bench.timing), achieved bandwidth
against the measured copy bandwidth. Writes JSON next to the other results.

    python benchmarks/attention_decode.py --model qwen3.5-9b --batches 1,16,64,256 --out result.json
    python benchmarks/attention_decode.py --model nemotron-3-nano --tokens 3 --batches 64,256

Needs a CUDA GPU and TileLang (the kernel is JIT-compiled if no artifact is cached).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F


def window_path(q, kc, vc, slots, cached, L, scale):
    """kvbuffer.runtime.mixing.attention's eager torch path, after the writes."""
    from kvbuffer.runtime.mixing import _window

    B, T, H, D = q.shape
    Hkv = kc.shape[2]
    G = H // Hkv
    rows = slots.clamp(min=0).long()
    pos = cached.long()[:, None] + torch.arange(T, device=q.device)[None, :]
    keys, vals = _window(kc, rows, L, pos).to(q.dtype), _window(vc, rows, L, pos).to(q.dtype)
    qg = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    scores = torch.matmul(qg, keys.transpose(2, 3)) * scale
    ahead = torch.arange(L, device=q.device)[None, None, :] > pos[:, :, None]
    scores.masked_fill_(ahead[:, None, None].expand(B, 1, G, T, L).reshape(B, 1, G * T, L), float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, vals).reshape(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)
    return torch.where((slots >= 0)[:, None, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def other_form(shape: dict, T: int):
    """("simt" | "mma", the decode pass the kernel does not take for `shape`, its blocks a row), or None
    where there is no other form (the tensor-core one takes 16-bit shapes of up to 48 rows a KV head)."""
    from kvbuffer.kernels.compiled import build_template
    from kvbuffer.kernels.keys import attention_on_tensor_cores, attention_query_block

    H, Hkv, D = shape["H"], shape["Hkv"], shape["D"]
    G = H // Hkv
    params = dict(H=H, Hkv=Hkv, D=D, T_len=T, dtype=shape["dtype"], threads=128, unroll=4)
    if attention_on_tensor_cores(G, T, D, shape["dtype"], shape["kv_dtype"]):
        form, template, params["kv_dtype"] = "simt", "attention_decode_simt", shape["kv_dtype"]
        blocks = Hkv * G * T // attention_query_block(G, T, D)
    elif shape["dtype"] == shape["kv_dtype"] in ("bfloat16", "float16") and -(-G * T // 16) * 16 <= 48:
        form, template, blocks = "mma", "attention_decode_mma", Hkv
    else:
        return None
    aliases = {"T": T, "kv_dtype": shape["kv_dtype"]}  # what the launcher checks (the mma form's cache is q's dtype)
    return form, build_template("attention_decode", template, params, module="attention", aliases=aliases), blocks


def run(shape: dict, batches, T: int, held: tuple[int, int], L: int) -> list[dict]:
    from kvbuffer.bench.timing import copy_bandwidth, graph_median, l2_bytes
    from kvbuffer.kernels import attention, launch, lookup, specs

    H, Hkv, D = shape["H"], shape["Hkv"], shape["D"]
    dt = getattr(torch, shape["dtype"])
    scale = D ** -0.5
    copy = copy_bandwidth()
    other = other_form(shape, T)
    rows = []
    for B in batches:
        per_set = B * held[1] * Hkv * D * 2 * dt.itemsize
        sets = max(1, min(64, math.ceil(2 * l2_bytes() / per_set)))
        gen = torch.Generator(device="cuda").manual_seed(B)
        kc = torch.randn(B * sets, L, Hkv, D, device="cuda", generator=gen).to(dt)
        vc = torch.randn(B * sets, L, Hkv, D, device="cuda", generator=gen).to(dt)
        q = torch.randn(B, T, H, D, device="cuda", generator=gen).to(dt)
        cached = torch.randint(held[0], held[1] - T + 1, (B,), device="cuda", generator=gen, dtype=torch.int32)
        slot_sets = [(torch.randperm(B, device="cuda") + i * B).int() for i in range(sets)]
        kernel = lambda i: launch.attention_decode(q, kc, vc, slot_sets[i], cached, scale, L, checked=False)  # noqa: E731
        torch_ = lambda i: window_path(q, kc, vc, slot_sets[i], cached, L, scale)  # noqa: E731
        want, got = torch_(0).float(), kernel(0).float()
        rel = float((got - want).norm() / want.norm())
        if not rel < 2e-2:
            raise SystemExit(f"B={B}: the kernel disagrees with the window path (relative error {rel:.2e})")
        tk = graph_median(kernel, sets, rotated_bytes=per_set * sets)
        tt = graph_median(torch_, sets, rotated_bytes=per_set * sets)
        nbytes = float((cached.sum() + B * T) * Hkv * D * 2 * dt.itemsize)
        row = dict(batch=B, tokens=T, kernel_us=tk.us, torch_us=tt.us, speedup=tt.seconds / tk.seconds,
                   kernel_gbs=nbytes / tk.seconds / 1e9, copy_gbs=copy / 1e9, rel_err=rel)
        line = ""
        if other is not None:  # the launcher's split rule for its grid, and the combine
            form, op, blocks = other
            splits = attention.splits_for(B * blocks, L, torch.cuda.get_device_properties(0).multi_processor_count)
            combine = lookup.kernel_for(launch.attention_key(specs.ATTENTION_COMBINE, q, kc)) if splits > 1 else None
            call = lambda i: attention.attention_decode(op, combine, q, kc, vc, slot_sets[i], cached,  # noqa: E731
                                                        scale, splits=splits, checked=False)
            orel = float((call(0).float() - want).norm() / want.norm())
            if not orel < 2e-2:
                raise SystemExit(f"B={B}: the {form} form disagrees with the window path ({orel:.2e})")
            to = graph_median(call, sets, rotated_bytes=per_set * sets)
            row.update({f"{form}_us": to.us, f"{form}_rel_err": orel, f"over_{form}": to.seconds / tk.seconds})
            name = "thread-level" if form == "simt" else "tensor-core"
            line = f"  {name} form {to.us:8.1f} us (the kernel {row[f'over_{form}']:4.2f}x it)"
        print(f"B={B:5d}: kernel {tk.us:8.1f} us ({row['kernel_gbs']:6.0f} GB/s, {row['kernel_gbs'] * 1e9 / copy:4.0%} "
              f"of copy)  window path {tt.us:8.1f} us  {row['speedup']:5.2f}x{line}", flush=True)
        rows.append(row)
        del kc, vc
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    from kvbuffer import ops
    from kvbuffer.autotune.models import preset_attention_shape

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3.5-9b")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--tokens", type=int, default=1, help="new tokens per row (1: decode; up to 8: a verify)")
    p.add_argument("--held", default="140,180", help="positions a row holds, low,high")
    p.add_argument("--context", type=int, default=256, help="the context bucket L (the window path's length)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    ops.allow_jit(True)
    shape = preset_attention_shape(a.model)
    held = tuple(int(x) for x in a.held.split(","))
    rows = run(shape, [int(b) for b in a.batches.split(",")], a.tokens, held, a.context)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "shape": shape, "gpu": torch.cuda.get_device_name(), "held": held,
                       "context": a.context, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
