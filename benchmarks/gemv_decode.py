"""One-token projections: the one-row kernel (torch.ops.kvbuffer.gemv's CUDA launch) vs torch's GEMM
(F.linear, cuBLAS), for every projection weight of a model (kvbuffer.autotune.models.preset_gemv_shapes).

Correctness first (both against the product in fp64), then each timed as a CUDA graph of many launches
with the weights rotated past twice the L2 (kvbuffer.bench.timing), achieved bandwidth (the weight's
bytes once) against the measured copy bandwidth, and the time a decode step spends in these products
(each shape times how many of the model's projections have it). Writes JSON next to the other results.

    python benchmarks/gemv_decode.py --model qwen3.5-9b --rows 1 --out result.json

Needs a CUDA GPU and TileLang (kernels are taken from the artifact cache, else JIT-compiled).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def run(model: str, rows: int) -> list[dict]:
    from kvbuffer import presets
    from kvbuffer.autotune.models import config_projection_counts, preset_gemv_shapes
    from kvbuffer.bench.timing import copy_bandwidth, graph_median, l2_bytes, sets_to_exceed
    from kvbuffer.kernels import launch

    copy = copy_bandwidth()
    counts = config_projection_counts(presets.get(model).hf_config())
    out = []
    for shape in (s for s in preset_gemv_shapes(model) if s["family"] == "gemv"):
        N, K, dt = shape["N"], shape["K"], getattr(torch, shape["dtype"])
        nbytes = N * K * dt.itemsize
        sets = sets_to_exceed(nbytes, 2 * l2_bytes())
        gen = torch.Generator(device="cuda").manual_seed(N + K)
        ws = [(torch.randn(N, K, device="cuda", generator=gen) * K ** -0.5).to(dt) for _ in range(sets)]
        xs = [torch.randn(rows, K, device="cuda", generator=gen).to(dt) for _ in range(sets)]
        kernel = lambda i: launch.gemv(xs[i], ws[i])  # noqa: E731
        gemm = lambda i: F.linear(xs[i], ws[i])  # noqa: E731
        want = xs[0].double() @ ws[0].double().T
        err = {name: float((fn(0).double() - want).norm() / want.norm()) for name, fn in (("kernel", kernel),
                                                                                           ("gemm", gemm))}
        if not err["kernel"] < 4e-3:
            raise SystemExit(f"N={N} K={K}: the kernel is off the fp64 product (relative error {err['kernel']:.2e})")
        tk = graph_median(kernel, sets, rotated_bytes=nbytes * sets)
        tg = graph_median(gemm, sets, rotated_bytes=nbytes * sets)
        n = counts[(N, K)]
        row = dict(N=N, K=K, rows=rows, per_step=n, kernel_us=tk.us, gemm_us=tg.us, speedup=tg.seconds / tk.seconds,
                   kernel_gbs=nbytes / tk.seconds / 1e9, gemm_gbs=nbytes / tg.seconds / 1e9, copy_gbs=copy / 1e9,
                   rel_err=err, timing=tk.method)
        print(f"N={N:6d} K={K:5d} x{n:2d}: kernel {tk.us:7.1f} us ({row['kernel_gbs']:5.0f} GB/s)  GEMM {tg.us:7.1f} us "
              f"({row['gemm_gbs']:5.0f} GB/s)  {row['speedup']:4.2f}x", flush=True)
        out.append(row)
        del ws, xs
        torch.cuda.empty_cache()
    step_k = sum(r["kernel_us"] * r["per_step"] for r in out) / 1e3
    step_g = sum(r["gemm_us"] * r["per_step"] for r in out) / 1e3
    print(f"per decode step: kernel {step_k:.2f} ms, GEMM {step_g:.2f} ms ({step_g / step_k:.2f}x); "
          f"copy bandwidth {copy / 1e9:.0f} GB/s", flush=True)
    return out


def main() -> None:
    from kvbuffer import ops

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3.5-9b")
    p.add_argument("--rows", type=int, default=1, help="rows of x (1: a decode step at batch 1)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    ops.allow_jit(True)
    rows = run(a.model, a.rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
