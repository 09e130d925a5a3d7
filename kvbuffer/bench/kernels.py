"""What the GDN and Mamba-2 kernel benchmarks share: pools, the correctness gate, the rows.

Both families keep the same pools in kvbuffer's generic form (Hk key heads of K, Hv value heads of
V; Mamba-2: Hk = groups, K = state size, Hv = heads, V = head dim): fp32 states (Hv, K, V) per
row, bf16 buffer entries and fp32 cumulative log decays. A family module (kvbuffer.bench.gdn,
kvbuffer.bench.mamba2) says only what differs: its token inputs, its fp64 reference, its kernels
and its peers (`load_peers`: Peer per kernel found, and one line per peer saying what was loaded).

A family's PEERS maps each peer's name to the op of ours it stands beside: "recurrent" (a plain
state update: compared with our recurrent and buffered steps), "buffered" (a deferred-update step,
ReplaySSM: compared with our buffered step) or "verify5" (a verify of 5 tokens: with ours).

Method: a correctness gate against the fp64 reference first (every timed kernel and every peer, on
fresh inputs, outputs poisoned with NaN; a peer with its own `check` is gated on its own run, at its
own tolerance); then every op at every batch timed by
kvbuffer.bench.timing.graph_median, with the states of `windows` disjoint windows of B rows
(together past twice the L2) and the buffered rows at staggered fills (row r at fill (r + i) mod C
in set i), so 1/C of the rows flush in each launch: the buffered step's median is its per-token
cost with the flush amortized, as in a server's steady state. In the same run: the
device-to-device copy bandwidth and the plain read of the same states (the roofline of a step
that must read every state once).
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from ..tuning import ChunkPolicy, local_tuning, make_shape
from . import KERNEL_BATCHES, timing

VERIFY_TOKENS = (2, 4, 5, 8)  # verify widths timed: T tokens fed per row (T - 1 drafts and the token before them)
GATE_TOLERANCE = 2e-2       # relative error against fp64 (bf16 activations and buffer entries)
INPUT_SETS = 4              # token inputs cycled (small next to the states)


def heads_of(preset: str) -> dict:
    """The generic head shape (family, Hk, Hv, K, V) of a model preset, as the planner reads it."""
    from .. import presets
    from ..plan import preset_geometry

    s = preset_geometry(presets.get(preset)).linear_shape
    return {"family": "gdn" if s.delta_rule else "mamba2", "Hk": s.num_k_heads, "Hv": s.num_v_heads,
            "K": s.head_k_dim, "V": s.head_v_dim}


class Pools:
    """States and buffers for `windows` disjoint windows of B rows, and the rows' staggered fills.

    Set s (what a timed callable receives) uses state window s % windows, buffer window
    (s + 1) % windows and fill pattern s % C; `sets` covers every pairing once.
    """

    def __init__(self, heads: Mapping, B: int, *, cap: int, C: int, device="cuda", seed: int = 0,
                 cache_bytes: float | None = None):
        """`cache_bytes`: what the windows together must exceed (default: twice the device's L2)."""
        if B < 1 or C < 1 or cap < C:
            raise ValueError(f"need B >= 1 and cap >= C >= 1, got B={B}, C={C}, cap={cap}")
        Hk, Hv, K, V = heads["Hk"], heads["Hv"], heads["K"], heads["V"]
        self.B, self.C, self.cap, self.device = B, C, cap, device
        self.row_state_bytes = Hv * K * V * 4
        self.entry_bytes = Hk * K * 2 + Hv * V * 2 + Hv * 4
        per_row = self.row_state_bytes + cap * self.entry_bytes
        cache = 2 * timing.l2_bytes() if cache_bytes is None else cache_bytes
        self.windows = timing.sets_to_exceed(B * per_row, cache)
        self.sets = self.windows * C // math.gcd(self.windows, C)
        self.rotated_bytes = self.windows * B * per_row
        g = torch.Generator(device=device).manual_seed(seed)
        n = self.windows * B
        self.state = 0.1 * torch.randn(n, Hv, K, V, device=device, generator=g)
        keys = torch.randn(n, cap, Hk, K, device=device, generator=g)
        self.buf_k = torch.nn.functional.normalize(keys, dim=-1).to(torch.bfloat16)
        self.buf_v = (0.3 * torch.randn(n, cap, Hv, V, device=device, generator=g)).to(torch.bfloat16)
        self.buf_g = torch.cumsum(-0.05 * torch.rand(n, cap, Hv, device=device, generator=g), dim=1)
        rows = torch.arange(B, device=device, dtype=torch.int32)
        self._slots = [(w * B + rows).to(torch.int32) for w in range(self.windows)]
        self._fills = [((rows + i) % C).to(torch.int32) for i in range(C)]

    def state_slots(self, s: int) -> torch.Tensor:
        return self._slots[s % self.windows]

    def buffer_slots(self, s: int) -> torch.Tensor:
        return self._slots[(s + 1) % self.windows]

    def lengths(self, s: int) -> torch.Tensor:
        return self._fills[s % self.C]

    def state_window(self, s: int) -> torch.Tensor:
        """The states of set s as one contiguous view (for peers that take a batch of states)."""
        w = s % self.windows
        return self.state[w * self.B:(w + 1) * self.B]

    def buffers(self, s: int) -> tuple:
        """(buf_k, buf_v, buf_g, buffer slots, lengths): the buffered kernels' arguments after the state."""
        return self.buf_k, self.buf_v, self.buf_g, self.buffer_slots(s), self.lengths(s)

    def step_bytes(self, kind: str, T: int = 1) -> float:
        """Fewest state and buffer bytes one launch must move (activations are the family's)."""
        state, entry, C = self.row_state_bytes, self.entry_bytes, self.C
        if kind == "recurrent":       # read and write every state
            return self.B * 2 * state
        if kind == "buffered":        # read the state, write it for 1/C of the rows, read the fill, write one entry
            return self.B * (state * (1 + 1 / C) + (C - 1) / 2 * entry + entry)
        if kind == "verify":          # read the state, read the fill, write T entries
            return self.B * (state + (C - 1) / 2 * entry + T * entry)
        if kind == "read":            # the plain read of the states
            return self.B * state
        raise ValueError(f"kind must be recurrent, buffered, verify or read, got {kind!r}")


@dataclass(frozen=True)
class Op:
    """One timed kernel: a callable of the set index and the fewest bytes a launch moves."""

    name: str
    run: Callable[[int], object]
    bytes: float


@dataclass(frozen=True)
class Peer:
    """Another project's kernel, as a family module loads it.

    op(pools, inputs): the timed callable of the set index; output(pools, inputs, s): its (B, Hv, V)
    recurrent-step output on set s, for the correctness gate (which may hand it copies in its own
    layout); or check(family, heads, C, device): its relative error against the fp64 reference on a
    run of its own (peers that keep state of their own, such as rings and cursors); `tolerance`: the
    gate's bound for it, where its documented precision is coarser than GATE_TOLERANCE."""

    name: str
    op: Callable[[Pools, "Inputs"], Callable[[int], object]]
    output: Callable[[Pools, "Inputs", int], torch.Tensor] | None
    check: Callable[..., float] | None = None
    tolerance: float = GATE_TOLERANCE


def plain_read(pools: Pools) -> Op:
    """A sum over each window's states: the read every decode step must at least do."""
    out = torch.empty(pools.B, device=pools.device)
    return Op("state_read", lambda s: torch.sum(pools.state_window(s), dim=(1, 2, 3), out=out),
              pools.step_bytes("read"))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(x).all()):
        return math.inf
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def check_gate(errors: Mapping[str, float], shape: str, tolerances: Mapping[str, float] | None = None) -> None:
    """Every error below its bound: `tolerances` (per name) or GATE_TOLERANCE."""
    bound = {k: (tolerances or {}).get(k, GATE_TOLERANCE) for k in errors}
    bad = {k: v for k, v in errors.items() if not v < bound[k]}
    if bad:
        raise RuntimeError(f"correctness gate failed for {shape} (relative error >= "
                           f"{ {k: bound[k] for k in bad} }): {bad}")


def peer_bytes(pools: Pools, compares: str, act_bytes: Callable[[int], float]) -> float:
    """The fewest bytes a launch of a peer moves: those of the op of ours it stands beside."""
    if compares == "verify5":
        return pools.step_bytes("verify", 5) + pools.B * act_bytes(5)
    return pools.step_bytes(compares) + pools.B * act_bytes(1)


def ours_beside(compares: str) -> str:
    """The op of ours whose ratio to a peer a row reports: the buffered step, or the verify of 5."""
    return "verify5" if compares == "verify5" else "buffered"


def time_ops(ops: list[Op], pools: Pools, *, launches: int, replays: int, cross_check: tuple[str, ...] = ()) -> dict:
    """{op: Timing}; the ops named in `cross_check` also get the profiler's device time."""
    out, profiled = {}, {}
    for op in ops:
        out[op.name] = timing.graph_median(op.run, pools.sets, rotated_bytes=pools.rotated_bytes,
                                           launches=launches, replays=replays)
        if op.name in cross_check:
            profiled[op.name] = timing.profiler_seconds(op.run, pools.sets, launches=launches)
    return {"timings": out, "profiler": profiled}


def make_row(shape: str, B: int, ops: list[Op], measured: dict, copy_Bps: float, peers: Mapping[str, str]) -> dict:
    """One batch's figures: µs, GB/s, fraction of copy bandwidth and of the plain state read, ratios
    (speedup_{ours}_vs_{peer}: the peer's time over ours, ours as `peers` (name -> compares) says)."""
    t = {name: tm.seconds for name, tm in measured["timings"].items()}
    moved = {op.name: op.bytes for op in ops}
    row = {"shape": shape, "B": B, "us": {k: v * 1e6 for k, v in t.items()},
           "profiler_us": {k: v * 1e6 for k, v in measured["profiler"].items()},
           "GBps": {k: moved[k] / v / 1e9 for k, v in t.items()}}
    row["frac_copy_bw"] = {k: g * 1e9 / copy_Bps for k, g in row["GBps"].items()}
    row["frac_state_read"] = {k: t["state_read"] / v for k, v in t.items() if k != "state_read"}
    row["speedup_buffered_vs_recurrent"] = t["recurrent"] / t["buffered"]
    for peer, compares in ((p, c) for p, c in peers.items() if p in t):
        ours = ours_beside(compares)
        row[f"speedup_{ours}_vs_{peer}"] = t[peer] / t[ours]
        if compares == "recurrent":
            row[f"speedup_recurrent_vs_{peer}"] = t[peer] / t["recurrent"]
    for T in VERIFY_TOKENS:
        row[f"verify{T}_over_step"] = t[f"verify{T}"] / t["buffered"]
    return row


def new_result(kind: str, *, C: int, cap: int, peers: Mapping[str, str], peer_note: str, launches: int,
               replays: int) -> dict:
    """The results JSON's header; "timing" is completed with the largest rotation once rows exist.
    "peer" is the family's first peer (what the plots draw), "peers" every one it names and
    "peer_compares" the op of ours each stands beside."""
    return {"benchmark": kind, "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "copy_GBps": timing.copy_bandwidth() / 1e9, "C": C, "cap": cap, "buffer_dtype": "bfloat16",
            "peer": next(iter(peers)), "peers": list(peers), "peer_compares": dict(peers), "peer_note": peer_note,
            "launches": launches,
            "replays": replays,
            "timing": "", "verify": "verifyT feeds T tokens per row: T - 1 drafts and the token before them",
            "gate": {}, "gate_bounds": {}, "configs": {}, "rows": []}


def finish_timing(result: dict, rotated: list[float]) -> None:
    """Record the method: the rotation is per (shape, batch); the line states the smallest one."""
    result["timing"] = timing.describe(result["launches"], result["replays"], min(rotated))
    result["rotated_MB"] = [round(r / 1e6) for r in rotated]


def table(result: dict) -> str:
    """µs per launch and the ratios, one line per (shape, batch); vT = a verify of T tokens (T - 1 drafts);
    "x/peer" is the peer's time over ours (buf: the buffered step, v5: the verify of 5)."""
    peers, nan = result.get("peers", [result["peer"]]), float("nan")
    ours = {p: ours_beside(result.get("peer_compares", {}).get(p, "recurrent")) for p in peers}
    short = {"buffered": "buf", "verify5": "v5"}
    w = max([12] + [len(p) + 1 for p in peers])
    lines = [f"{result['gpu']}  copy {result['copy_GBps']:.0f} GB/s  C={result['C']}  {result['timing']}",
             f"{'shape':18s} {'B':>5s} {'read':>8s} " + "".join(f"{p:>{w}s}" for p in peers)
             + f" {'rec':>8s} {'buf':>8s} {'v2':>8s} {'v5':>8s} {'v8':>8s} "
             + "".join(f"{short[ours[p]] + '/' + p:>{w + 4}s}" for p in peers)
             + f" {'buf/rec':>7s} {'v5/step':>7s} {'buf%read':>8s}"]
    for r in result["rows"]:
        u = r["us"]
        lines.append(f"{r['shape']:18s} {r['B']:5d} {u['state_read']:8.1f} "
                     + "".join(f"{u.get(p, nan):{w}.1f}" for p in peers)
                     + f" {u['recurrent']:8.1f} {u['buffered']:8.1f} {u['verify2']:8.1f} {u['verify5']:8.1f}"
                     f" {u['verify8']:8.1f} "
                     + "".join(f"{r.get(f'speedup_{ours[p]}_vs_{p}', nan):{w + 4}.2f}" for p in peers)
                     + f" {r['speedup_buffered_vs_recurrent']:7.2f} {r['verify5_over_step']:7.2f}"
                     f" {r['frac_state_read']['buffered']:8.2f}")
    return "\n".join(lines)


class Inputs:
    """Token inputs (INPUT_SETS sets per width), the layer's parameters and the outputs of one batch."""

    def __init__(self, family, heads: Mapping, B: int, *, device="cuda", seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.family = family
        widths = (1,) + VERIFY_TOKENS
        self.tokens = {T: [family.tokens(heads, B, T, g, device) for _ in range(INPUT_SETS)] for T in widths}
        self.params = family.params(heads, g, device)
        self.out = {T: torch.empty(B, T, heads["Hv"], heads["V"], device=device, dtype=torch.bfloat16) for T in widths}

    def kernel_args(self, T: int, s: int) -> tuple:
        """Our kernels' arguments before the state (the family's order)."""
        return self.family.kernel_args(self.tokens[T][s % INPUT_SETS], self.params)


def our_ops(kernels: Mapping, pools: Pools, inputs: Inputs, act_bytes: Callable[[int], float]) -> list[Op]:
    """The recurrent step, the buffered step and the verifies of VERIFY_TOKENS widths, as timed ops."""
    def recurrent(s):
        kernels["recurrent"].fn(*inputs.kernel_args(1, s), pools.state, pools.state_slots(s), inputs.out[1])

    def buffered(key, T):
        def run(s):
            kernels[key].fn(*inputs.kernel_args(T, s), pools.state, pools.state_slots(s), *pools.buffers(s),
                            inputs.out[T])
        return run

    B = pools.B
    ops = [Op("recurrent", recurrent, pools.step_bytes("recurrent") + B * act_bytes(1)),
           Op("buffered", buffered("buffered", 1), pools.step_bytes("buffered") + B * act_bytes(1))]
    ops += [Op(f"verify{T}", buffered(f"verify{T}", T), pools.step_bytes("verify", T) + B * act_bytes(T))
            for T in VERIFY_TOKENS]
    return ops


def gate(family, kernels: Mapping, heads: Mapping, peers: list[Peer], *, C: int, cap: int, B: int = 7,
         device="cuda") -> dict:
    """Relative error of every kernel (and every peer) against the family's fp64 reference.

    An awkward batch, fresh inputs, outputs poisoned with NaN, and fills chosen so that some rows
    sit at C - 1 and the buffered step's fused flush runs.
    """
    pools = Pools(heads, B, cap=cap, C=C, device=device, seed=1, cache_bytes=0)
    inputs = Inputs(family, heads, B, device=device, seed=1)
    s = C - 3  # fills (r + C - 3) mod C: row 2 is at C - 1
    errors = {}
    for key, T in [("recurrent", 1), ("buffered", 1)] + [(f"verify{T}", T) for T in VERIFY_TOKENS]:
        kind = key.rstrip("0123456789")
        want = family.reference(kind, inputs.tokens[T][s % INPUT_SETS], inputs.params, pools, s)
        state, bufs = pools.state.clone(), [b.clone() if torch.is_tensor(b) else b for b in pools.buffers(s)]
        out = torch.full_like(inputs.out[T], float("nan"))
        extra = () if kind == "recurrent" else tuple(bufs)
        kernels[key].fn(*inputs.kernel_args(T, s), state, pools.state_slots(s), *extra, out)
        errors[key] = rel_err(out[:, 0] if T == 1 else out, want)
    want = family.reference("recurrent", inputs.tokens[1][s % INPUT_SETS], inputs.params, pools, s)
    for peer in peers:
        errors[peer.name] = (peer.check(family, heads, C, device) if peer.check is not None
                             else rel_err(peer.output(pools, inputs, s), want))
    return errors


def kernel_configs(heads: Mapping, given: Mapping | None = None) -> dict:
    """Each timed kernel's tunables: `given` (one shape's --configs entry; a verify, being a buffered
    kernel of T tokens, follows "buffered" unless named) over what the runtime's JIT gives untuned."""
    from ..kernels.lookup import untuned_tunables

    fam, K, V = heads["family"], heads["K"], heads["V"]
    given = dict(given or {})
    step = given.get("buffered", untuned_tunables(fam, "buffered", K, V, group=heads["Hv"] // heads["Hk"]))
    return {"recurrent": untuned_tunables(fam, "recurrent", K, V), "buffered": step, "verify": step} | given


def tuned_tunables(record: Mapping, family: str, batch: int, C: int) -> dict:
    """What `kvbuffer tune` timed fastest in this batch's bucket: {"recurrent": .., "buffered": ..} for
    the kernels whose winner there was measured (the decode step of chunk size C in the plain-decoding
    layout). A winner recorded untuned is left out, so the caller keeps its own default."""
    bucket = ChunkPolicy.from_json(record["chunk_policy"]).bucket_for(batch)
    out = {}
    for kind, template in (("recurrent", f"{family}_recurrent"), ("buffered", f"{family}_buffered_step")):
        for w in record["winners"]:
            if (w["kernel"] == template and w["batch_bucket"] == bucket and w["chunk_size"] in (C, 0)
                    and not w.get("drafts") and w.get("median_us") is not None):
                out[kind] = dict(w["tunables"])
                break
    return out


def run(family, *, shapes, batches=KERNEL_BATCHES, C: int = 16, cap: int = 24, configs: Mapping | None = None,
        tuned: bool = False, launches: int = timing.DEFAULT_LAUNCHES, replays: int = timing.DEFAULT_REPLAYS,
        on_row: Callable[[dict], None] = lambda result: None) -> dict:
    """Gate, then time every op at every (shape, batch) for one family; returns the result dict.

    tuned: each batch times the recurrent and buffered steps `kvbuffer tune` picked for its bucket on
    this GPU (tuned_tunables; `configs` still overrides), each distinct set of kernels gated once."""
    timing.require_cuda(f"kvbuffer bench {family.NAME}")
    peers, notes = family.load_peers()
    print("\n".join(notes), flush=True)
    result = new_result(family.NAME, C=C, cap=cap, peers=family.PEERS, peer_note="; ".join(notes),
                        launches=launches, replays=replays)
    rotated = []
    for shape in shapes:
        heads = heads_of(shape)
        if heads["family"] != family.NAME:
            raise ValueError(f"shapes: {shape!r} is a {heads['family']} model, not {family.NAME}")
        record = local_tuning(make_shape(**heads))[0] if tuned else None
        built = {}  # the tunables (as text) -> their kernels, gated

        def kernels_for(B: int) -> dict:
            picked = tuned_tunables(record, family.NAME, B, C) if record else {}
            cfg = kernel_configs(heads, picked | dict((configs or {}).get(shape) or {}))
            name = json.dumps(cfg, sort_keys=True)
            if name not in built:
                kernels = family.build(heads, C=C, cap=cap, configs=cfg)
                errors = gate(family, kernels, heads, peers, C=C, cap=cap)
                print(f"gate {shape} {cfg}: " + " ".join(f"{k}={v:.2e}" for k, v in errors.items()), flush=True)
                bounds = {p.name: p.tolerance for p in peers}
                check_gate(errors, shape, bounds)
                result["gate"].setdefault(shape, errors)
                result["gate_bounds"].setdefault(shape, bounds)
                built[name] = kernels
            result["configs"].setdefault(shape, {})[str(B)] = cfg
            return built[name]

        for B in batches:
            kernels = kernels_for(B)
            pools, inputs = Pools(heads, B, cap=cap, C=C), Inputs(family, heads, B)
            act = lambda T: family.act_bytes(heads, T)  # noqa: E731
            ops = [plain_read(pools)] + our_ops(kernels, pools, inputs, act)
            ops += [Op(p.name, p.op(pools, inputs), peer_bytes(pools, family.PEERS[p.name], act)) for p in peers]
            measured = time_ops(ops, pools, launches=launches, replays=replays,
                                cross_check=("buffered",) + tuple(family.PEERS))
            row = make_row(shape, B, ops, measured, result["copy_GBps"] * 1e9, family.PEERS)
            result["rows"].append(row)
            rotated.append(pools.rotated_bytes)
            finish_timing(result, rotated)
            on_row(result)
            print(f"{shape:18s} B={B:5d} " + " ".join(f"{k}={v:8.1f}us" for k, v in row["us"].items()), flush=True)
            del pools, inputs, ops, measured
            torch.cuda.empty_cache()
    return result
