"""Benchmark of the GDN decode kernels on one CUDA GPU: buffered step vs recurrent vs FLA.

`run_benchmark(...)` returns a result dict (a `kvbuffer bench` CLI can wrap it); `main()` writes
it as JSON (+ a PNG when matplotlib is there) under benchmarks/results/.

Method: a correctness gate against the fp64 reference first; then CUDA events around each launch,
warm-up, median. States are rotated through a pool several times the 60 MB L2, so every launch
reads its states from HBM. The buffered step runs with rows at staggered fill levels
(n = (row + iteration) mod C), so 1/C of the rows flush in each launch: its median is the per-token
cost with the flush amortized over C, as in a server's steady state. Bytes/s count the fewest bytes
each op must move (state, buffer entries read and written, activations) over the measured copy
bandwidth (bytes read + written by a large device-to-device copy).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch

SHAPES = {"qwen3.5-9b": (16, 32), "qwen3.5-27b": (16, 48)}  # (Hk, Hv), K = V = 128
BATCHES = (1, 4, 16, 64, 128, 256, 512, 1024)
L2_BYTES = 60 * 2**20


def copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    t = _time(lambda i: dst.copy_(src), reps=20)
    return 2 * nbytes / (t * 1e-3)


def _time(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of fn(i) over reps launches, each bracketed by CUDA events."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i, (s, e) in enumerate(ev):
        s.record()
        fn(i)
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


class Setup:
    """Pools and rotated inputs for one (shape, batch)."""

    def __init__(self, Hk, Hv, B, *, cap, C, K=128, V=128, n_inputs=4, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        per_row = Hv * K * V * 4
        self.windows = max(2, -(-4 * L2_BYTES // (B * per_row)))  # rotation covers >= 4x L2
        self.ns = self.windows * B
        self.B, self.Hk, self.Hv, self.K, self.V, self.C, self.cap = B, Hk, Hv, K, V, C, cap
        self.state = 0.1 * torch.randn(self.ns, Hv, K, V, device="cuda", generator=g)
        self.buf_k = torch.nn.functional.normalize(
            torch.randn(self.ns, cap, Hk, K, device="cuda", generator=g), dim=-1).to(torch.bfloat16)
        self.buf_v = (0.3 * torch.randn(self.ns, cap, Hv, V, device="cuda", generator=g)).to(torch.bfloat16)
        self.buf_g = torch.cumsum(-0.05 * torch.rand(self.ns, cap, Hv, device="cuda", generator=g), dim=1)
        self.inputs = {}
        for T in (1, 2, 4, 8):
            sets = []
            for _ in range(n_inputs):
                r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
                sets.append((r(B, T, Hk, K), r(B, T, Hk, K), r(B, T, Hv, V), r(B, T, Hv), r(B, T, Hv)))
            self.inputs[T] = sets
        self.A_log = torch.log(1 + 15 * torch.rand(Hv, device="cuda", generator=g))
        self.dt_bias = torch.log(torch.expm1(0.001 + 0.1 * torch.rand(Hv, device="cuda", generator=g)))
        ar = torch.arange(B, device="cuda", dtype=torch.int32)
        self.slots = [(w * B + ar).to(torch.int32) for w in range(self.windows)]
        self.staggered = [((ar + i) % C).to(torch.int32) for i in range(C)]
        self.out = {T: torch.empty(B, T, Hv, V, device="cuda", dtype=torch.bfloat16) for T in (1, 2, 4, 8)}
        self.o1 = self.out[1][:, 0]  # (B, Hv, V), contiguous

    def tok(self, T, i):
        return self.inputs[T][i % len(self.inputs[T])]

    def win(self, i):
        return self.slots[i % self.windows]


def _bytes(S: Setup, kind: str, T: int = 1) -> float:
    """Fewest bytes moved per launch."""
    B, Hk, Hv, K, V, C = S.B, S.Hk, S.Hv, S.K, S.V, S.C
    s = 4 * K * V
    act = T * (2 * Hk * K + Hv * V + 2 * Hv) * 2 + T * Hv * V * 2  # q, k, v, a, b in; o out (bf16)
    entry = 2 * K * Hk + 2 * V * Hv + 4 * Hv  # one buffered token, all heads of a row
    if kind in ("recurrent", "fla"):
        return B * (2 * Hv * s + act)
    if kind == "buffered":  # avg fill (C-1)/2 read, one entry written, state read + write 1/C of rows
        return B * (Hv * s * (1 + 1 / C) + (C - 1) / 2 * entry + entry + act)
    if kind == "verify":  # avg fill (C-1)/2 read, T entries written, state read only
        return B * (Hv * s + (C - 1) / 2 * entry + T * entry + act)
    raise ValueError(kind)


def correctness_gate(ops, Hk, Hv, fla_fn) -> dict:
    """One small batch of each op against the fp64 reference; returns relative errors."""
    from kvbuffer.reference import core as ref
    from kvbuffer.reference.gating import gdn_front

    S = Setup(Hk, Hv, 8, cap=ops["cap"], C=ops["C"], seed=1)
    q, k, v, a, b = S.tok(1, 0)
    ss, bs = S.win(0), S.win(1)
    ln = S.staggered[3]
    q64, k64, g64, be64 = gdn_front(q[:, 0], k[:, 0], a[:, 0], b[:, 0], S.A_log, S.dt_bias, torch.float64)
    err = lambda x, y: float((x.double() - y).norm() / y.norm())  # noqa: E731
    out = {}
    s64 = S.state.double()
    o64 = ref.recurrent_step(q64, k64, v[:, 0].double(), g64, be64, s64.clone(), ss)
    st = S.state.clone()
    o = torch.full_like(v[:, 0], float("nan"))
    ops["recurrent"].fn(q, k, v, a, b, S.A_log, S.dt_bias, st, ss, o.unsqueeze(1))
    out["recurrent"] = err(o, o64)
    if fla_fn is not None:
        o_f = fla_fn(S, 0, ss)
        out["fla"] = err(o_f.reshape(o64.shape), o64)
    bk, bv, bg = S.buf_k.clone(), S.buf_v.clone(), S.buf_g.clone()
    o64 = ref.buffered_step(q64, k64, v[:, 0].double(), g64, be64, s64.clone(), ss, bk, bv, bg, bs, ln,
                            flush_at=S.C)
    bk, bv, bg = S.buf_k.clone(), S.buf_v.clone(), S.buf_g.clone()
    o = torch.full_like(v, float("nan"))
    ops["buffered"].fn(q, k, v, a, b, S.A_log, S.dt_bias, S.state.clone(), ss, bk, bv, bg, bs, ln, o)
    out["buffered"] = err(o[:, 0], o64)
    for T in (2, 4, 8):
        q, k, v, a, b = S.tok(T, 0)
        q64, k64, g64, be64 = gdn_front(q, k, a, b, S.A_log, S.dt_bias, torch.float64)
        bk, bv, bg = S.buf_k.clone(), S.buf_v.clone(), S.buf_g.clone()
        o64 = ref.verify(q64, k64, v.double(), g64, be64, s64, ss, bk, bv, bg, bs, ln)
        bk, bv, bg = S.buf_k.clone(), S.buf_v.clone(), S.buf_g.clone()
        o = torch.full_like(v, float("nan"))
        ops[f"verify{T}"].fn(q, k, v, a, b, S.A_log, S.dt_bias, S.state, ss, bk, bv, bg, bs, ln, o)
        out[f"verify{T}"] = err(o, o64)
    return out


def _fla():
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001  (reported, not hidden)
        print(f"FLA unavailable: {type(e).__name__}: {e}")
        return None

    def run(S: Setup, i: int, slots: torch.Tensor):
        q, k, v, a, b = S.tok(1, i)
        init = S.state[int(slots[0]):int(slots[0]) + S.B]  # a contiguous window of the pool
        o, _ = fused_recurrent_gated_delta_rule(
            q, k, v, g=a, beta=b, initial_state=init, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=S.A_log, dt_bias=S.dt_bias,
            use_beta_sigmoid_in_kernel=True)
        return o

    return run


def build_ops(Hk, Hv, *, C, cap, buffered_cfg=None, recurrent_cfg=None, verify_cfg=None) -> dict:
    """Compile every op of one head shape (verify 2/4/8 with `verify_cfg`, else the buffered config)."""
    from kvbuffer.kernels import build_gdn_buffered, build_gdn_flush, build_gdn_recurrent

    bc, rc = buffered_cfg or {}, recurrent_cfg or {}
    vc = verify_cfg or bc
    ops = {"C": C, "cap": cap,
           "recurrent": build_gdn_recurrent(Hk, Hv, **rc),
           "buffered": build_gdn_buffered(Hk, Hv, cap=cap, T_new=1, flush_at=C, **bc),
           "flush": build_gdn_flush(Hk, Hv, cap=cap)}
    for T in (2, 4, 8):
        ops[f"verify{T}"] = build_gdn_buffered(Hk, Hv, cap=cap, T_new=T, flush_at=0, **vc)
    return ops


def bench_shape(name, Hk, Hv, ops, fla_fn, batches, copy_bw) -> list[dict]:
    rows = []
    for B in batches:
        S = Setup(Hk, Hv, B, cap=ops["cap"], C=ops["C"])
        o1t = S.out[1]
        t = {}
        t["recurrent"] = _time(lambda i: ops["recurrent"].fn(
            *S.tok(1, i), S.A_log, S.dt_bias, S.state, S.win(i), o1t))
        t["buffered"] = _time(lambda i: ops["buffered"].fn(
            *S.tok(1, i), S.A_log, S.dt_bias, S.state, S.win(i), S.buf_k, S.buf_v, S.buf_g, S.win(i + 1),
            S.staggered[i % S.C], o1t), reps=4 * S.C)
        for T in (2, 4, 8):
            oT = S.out[T]
            t[f"verify{T}"] = _time(lambda i: ops[f"verify{T}"].fn(
                *S.tok(T, i), S.A_log, S.dt_bias, S.state, S.win(i), S.buf_k, S.buf_v, S.buf_g, S.win(i + 1),
                S.staggered[i % S.C], oT), reps=4 * S.C)
        if fla_fn is not None:
            t["fla"] = _time(lambda i: fla_fn(S, i, S.win(i)))
        row = {"shape": name, "Hk": Hk, "Hv": Hv, "B": B, "us": {k: 1e3 * v for k, v in t.items()}}
        kinds = {"recurrent": ("recurrent", 1), "fla": ("fla", 1), "buffered": ("buffered", 1),
                 "verify2": ("verify", 2), "verify4": ("verify", 4), "verify8": ("verify", 8)}
        row["GBps"] = {k: _bytes(S, *kinds[k]) / (v * 1e-3) / 1e9 for k, v in t.items()}
        row["frac_copy_bw"] = {k: g * 1e9 / copy_bw for k, g in row["GBps"].items()}
        row["speedup_buffered_vs_recurrent"] = t["recurrent"] / t["buffered"]
        if "fla" in t:
            row["speedup_buffered_vs_fla"] = t["fla"] / t["buffered"]
            row["speedup_recurrent_vs_fla"] = t["fla"] / t["recurrent"]
        for T in (2, 4, 8):
            row[f"verify{T}_over_step"] = t[f"verify{T}"] / t["buffered"]
            row[f"verify{T}_over_recurrent"] = t[f"verify{T}"] / t["recurrent"]
        rows.append(row)
        print(f"{name:12s} B={B:5d} " + " ".join(f"{k}={v * 1e3:8.1f}us" for k, v in t.items()), flush=True)
        S = None  # drop the inputs before the next shape (the lambdas above are done with them)
        torch.cuda.empty_cache()
    return rows


def tune(Hk, Hv, *, C, cap, B=256, kinds=("recurrent", "buffered", "verify")) -> dict:
    """Pick BV/threads per kind by the median time at batch B (verify: 4 drafts, used for 2/4/8)."""
    from kvbuffer.kernels import build_gdn_buffered, build_gdn_recurrent
    from kvbuffer.tiles.gdn import get_buffered_configs, get_recurrent_configs

    S = Setup(Hk, Hv, B, cap=cap, C=C)
    o1t, o4t = S.out[1], S.out[4]
    best, log = {}, []
    if "recurrent" in kinds:
        for cfg in get_recurrent_configs():
            op = build_gdn_recurrent(Hk, Hv, **cfg)
            t = _time(lambda i: op.fn(*S.tok(1, i), S.A_log, S.dt_bias, S.state, S.win(i), o1t))
            log.append(("recurrent", cfg, t))
    for cfg in get_buffered_configs():
        if "buffered" in kinds:
            op = build_gdn_buffered(Hk, Hv, cap=cap, T_new=1, flush_at=C, **cfg)
            t = _time(lambda i: op.fn(*S.tok(1, i), S.A_log, S.dt_bias, S.state, S.win(i), S.buf_k, S.buf_v,
                                      S.buf_g, S.win(i + 1), S.staggered[i % C], o1t), reps=2 * C)
            log.append(("buffered", cfg, t))
        if "verify" in kinds:
            op = build_gdn_buffered(Hk, Hv, cap=cap, T_new=4, flush_at=0, **cfg)
            t = _time(lambda i: op.fn(*S.tok(4, i), S.A_log, S.dt_bias, S.state, S.win(i), S.buf_k, S.buf_v,
                                      S.buf_g, S.win(i + 1), S.staggered[i % C], o4t), reps=2 * C)
            log.append(("verify", cfg, t))
    for kind in kinds:
        best[kind] = min((x for x in log if x[0] == kind), key=lambda x: x[2])[1]
    best["log"] = [{"kind": k, **c, "us": 1e3 * t} for k, c, t in log]
    S = None  # drop the inputs before the next shape (the lambdas above are done with them)
    torch.cuda.empty_cache()
    return best


def run_benchmark(shapes=tuple(SHAPES), batches=BATCHES, C=16, cap=24, configs=None, autotune=True,
                  checkpoint=None) -> dict:
    """Gate, then time every op at every (shape, batch); returns the result dict.

    `configs[shape]` may fix any of recurrent / buffered / verify; the missing ones are tuned (when
    `autotune`). `checkpoint`: a JSON path rewritten after each shape."""
    copy_bw = copy_bandwidth()
    fla_fn = _fla()
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "copy_GBps": copy_bw / 1e9, "C": C, "cap": cap, "buffer_dtype": "bfloat16",
              "notes": "FLA: fused_recurrent_gated_delta_rule with l2norm, gate and beta fused in-kernel",
              "gate": {}, "rows": [], "configs": {}}
    for name in shapes:
        Hk, Hv = SHAPES[name]
        cfg = dict((configs or {}).get(name) or {})
        missing = tuple(k for k in ("recurrent", "buffered", "verify") if k not in cfg)
        if missing and autotune:
            tuned = tune(Hk, Hv, C=C, cap=cap, kinds=missing)
            cfg.update(tuned)
        result["configs"][name] = cfg
        print(f"configs {name}: recurrent {cfg.get('recurrent')} buffered {cfg.get('buffered')} "
              f"verify {cfg.get('verify')}", flush=True)
        ops = build_ops(Hk, Hv, C=C, cap=cap, buffered_cfg=cfg.get("buffered"), recurrent_cfg=cfg.get("recurrent"),
                        verify_cfg=cfg.get("verify"))
        gate = correctness_gate(ops, Hk, Hv, fla_fn)
        result["gate"][name] = gate
        print(f"gate {name}: " + " ".join(f"{k}={v:.2e}" for k, v in gate.items()), flush=True)
        if any(not (v < 2e-2) for v in gate.values()):
            raise RuntimeError(f"correctness gate failed for {name}: {gate}")
        result["rows"] += bench_shape(name, Hk, Hv, ops, fla_fn, batches, copy_bw)
        if checkpoint:  # partial results survive a time limit
            with open(checkpoint, "w") as f:
                json.dump(result, f, indent=1)
    return result


def table(result: dict) -> str:
    nan = float("nan")
    lines = [f"{result['gpu']}  copy {result['copy_GBps']:.0f} GB/s  C={result['C']}  (us; *R = the removed reduction "
             "template, in results measured before 2026-11-30's switch)",
             f"{'shape':12s} {'B':>5s} {'fla':>7s} {'rec':>7s} {'buf':>7s} {'bufR':>7s} {'v2':>7s} {'v4':>7s}"
             f" {'v8':>7s} {'v4R':>7s} {'buf/fla':>7s} {'buf/rec':>7s} {'v2/st':>6s} {'v4/st':>6s} {'v8/st':>6s}"
             f" {'buf%bw':>6s}"]
    for r in result["rows"]:
        u = r["us"]
        lines.append(f"{r['shape']:12s} {r['B']:5d} {u.get('fla', nan):7.1f} {u['recurrent']:7.1f}"
                     f" {u['buffered']:7.1f} {u.get('buffered_reduce', nan):7.1f} {u['verify2']:7.1f}"
                     f" {u['verify4']:7.1f} {u['verify8']:7.1f} {u.get('verify4_reduce', nan):7.1f}"
                     f" {r.get('speedup_buffered_vs_fla', nan):7.2f} {r['speedup_buffered_vs_recurrent']:7.2f}"
                     f" {r['verify2_over_step']:6.2f} {r['verify4_over_step']:6.2f} {r['verify8_over_step']:6.2f}"
                     f" {r['frac_copy_bw']['buffered']:6.2f}")
    return "\n".join(lines)


def plot(result: dict, path: str, kinds=("fla", "recurrent", "buffered", "verify4", "buffered_reduce",
                                         "verify4_reduce"), layer: str = "GDN layer") -> bool:
    """µs per row against the batch, one panel per shape (bench_mamba2 reuses it); False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return False
    names = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = [r for r in result["rows"] if r["shape"] == name]
        for k in kinds:
            if rows and k in rows[0]["us"]:
                ax.plot([r["B"] for r in rows], [r["us"][k] / r["B"] for r in rows], marker="o", label=k)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{name} {layer} ({result['gpu']})")
        ax.set_xlabel("batch")
        ax.set_ylabel("us per row")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--C", type=int, default=16)
    p.add_argument("--configs", default=None, help="JSON file of configs per shape (missing kinds are tuned)")
    a = p.parse_args(argv)
    configs = json.load(open(a.configs)) if a.configs else None
    os.makedirs(a.out, exist_ok=True)
    res = run_benchmark(shapes=tuple(a.shapes.split(",")), batches=tuple(int(x) for x in a.batches.split(",")),
                        C=a.C, configs=configs, checkpoint=os.path.join(a.out, "gdn_partial.json"))
    stem = os.path.join(a.out, f"gdn_{res['date']}_{res['gpu'].replace(' ', '_')}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    plot(res, stem + ".png")
    os.remove(os.path.join(a.out, "gdn_partial.json"))
    print(table(res))
    return res


if __name__ == "__main__":
    main()
