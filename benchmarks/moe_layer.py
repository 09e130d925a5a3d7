"""A mixture-of-experts layer on kvbuffer's experts kernels (what the engine runs with LLM(gemv=...)):
up to EXPERT_TOKENS tokens the one-row experts kernel (torch.ops.kvbuffer.gemv_experts), past them the
grouped experts kernel (torch.ops.kvbuffer.grouped_experts), against the sorted path on torch's
grouped matmul (torch._grouped_mm), all through the model's own routed-experts module
(kvbuffer.models.layers.route_to_experts), for the first MoE layer of a preset model built with
random weights. `--kernel one_row` or `grouped` forces one kernel at every token count; the JSON's
`torch_*` fields are torch's grouped matmul.

Correctness first (both paths against the experts' products in fp64), then each timed as a CUDA graph
of many launches (kvbuffer.bench.timing.graph_median), every launch routed to other experts (a fresh
random top-k per set, so the experts' weights are read from memory, not L2; `--skew s` draws the top-k
with expert e's odds exp(s z_e), z_e ~ N(0, 1), for routers that favour some experts), achieved bandwidth (the
chosen experts' weights once) against the measured copy bandwidth, and the time a decode step spends
in its MoE layers. Writes JSON next to the other results.

    python benchmarks/moe_layer.py --model nemotron-3-nano --rows 1,8,64,512 --skew 0,1 --out result.json

Needs a CUDA GPU and TileLang (kernels are taken from the artifact cache, else JIT-compiled).
"""

from __future__ import annotations

import argparse
import json

import torch


def first_experts(model: str):
    """The preset's first routed-experts module with random bf16 weights on the GPU, its top-k and how
    many such layers a step runs."""
    from kvbuffer import presets
    from kvbuffer.autotune.models import meta_model
    from kvbuffer.models.layers import one_row_experts

    cfg = presets.get(model).hf_config()
    experts = one_row_experts(meta_model(cfg))
    if not experts:
        raise SystemExit(f"{model} has no routed experts")
    layer = experts[0].to_empty(device="cuda").to(torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for w in layer.expert_weights():
            w.copy_(torch.randn(w.shape, generator=gen, device="cuda") * w.shape[-1] ** -0.5)
    k = int(cfg.get("num_experts_per_tok") or cfg.get("moe_topk"))
    return layer, k, len(experts)


def routing(rows: int, E: int, k: int, skew: float, gen) -> torch.Tensor:
    """(rows, k) distinct expert ids a row, expert e drawn with odds exp(skew z_e) (skew 0: uniform)."""
    odds = torch.exp(skew * torch.randn(E, generator=gen, device="cuda"))
    return torch.multinomial(odds.expand(rows, E), k, replacement=False, generator=gen)


def run(model: str, rows: int, kernel_choice: str = "auto", skew: float = 0.0) -> dict:
    from kvbuffer.bench.timing import copy_bandwidth, graph_median
    from kvbuffer.engine.one_row import EXPERT_TOKENS

    copy = copy_bandwidth()
    layer, k, layers = first_experts(model)
    first, down = layer.expert_weights()
    E, H = first.shape[0], down.shape[1]
    gen = torch.Generator(device="cuda").manual_seed(1)
    sets = max(8, 2 * E // k)
    xs = [torch.randn(rows, H, generator=gen, device="cuda").bfloat16() for _ in range(sets)]
    ids = [routing(rows, E, k, skew, gen) for _ in range(sets)]
    ws = [torch.rand(rows, k, generator=gen, device="cuda") for _ in range(sets)]

    def path(one_row: int, grouped_kernel: int):
        def call(i):
            layer.one_row, layer.grouped = one_row, grouped_kernel
            return layer(xs[i], ids[i], ws[i])  # fp32 routing weights, as the routers give them
        return call

    if kernel_choice == "auto":
        kernel_choice = "one_row" if rows <= EXPERT_TOKENS else "grouped"
    torch_path = path(0, 0)
    kernel = path(rows, 0) if kernel_choice == "one_row" else path(0, rows)
    want = _fp64(layer, xs[0], ids[0], ws[0])
    err = {name: float((fn(0).double() - want).norm() / want.norm()) for name, fn in (("kernel", kernel),
                                                                                       ("torch", torch_path))}
    if not err["kernel"] < 1e-2:
        raise SystemExit(f"{model}: the {kernel_choice} path is off the fp64 products (relative error "
                         f"{err['kernel']:.2e})")
    used = sum(int(torch.unique(i).numel()) for i in ids) / sets  # distinct experts a launch reads
    busiest = sum(int(torch.bincount(i.flatten()).max()) for i in ids) / sets  # the most rows an expert gets
    nbytes = used * (first[0].numel() + down[0].numel()) * 2  # the distinct experts' weights, once
    rotated = nbytes * sets
    tk = graph_median(kernel, sets, rotated_bytes=rotated)
    tt = graph_median(torch_path, sets, rotated_bytes=rotated)
    row = dict(model=model, rows=rows, top_k=k, experts=E, skew=skew, experts_read=used,
               busiest_expert_rows=busiest, kernel=kernel_choice, moe_layers=layers, kernel_us=tk.us, torch_us=tt.us,
               speedup=tt.seconds / tk.seconds, kernel_gbs=nbytes / tk.seconds / 1e9,
               torch_gbs=nbytes / tt.seconds / 1e9, copy_gbs=copy / 1e9, rel_err=err, timing=tk.method,
               step_ms=dict(kernel=tk.us * layers / 1e3, torch=tt.us * layers / 1e3))
    print(f"{model} rows={rows} skew={skew} (busiest expert {busiest:.0f} rows) top-{k} of {E}: "
          f"{kernel_choice} kernel {tk.us:7.1f} us ({row['kernel_gbs']:5.0f} GB/s)  "
          f"torch grouped {tt.us:7.1f} us ({row['torch_gbs']:5.0f} GB/s)  {row['speedup']:4.2f}x; "
          f"x{layers} layers: {row['step_ms']['kernel']:.2f} against {row['step_ms']['torch']:.2f} ms a step; "
          f"copy bandwidth {copy / 1e9:.0f} GB/s", flush=True)
    return row


def _fp64(layer, x, ids, w):
    """The routed experts' sum, one expert at a time in fp64 (the layer's own activation)."""
    first, down = (p.double() for p in layer.expert_weights())
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for s in range(x.shape[0]):
        for j, e in enumerate(ids[s].tolist()):
            h = first[e] @ x[s].double()
            h = layer.activate(h)
            out[s] += w[s, j].double() * (down[e] @ h)
    return out


def main() -> None:
    from kvbuffer import ops

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="nemotron-3-nano")
    p.add_argument("--rows", default="1", help="tokens (comma-separated)")
    p.add_argument("--kernel", default="auto", choices=("auto", "one_row", "grouped"),
                   help="auto: the one-row kernel up to kvbuffer.engine.one_row.EXPERT_TOKENS tokens, the grouped "
                        "kernel past them (at every count: the engine stops it at GROUPED_TOKENS)")
    p.add_argument("--skew", default="0", help="routing skews (comma-separated; 0: uniform top-k)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    ops.allow_jit(True)
    with torch.inference_mode():  # as the engine runs its forwards
        rows = [run(a.model, int(r), a.kernel, float(s)) for s in a.skew.split(",") for r in a.rows.split(",")]
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
