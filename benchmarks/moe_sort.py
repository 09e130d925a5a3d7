"""The MoE dispatch's sort (kvbuffer.models.layers.route_to_experts): topk's int64 expert ids against the
same ids as int16, sorted (stable) and searched for each expert's end, per layer call.

A radix sort's passes scale with the key's bits, so the narrow ids should sort faster; the two orders
are checked equal first, then each is timed as a CUDA graph of many calls (kvbuffer.bench.timing), in
alternation, best of two medians. Writes one JSON.

    python benchmarks/moe_sort.py --experts 128 --top-k 6 --batches 1,64,512,2048 --out moe_sort.json

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvbuffer.bench.timing import graph_median

SETS = 8  # distinct routings per batch, cycled by the timed calls


def dispatch(ids: torch.Tensor, ends: torch.Tensor):
    """route_to_experts' sort and search, with ids of `ends`' dtype."""
    experts, order = torch.sort(ids.reshape(-1).to(ends.dtype), stable=True)
    return torch.searchsorted(experts, ends, out_int32=True), order


def measure(B: int, E: int, k: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(B)
    routings = [torch.topk(torch.randn(B, E, device="cuda", generator=g), k, dim=-1).indices for _ in range(SETS)]
    ends = {name: torch.arange(1, E + 1, device="cuda", dtype=dt)
            for name, dt in (("int64", torch.int64), ("int16", torch.int16))}
    same = all(torch.equal(a, b) for r in routings
               for a, b in zip(dispatch(r, ends["int64"]), dispatch(r, ends["int16"])))
    us = {}
    for name in ("int64", "int16", "int16", "int64"):  # alternated: neither always runs first
        t = graph_median(lambda i, name=name: dispatch(routings[i], ends[name]), SETS, rotated_bytes=0).us
        us[name] = min(us.get(name, float("inf")), t)
    return dict(B=B, E=E, k=k, ids=B * k, us=us, speedup=us["int64"] / us["int16"], same_order=same)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--batches", default="1,64,512,2048")
    ap.add_argument("--out", default="moe_sort.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("Error: this benchmark needs a CUDA GPU")
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        row = measure(B, args.experts, args.top_k)
        rows.append(row)
        print(f"B={B:5d} ids {row['ids']:6d}: int64 {row['us']['int64']:7.2f} us  int16 {row['us']['int16']:7.2f} us"
              f"  x{row['speedup']:.2f}  same order {row['same_order']}", flush=True)
    method = ("kvbuffer.bench.timing.graph_median: a CUDA graph of many calls, median of replays; per call one "
              "MoE layer's sort of B*k ids and its search of E expert ends")
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(0), timing=method, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
