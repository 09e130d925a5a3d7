"""Benchmark of the Mamba-2 (Nemotron-3) decode kernels on one CUDA GPU: buffered vs recurrent vs mamba_ssm.

Method as bench_gdn.py: a correctness gate against the fp64 reference first (every timed kernel and
the peer); CUDA events around each launch, warm-up, median; states rotated through a pool of at
least 4x the L2; the buffered step runs with rows at staggered fills (n = (row + i) mod C), so 1/C of
the rows flush in each launch (steady-state cost with the flush amortized). GB/s count the fewest
bytes each op must move, against the measured device-to-device copy bandwidth.

Peer: mamba_ssm 2.3.2.post1 Triton `selective_state_update` (dt_softplus, dt_bias, D, z, grouped B/C,
state_batch_indices), with A, dt, dt_bias, D expanded over the head dim by stride-0 views (tie_hdim),
as vLLM/SGLang call it. The mamba_ssm package imports its CUDA extension at import time; it is not
built (MAMBA_SKIP_CUDA_BUILD), so this benchmark alone installs an empty stand-in module for it.

Buffered variants (tiles/mamba2.py `variant`): the timed buffered step and verify are the default
template ("simt", tiles/mamba2_simt.py). `--reduce` also builds, tunes, gates and times the generic one
(tiles/linear_decode.py) in the same run, as buffered_reduce / verify{T}_reduce, with the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_gdn import L2_BYTES, _time, copy_bandwidth, plot  # noqa: E402

SHAPES = {"nemotron3-nano": (8, 64), "nemotron3-super": (8, 128)}  # (groups, heads); N = 128, P = 64
N, P = 128, 64
BATCHES = (1, 4, 16, 64, 128, 256, 512, 1024)


def _peer():
    """mamba_ssm's selective_state_update, or None (reported) when it cannot be imported."""
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))  # stand-in, see docstring
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except Exception as e:  # noqa: BLE001  (reported, not hidden)
        print(f"mamba_ssm unavailable: {type(e).__name__}: {e}")
        return None
    return selective_state_update


class Setup:
    """Pools and rotated inputs for one (shape, batch)."""

    def __init__(self, G, H, B, *, cap, C, n_inputs=4, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        per_row = H * N * P * 4
        self.windows = max(2, -(-4 * L2_BYTES // (B * per_row)))
        self.ns = self.windows * B
        self.G, self.H, self.B, self.C = G, H, B, C
        self.state = 0.1 * torch.randn(self.ns, H, N, P, device="cuda", generator=g)
        self.peer_state = self.state.view(self.ns, H, P, N)  # same bytes, the peer's (P, N) layout
        self.buf_k = torch.randn(self.ns, cap, G, N, device="cuda", generator=g).to(torch.bfloat16)
        self.buf_v = (0.3 * torch.randn(self.ns, cap, H, P, device="cuda", generator=g)).to(torch.bfloat16)
        self.buf_g = torch.cumsum(-0.05 * torch.rand(self.ns, cap, H, device="cuda", generator=g), dim=1)
        r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
        self.inputs = {T: [(r(B, T, H, P), r(B, T, H), r(B, T, G, N), r(B, T, G, N), r(B, T, H, P))
                           for _ in range(n_inputs)] for T in (1, 2, 4, 8)}
        u = lambda lo, hi: lo + (hi - lo) * torch.rand(H, device="cuda", generator=g)  # noqa: E731
        self.A_log, self.dt_bias, self.D = torch.log(u(1, 16)), torch.log(torch.expm1(u(0.001, 0.1))), u(0.5, 1.5)
        ar = torch.arange(B, device="cuda", dtype=torch.int32)
        self.slots = [(w * B + ar).to(torch.int32) for w in range(self.windows)]
        self.staggered = [((ar + i) % C).to(torch.int32) for i in range(C)]
        self.out = {T: torch.empty(B, T, H, P, device="cuda", dtype=torch.bfloat16) for T in (1, 2, 4, 8)}

    def tok(self, T, i):
        return self.inputs[T][i % len(self.inputs[T])]

    def win(self, i):
        return self.slots[i % self.windows]

    def peer_args(self, i):
        """selective_state_update's arguments (tie_hdim stride-0 expansions)."""
        x, dt, Bm, Cm, z = (t[:, 0] for t in self.tok(1, i))
        A = -torch.exp(self.A_log)[:, None, None].expand(self.H, P, N)
        return dict(x=x, dt=dt[..., None].expand(self.B, self.H, P), A=A, B=Bm, C=Cm,
                    D=self.D[:, None].expand(self.H, P), z=z, dt_bias=self.dt_bias[:, None].expand(self.H, P),
                    dt_softplus=True)


def _bytes(S: Setup, kind: str, T: int = 1) -> float:
    B, G, H, C = S.B, S.G, S.H, S.C
    s = 4 * N * P
    act = T * (2 * H * P + H + 2 * G * N) * 2 + T * H * P * 2 + T * H * P * 2  # x, dt, B, C, z in; y out
    entry = 2 * N * G + 2 * P * H + 4 * H
    if kind in ("recurrent", "peer"):
        return B * (2 * H * s + act)
    if kind == "buffered":
        return B * (H * s * (1 + 1 / C) + (C - 1) / 2 * entry + entry + act)
    if kind == "verify":
        return B * (H * s + (C - 1) / 2 * entry + T * entry + act)
    raise ValueError(kind)


def _buffered_keys(ops) -> list[tuple[int, str]]:
    """(T, key) of every buffered kernel built: the default variant's, then the generic one's if built."""
    keys = [(1, "buffered"), (2, "verify2"), (4, "verify4"), (8, "verify8")]
    return keys + [(T, f"{k}_reduce") for T, k in keys if f"{k}_reduce" in ops]


def correctness_gate(ops, G, H, peer) -> dict:
    from kvbuffer.reference import mamba2 as ref

    S = Setup(G, H, 8, cap=ops["cap"], C=ops["C"], seed=1)
    ss, bs, ln = S.win(0), S.win(1), S.staggered[3]
    err = lambda x, y: float((x.double() - y).norm() / y.norm())  # noqa: E731
    d = lambda *ts: [t.double() for t in ts]  # noqa: E731
    out = {}
    x, dt, Bm, Cm, z = (t[:, 0] for t in S.tok(1, 0))
    s64 = S.state.double()
    y64 = ref.recurrent_step(*d(x, dt), S.A_log, S.dt_bias, *d(Bm, Cm), S.D, s64.clone(), ss, z=z.double())
    y = torch.full_like(x, float("nan"))
    u = lambda t: t.unsqueeze(1)  # noqa: E731
    ops["recurrent"].fn(u(x), u(dt), S.A_log, S.dt_bias, u(Bm), u(Cm), S.D, u(z), S.state.clone(), ss, u(y))
    out["recurrent"] = err(y, y64)
    if peer is not None:
        # the peer's layout is (P, N): give it the transposed states
        st = S.state.transpose(-1, -2).contiguous()
        yp = peer(st, **S.peer_args(0), state_batch_indices=ss)
        out["peer"] = err(yp, y64)
    for T, key in _buffered_keys(ops):
        x, dt, Bm, Cm, z = S.tok(T, 0)
        bk, bv, bg = S.buf_k.clone(), S.buf_v.clone(), S.buf_g.clone()
        y64 = ref.verify(*d(x, dt), S.A_log, S.dt_bias, *d(Bm, Cm), S.D, s64.clone(), ss, bk, bv, bg, bs, ln,
                         z=z.double())
        bk, bv, bg = S.buf_k.clone(), S.buf_v.clone(), S.buf_g.clone()
        y = torch.full_like(x, float("nan"))
        ops[key].fn(x, dt, S.A_log, S.dt_bias, Bm, Cm, S.D, z, S.state.clone(), ss, bk, bv, bg, bs, ln, y)
        out[key] = err(y, y64)
    return out


def build_ops(G, H, *, C, cap, buffered_cfg=None, recurrent_cfg=None, reduce_cfg=None) -> dict:
    """The timed kernels; reduce_cfg (a dict) adds the generic variant's step and verifies."""
    from kvbuffer.kernels import build_mamba2_buffered, build_mamba2_recurrent

    bc, rc = buffered_cfg or {}, recurrent_cfg or {}
    ops = {"C": C, "cap": cap, "recurrent": build_mamba2_recurrent(G, H, N, P, has_z=True, **rc)}
    variants = [("", bc)] + ([("_reduce", dict(reduce_cfg, variant="reduce"))] if reduce_cfg is not None else [])
    for suffix, cfg in variants:
        ops["buffered" + suffix] = build_mamba2_buffered(G, H, N, P, cap=cap, T_new=1, flush_at=C, has_z=True, **cfg)
        for T in (2, 4, 8):
            ops[f"verify{T}{suffix}"] = build_mamba2_buffered(G, H, N, P, cap=cap, T_new=T, flush_at=0, has_z=True,
                                                              **cfg)
    return ops


def _launchers(S, ops, peer):
    u = lambda t: t.unsqueeze(1)  # noqa: E731
    f = {}
    f["recurrent"] = lambda i: ops["recurrent"].fn(
        *(u(t[:, 0]) for t in S.tok(1, i)[:2]), S.A_log, S.dt_bias, *(u(t[:, 0]) for t in S.tok(1, i)[2:4]),
        S.D, u(S.tok(1, i)[4][:, 0]), S.state, S.win(i), S.out[1])

    def buffered(T, key):
        def run(i):
            x, dt, Bm, Cm, z = S.tok(T, i)
            ops[key].fn(x, dt, S.A_log, S.dt_bias, Bm, Cm, S.D, z, S.state, S.win(i), S.buf_k, S.buf_v, S.buf_g,
                        S.win(i + 1), S.staggered[i % S.C], S.out[T])
        return run

    for T, key in _buffered_keys(ops):
        f[key] = buffered(T, key)
    if peer is not None:
        f["peer"] = lambda i: peer(S.peer_state, **S.peer_args(i), state_batch_indices=S.win(i))
    return f


KINDS = {"recurrent": ("recurrent", 1), "peer": ("peer", 1), "buffered": ("buffered", 1),
         "verify2": ("verify", 2), "verify4": ("verify", 4), "verify8": ("verify", 8)}
KINDS.update({f"{k}_reduce": v for k, v in KINDS.items() if k not in ("recurrent", "peer")})


def bench_shape(name, G, H, ops, peer, batches, copy_bw) -> list[dict]:
    rows = []
    for B in batches:
        S = Setup(G, H, B, cap=ops["cap"], C=ops["C"])
        t = {k: _time(fn, reps=4 * S.C) for k, fn in _launchers(S, ops, peer).items()}
        row = {"shape": name, "G": G, "H": H, "B": B, "us": {k: 1e3 * v for k, v in t.items()}}
        row["GBps"] = {k: _bytes(S, *KINDS[k]) / (v * 1e-3) / 1e9 for k, v in t.items()}
        row["frac_copy_bw"] = {k: g * 1e9 / copy_bw for k, g in row["GBps"].items()}
        row["speedup_buffered_vs_recurrent"] = t["recurrent"] / t["buffered"]
        if "peer" in t:
            row["speedup_buffered_vs_peer"] = t["peer"] / t["buffered"]
            row["speedup_recurrent_vs_peer"] = t["peer"] / t["recurrent"]
        for T in (2, 4, 8):
            row[f"verify{T}_over_step"] = t[f"verify{T}"] / t["buffered"]
        if "buffered_reduce" in t:  # the default (thread-level) variant against the generic one
            row["speedup_buffered_vs_reduce"] = t["buffered_reduce"] / t["buffered"]
            for T in (2, 4, 8):
                row[f"speedup_verify{T}_vs_reduce"] = t[f"verify{T}_reduce"] / t[f"verify{T}"]
                row[f"verify{T}_reduce_over_step"] = t[f"verify{T}_reduce"] / t["buffered_reduce"]
        rows.append(row)
        print(f"{name:16s} B={B:5d} " + " ".join(f"{k}={v * 1e3:8.1f}us" for k, v in t.items()), flush=True)
        del S
        torch.cuda.empty_cache()
    return rows


def tune(G, H, *, C, cap, B=256, reduce=False) -> dict:
    """Pick the tunables of the recurrent and buffered kernels by their median time at batch B.

    The buffered configs of each variant are tuned apart: "buffered" (the default, thread-level template)
    and, with reduce, "buffered_reduce" (the generic one); the winners are kept without the `variant` key.
    """
    from kvbuffer.kernels import build_mamba2_buffered, build_mamba2_recurrent
    from kvbuffer.tiles.mamba2 import get_buffered_configs, get_recurrent_configs

    S = Setup(G, H, B, cap=cap, C=C)
    log = []
    for cfg in (c for c in get_recurrent_configs() if P % c["BV"] == 0):
        ops = {"recurrent": build_mamba2_recurrent(G, H, N, P, has_z=True, **cfg)}
        log.append(("recurrent", cfg, _time(_launchers(S, ops, None)["recurrent"])))
    for cfg in (c for c in get_buffered_configs() if P % c["BV"] == 0):
        kind = "buffered_reduce" if cfg.get("variant") == "reduce" else "buffered"
        if kind == "buffered_reduce" and not reduce:
            continue
        ops = {"buffered": build_mamba2_buffered(G, H, N, P, cap=cap, T_new=1, flush_at=C, has_z=True, **cfg)}
        ops.update({f"verify{T}": ops["buffered"] for T in (2, 4, 8)})
        log.append((kind, {k: v for k, v in cfg.items() if k != "variant"},
                    _time(_launchers(S, ops, None)["buffered"], reps=2 * C)))
    kinds = ("recurrent", "buffered") + (("buffered_reduce",) if reduce else ())
    best = {k: min((x for x in log if x[0] == k), key=lambda x: x[2])[1] for k in kinds}
    best["log"] = [{"kind": k, **c, "us": 1e3 * t} for k, c, t in log]
    del S
    torch.cuda.empty_cache()
    return best


def run_benchmark(shapes=tuple(SHAPES), batches=BATCHES, C=16, cap=24, autotune=True, reduce=False) -> dict:
    copy_bw = copy_bandwidth()
    peer = _peer()
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "copy_GBps": copy_bw / 1e9, "C": C, "cap": cap, "buffer_dtype": "bfloat16", "has_z": True,
              "notes": "peer: mamba_ssm 2.3.2.post1 Triton selective_state_update (dt_softplus, dt_bias, D, z, "
                       "state_batch_indices)" if peer else "peer unavailable", "gate": {}, "rows": [], "configs": {},
              "variants": ["simt", "reduce"] if reduce else ["simt"]}
    for name in shapes:
        G, H = SHAPES[name]
        cfg = tune(G, H, C=C, cap=cap, reduce=reduce) if autotune else {}
        result["configs"][name] = cfg
        print(f"tuned {name}: recurrent {cfg.get('recurrent')} buffered {cfg.get('buffered')}"
              + (f" buffered_reduce {cfg.get('buffered_reduce')}" if reduce else ""), flush=True)
        ops = build_ops(G, H, C=C, cap=cap, buffered_cfg=cfg.get("buffered"), recurrent_cfg=cfg.get("recurrent"),
                        reduce_cfg=cfg.get("buffered_reduce", {"threads": 128, "blocks": 0}) if reduce else None)
        gate = correctness_gate(ops, G, H, peer)
        result["gate"][name] = gate
        print(f"gate {name}: " + " ".join(f"{k}={v:.2e}" for k, v in gate.items()), flush=True)
        if any(not (v < 2e-2) for v in gate.values()):
            raise RuntimeError(f"correctness gate failed for {name}: {gate}")
        result["rows"] += bench_shape(name, G, H, ops, peer, batches, copy_bw)
    return result


PLOTTED = ("peer", "recurrent", "buffered", "verify4", "buffered_reduce", "verify4_reduce")


def table(result: dict) -> str:
    nan = float("nan")
    lines = [f"{result['gpu']}  copy {result['copy_GBps']:.0f} GB/s  C={result['C']}",
             f"{'shape':16s} {'B':>5s} {'peer':>8s} {'rec':>8s} {'buf':>8s} {'v2':>8s} {'v4':>8s} {'v8':>8s}"
             f" {'buf/peer':>8s} {'buf/rec':>7s} {'v4/step':>7s} {'bufGB/s':>7s} {'peerGB/s':>8s}"]
    for r in result["rows"]:
        u = r["us"]
        lines.append(f"{r['shape']:16s} {r['B']:5d} {u.get('peer', nan):8.1f} {u['recurrent']:8.1f}"
                     f" {u['buffered']:8.1f} {u['verify2']:8.1f} {u['verify4']:8.1f} {u['verify8']:8.1f}"
                     f" {r.get('speedup_buffered_vs_peer', nan):8.2f} {r['speedup_buffered_vs_recurrent']:7.2f}"
                     f" {r['verify4_over_step']:7.2f} {r['GBps']['buffered']:7.0f} {r['GBps'].get('peer', nan):8.0f}")
    if any("buffered_reduce" in r["us"] for r in result["rows"]):
        lines += ["", "the default thread-level template (simt) beside the generic one (reduce), same run",
                  f"{'shape':16s} {'B':>5s} {'reduce':>8s} {'simt':>8s} {'v4red':>8s} {'v4':>8s} {'speedup':>8s}"
                  f" {'v4 spd':>7s} {'buf bw':>7s}"]
        for r in result["rows"]:
            if "buffered_reduce" not in r["us"]:
                continue
            u = r["us"]
            lines.append(f"{r['shape']:16s} {r['B']:5d} {u['buffered_reduce']:8.1f} {u['buffered']:8.1f}"
                         f" {u['verify4_reduce']:8.1f} {u['verify4']:8.1f} {r['speedup_buffered_vs_reduce']:8.2f}"
                         f" {r['speedup_verify4_vs_reduce']:7.2f} {r['frac_copy_bw']['buffered']:7.2f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--no-tune", action="store_true")
    p.add_argument("--reduce", action="store_true",
                   help="also time the generic buffered variant (tiles/linear_decode.py) beside the default one")
    a = p.parse_args(argv)
    res = run_benchmark(batches=tuple(int(x) for x in a.batches.split(",")), autotune=not a.no_tune, reduce=a.reduce)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"mamba2_{res['date']}_{res['gpu'].replace(' ', '_')}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    txt = table(res)
    with open(stem + ".txt", "w") as f:
        f.write(txt + "\n")
    plot(res, stem + ".png", kinds=PLOTTED, layer="Mamba-2 layer")
    print(txt)
    return res


if __name__ == "__main__":
    main()
