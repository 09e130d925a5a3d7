"""The top-p cut's mass in fp64 (kvbuffer.engine.sampling.nucleus) against the fp32 running sum it
replaced: how many rows' cut the fp32 sum moves, and what the fp64 mass costs.

Rows of a Qwen3.5-sized vocabulary (248,320 tokens) with flat logits, softmaxed in fp32 as the engine
does; each side's whole top-p step (sort, mass, cut, renormalise) timed as a CUDA graph of many calls
(kvbuffer.bench.timing), in alternation, best of two medians, inputs rotated past the L2. Writes one JSON.

    python benchmarks/top_p_mass.py --rows 64 --top-p 0.95 --out top_p_mass.json

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvbuffer.bench.timing import graph_median
from kvbuffer.engine.sampling import nucleus

VOCAB = 248_320
SCALES = (0.5, 0.5, 2.0, 2.0)  # logit scales of the rotated input sets: flat rows, and less flat ones


def fp32_sum(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The rule before: the mass before each token as an fp32 running sum, against top_p."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    drop = (torch.cumsum(sorted_p, -1) - sorted_p) >= top_p.float()
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--out", default="top_p_mass.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("Error: this benchmark needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [torch.softmax(s * torch.randn(args.rows, VOCAB, device="cuda", generator=g), -1) for s in SCALES]
    top_p = torch.full((args.rows, 1), args.top_p, device="cuda", dtype=torch.float64)
    sides = {"fp32_sum": fp32_sum, "fp64_mass": nucleus}
    moved = [int(((fp32_sum(p, top_p) > 0) ^ (nucleus(p, top_p) > 0)).any(-1).sum()) for p in sets]
    nbytes = sum(p.numel() * p.element_size() for p in sets)
    us = {}
    for name in ("fp32_sum", "fp64_mass", "fp64_mass", "fp32_sum"):  # alternated: neither always runs first
        t = graph_median(lambda i, f=sides[name]: f(sets[i], top_p), len(sets), rotated_bytes=nbytes,
                         launches=8, replays=10)
        us[name] = min(us.get(name, float("inf")), t.us)
    print(f"{args.rows} x {VOCAB}: fp32 sum {us['fp32_sum']:.1f} us, fp64 mass {us['fp64_mass']:.1f} us "
          f"(x{us['fp64_mass'] / us['fp32_sum']:.3f}); rows whose cut the fp32 sum moved, per set: {moved}")
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(0), timing=t.method, rows=args.rows, vocab=VOCAB,
                       top_p=args.top_p, logit_scales=SCALES, us=us, rows_moved=moved), f, indent=1)


if __name__ == "__main__":
    main()
