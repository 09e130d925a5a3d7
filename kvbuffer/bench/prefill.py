"""Prefill: the chunked prompt kernels against the servers' kernels, and the time to first token.

`kvbuffer bench prefill --what kernels|e2e` runs it.

kernels (one GPU): kvbuffer's chunked prefill (`our_kernel`: kvbuffer.kernels.prefill, its
decay-only form for Mamba-2) against FLA's `chunk_gated_delta_rule` (fla-core) and mamba_ssm's Triton
`mamba_chunk_scan_combined`, in one process on the same packed inputs: B prompts of P tokens
concatenated, `cu_seqlens`, an initial state per prompt, every final state written. The ops:

- gdn (Qwen3.5-9B heads): "kvbuffer" on q, k L2-normalised (q scaled by K**-0.5), g and beta; "fla" on
  the same q, k, g, beta (scale K**-0.5); "fla_qk_l2norm" on the raw q, k, normalised in the kernel
  (`use_qk_l2norm_in_kernel`, as vLLM and SGLang call it). g and beta are made before all three, as the
  servers make them (fused_gdn_gating).
- mamba2 (Nemotron-3-Nano heads): "mamba_ssm" on the layer's raw x, dt, A, B, C, D, dt_bias with
  dt_softplus (seq_idx and cu_seqlens when packed, as vLLM calls it); "kvbuffer" on the same raw
  inputs (its op does the front and the D skip in its kernels; dt made fp32 in the call, as the
  engine does). mamba_ssm 2.3 takes one initial state per batch row, so its packed call starts every
  prompt but the first from zero: packed Mamba-2 rows start every prompt from zero, for every op; B = 1
  starts from a random state.

Method: a correctness gate first: every op against the fp64 chunked reference (kvbuffer.reference
.chunked with every token folded) on awkward packed lengths and on one long prompt, outputs and final
states, relative error below kernels.GATE_TOLERANCE. Then every op timed by timing.graph_median, its
inputs in sets rotated past twice the L2 (one set where one alone exceeds it). An op that cannot be
captured in a CUDA graph is timed eagerly instead (CUDA events around `launches` calls, median of
`replays`); its row says so.

Breakdown (every row): each launch of kvbuffer's op (chunk table, prep, state pass, output) on its own,
`launches` calls captured in a CUDA graph, median of `replays`, on set 0's inputs with the workspace one
whole call filled (so its inputs are not rotated past the L2, unlike the whole op's); and the peers' stages
where their Python entry calls them by name (FLA's chunk_gated_delta_rule_fwd: cumsum, kkt, solve_tril,
w/u, fwd_h, fwd_o; mamba_ssm's _mamba_chunk_scan_combined_fwd: chunk cumsum, chunk state, state passing,
bmm, chunk scan), timed eagerly by CUDA events around each stage's call (launch gaps included), median of
`replays`; a peer whose stages cannot be found says so. Variants (VARIANTS: the tuner's choices, e.g. the
blockwise prep solve) run as extra ops "kvbuffer[name=value,...]" in the same run, gated like the others.

attention (one GPU, `--families attention`): the prompt's attention of the preset's attention layers
(kvbuffer.runtime.flash_prompt) on each backend: "flash" (FlashAttention-2, one call, causal aligned to the
bottom right) and "cudnn" (cuDNN's fused attention: one causal call for a fresh prompt, after a cached prefix
the split form, [prefix, no mask] + [piece, causal] merged by log-sum-exp). Cases per prompt length P: the
whole prompt fresh, the last piece of ATTENTION_PIECE tokens after the P - piece cached positions, and all of
the prompt's pieces one after the other (what the engine runs with max_prefill_tokens = piece). Gated first
against the fp64 reference (kvbuffer.reference.prefill_attention) on awkward lengths, then timed as the
kernels are (a CUDA graph; eager where the capture fails, labelled), caches rotated past twice the L2.
FLOPs: 4 H D per visible (query, key) pair.

Work: the FLOPs of the chunk form's matrix products, per value head and token, with C = 64 tokens per
chunk (every product counted as if per value head; the triangular solve and the masks not counted):
    delta rule (GDN):    6 C K + 4 C V + 6 K V
    decay only (SSD):    2 C (K + V) + 4 K V
times Hv and the tokens (`chunk_flops`). Every op of a row gets the same count (the peers' own chunk
sizes differ), so TFLOP/s compare as tokens/s do; the repository has no measured tensor-core peak to
set them against.

e2e (CUDA or CPU): time to first token, `LLM(...).generate(prompt, max_new_tokens=1)`, against stock
transformers' `generate` with one new token, B = 1, each side on its own random-weight model of the
preset's shapes (kvbuffer.bench.e2e.random_model; transformers' own init), built one after the other;
prefill time does not depend on the values (the MoE routing aside). Per length: one warm-up call,
then the median of `repeats`; on CUDA also the peak memory of the prefill, and the device-busy time and
kernel count of one more call under torch.profiler (`device_busy`): how much of the wall time the GPU
works. Each row says which path transformers took (FLA / mamba_ssm where importable and the inputs on
CUDA, else its torch path) and which backend kvbuffer's engine ran.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import statistics
import time
from typing import Callable, Mapping

import torch

from . import kernels as common
from . import timing

WHATS = ("kernels", "e2e")
FAMILIES = {"gdn": "qwen3.5-9b", "mamba2": "nemotron-3-nano",  # the preset whose heads each family times
            "attention": "qwen3.5-9b"}
ATTENTION_PIECE = 2048  # tokens per prompt piece of the attention rows (the engine's max_prefill_tokens)
ATTENTION_GATE = {"fresh": (3001, 0), "piece_after_prefix": (1000, 2001), "odd_piece": (77, 130),
                  "one_token": (1, 4096)}  # (T new tokens, cached positions)
PROMPT_LENS = (4096, 32768)  # kernels: tokens per prompt
E2E_PROMPT_LENS = (512, 4096, 16384)
BATCHES = (1, 8)
MIN_LEN, MAX_LEN = 512, 131072  # the kernels' prompt lengths
CHUNK = 64  # the chunk of the FLOP count (kvbuffer's and FLA's)
MAMBA_SSM_CHUNK = 128  # Nemotron-3's config chunk_size, which vLLM passes to the scan
GATE_LENGTHS = {"packed": (1000, 1, 63, 64, 65, 4097, 130, 7), "single": (3001,)}
DEFAULT_LAUNCHES, DEFAULT_REPLAYS = 4, 10  # each launch is a whole prefill (milliseconds)
# our op's tunables timed beside its defaults (built now, like the defaults without an artifact); each differs
# from the sm_90a defaults (pipelined state pass, staged stores; Mamba-2's heads_inner), so none is timed twice
VARIANTS = {"gdn": ({"states_stages": 0}, {"states_BV": 64, "states_stages": 2}, {"prep_solve": "blockwise"},
                    {"heads_inner": 1}, {"staged_stores": 0}),
            "mamba2": ({"states_BV": 16}, {"states_stages": 0}, {"heads_inner": 0}, {"staged_stores": 0})}
# the peers' stages, by the names their forward calls them (module globals of the peer's entry point)
PEER_STAGES = {
    "fla": ("chunk_local_cumsum", "chunk_scaled_dot_kkt_fwd", "solve_tril", "recompute_w_u_fwd",
            "chunk_gated_delta_rule_fwd_h", "chunk_fwd_o", "l2norm_fwd"),
    "mamba_ssm": ("_chunk_cumsum_fwd", "_chunk_state_fwd", "chunk_state_varlen", "_state_passing_fwd",
                  "_bmm_chunk_fwd", "_chunk_scan_fwd"),
}


def check_lengths(lengths, *, lo: int = 1, hi: int | None = None, option: str = "--prompt-lens") -> tuple[int, ...]:
    """The prompt lengths as a tuple of ints in [lo, hi]; ValueError naming `option` otherwise."""
    values = tuple(lengths)
    bad = [n for n in values if isinstance(n, bool) or not isinstance(n, int) or n < lo or (hi is not None and n > hi)]
    if not values or bad:
        span = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{option}: prompt lengths must be integers in {span}, got {list(values)}")
    return values


def chunk_flops(delta_rule: bool, tokens: int, Hv: int, K: int, V: int, C: int = CHUNK) -> float:
    """The chunk form's matrix-product FLOPs for `tokens` tokens of Hv value heads (module docstring)."""
    per_token = 6 * C * K + 4 * C * V + 6 * K * V if delta_rule else 2 * C * (K + V) + 4 * K * V
    return float(Hv * tokens * per_token)


# -- the kernels' inputs and ops --------------------------------------------------------------------

class Packed:
    """`sets` copies of the packed inputs of B prompts, a state pool of `sets` windows of B states, and
    the layer's parameters; set s's prompts use window s (slots s*B .. s*B + B - 1)."""

    def __init__(self, family: str, heads: Mapping, lengths, *, sets: int = 1, zero_states: bool = False,
                 device="cuda", seed: int = 0):
        from ..reference.gating import gdn_front, l2norm

        self.family, self.heads, self.lengths, self.sets = family, dict(heads), tuple(lengths), sets
        B, N = len(self.lengths), sum(self.lengths)
        self.B, self.N, self.device = B, N, device
        Hv, K, V = heads["Hv"], heads["K"], heads["V"]
        g = torch.Generator(device=device).manual_seed(seed)
        fam = importlib.import_module(f"kvbuffer.bench.{family}")  # its token inputs and parameters
        self.params = fam.params(heads, g, device)
        self.cu = torch.tensor([0, *torch.tensor(self.lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        self.tokens = []
        for _ in range(sets):
            toks = tuple(t[0] for t in fam.tokens(heads, 1, N, g, device))  # (N, ...) each
            if family == "gdn":
                q, k, v, a, b = toks
                qn, kn, gate, beta = gdn_front(q, k, a, b, *self.params)
                self.tokens.append(dict(q=q, k=k, v=v, qn=qn.to(torch.bfloat16), kn=kn.to(torch.bfloat16),
                                        q_unit=l2norm(q.float()).to(torch.bfloat16), g=gate, beta=beta))
            else:
                x, dt, Bm, Cm, _ = toks  # the gate z stays outside the scan
                self.tokens.append(dict(x=x, dt=dt, B=Bm, C=Cm))
        self.state = torch.zeros(sets * B, Hv, K, V, device=device)
        if not zero_states:
            self.state.normal_(0.0, 0.1, generator=g)
        rows = torch.arange(B, dtype=torch.int32, device=device)
        self._slots = [(s * B + rows).to(torch.int32) for s in range(sets)]
        self.out = torch.empty(N, Hv, V, dtype=torch.bfloat16, device=device)

    def slots(self, s: int) -> torch.Tensor:
        return self._slots[s % self.sets]

    def window(self, s: int) -> torch.Tensor:
        """Set s's initial states as one contiguous view of the pool (B, Hv, K, V)."""
        w = s % self.sets
        return self.state[w * self.B:(w + 1) * self.B]

    def set_bytes(self) -> int:
        """One set's bytes: its token inputs (every op's), its states read and written, the output."""
        per_token = sum(t.nbytes for t in self.tokens[0].values()) / self.N
        return int(self.N * per_token + 2 * self.window(0).nbytes + self.out.nbytes)


def our_kernel(heads: Mapping, *, delta_rule: bool, tunables: Mapping | None = None) -> Callable:
    """kvbuffer's chunked prefill for one head shape, as the engine loads it (the tuned artifact for the
    batch, else compiled now with the spec's defaults; with `tunables`, compiled now with those): GDN's
    run(q, k, v, g, beta, cu_seqlens, state, state_slots, out), Mamba-2's run(x, dt, A_log, dt_bias, B, C, D,
    cu_seqlens, state, state_slots, out) -> out (N, Hv, V), each final state written at its slot;
    run.launches(*the same arguments) -> [(part, a call of that launch alone)], the workspace allocated;
    run.load(batch) -> the CompiledOp.
    The one place this module calls the kernel's lookup, builder and launcher."""
    from ..errors import ArtifactError
    from ..kernels import launch, lookup, prefill

    family = "gdn" if delta_rule else "mamba2"

    @functools.cache
    def built():  # compiled once, whatever the batch
        return prefill.build_gdn_chunk_prefill(heads["Hk"], heads["Hv"], heads["K"], heads["V"],
                                               delta_rule=delta_rule, **(tunables or {}))

    @functools.cache
    def load(batch: int):
        if tunables:
            return built()
        try:
            return lookup.kernel_for(launch.chunk_prefill_key(family, *_shaped(heads)), batch)
        except ArtifactError:
            return built()

    def run(*args):
        *tokens, cu_seqlens, state, state_slots, out = args
        op = load(cu_seqlens.shape[0] - 1)
        if delta_rule:
            return prefill.chunk_prefill(op, *tokens, cu_seqlens, state, state_slots, out, check_values=False)
        return prefill.mamba2_chunk_prefill(op, *tokens, cu_seqlens, state, state_slots, out=out,
                                            check_values=False)

    def launches(*args):
        *tokens, cu_seqlens, state, state_slots, out = args
        op = load(cu_seqlens.shape[0] - 1)
        parts = prefill.gdn_launches(op, *tokens, cu_seqlens, state, state_slots, out) if delta_rule else \
            prefill.mamba2_launches(op, *tokens, cu_seqlens, state, state_slots, 0.0, None, out)
        return [(part, functools.partial(op.fn[part], *part_args)) for part, part_args in parts]

    run.launches, run.load = launches, load
    return run


def variant_name(tunables: Mapping) -> str:
    return "kvbuffer[" + ",".join(f"{k}={v}" for k, v in sorted(tunables.items())) + "]"


def our_args(inp: "Packed", s: int) -> tuple:
    """Our op's arguments for set s (Mamba-2's dt made fp32 here, as the engine does)."""
    t = inp.tokens[s % inp.sets]
    rows = (inp.cu, inp.state, inp.slots(s), inp.out)
    if inp.family == "gdn":
        return (t["qn"], t["kn"], t["v"], t["g"], t["beta"], *rows)
    A_log, dt_bias, D = inp.params
    return (t["x"], t["dt"].float(), A_log, dt_bias, t["B"], t["C"], D, *rows)


def _shaped(heads: Mapping) -> tuple:
    """Meta tensors of a key-side (1, Hk, K) and a value-side (1, Hv, V) input: what a kernel key is read from."""
    return (torch.empty(1, heads["Hk"], heads["K"], device="meta"),
            torch.empty(1, heads["Hv"], heads["V"], device="meta"))


def load_peers(family: str) -> tuple[dict, list[str]]:
    """({peer name: its function}, one line per peer saying what was loaded or why not)."""
    if family == "gdn":
        try:
            import fla
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError as e:
            return {}, [f"fla: not importable ({e}); its rows are skipped (pip install fla-core)"]
        note = (f"fla-core {getattr(fla, '__version__', '?')} chunk_gated_delta_rule: cu_seqlens, initial_state, "
                "output_final_state=True, scale K**-0.5, g and beta given")
        return ({"fla": chunk_gated_delta_rule, "fla_qk_l2norm": chunk_gated_delta_rule},
                [f"fla: {note}, q and k normalised", f"fla_qk_l2norm: {note}, use_qk_l2norm_in_kernel on raw q and k"])
    from .mamba2 import import_mamba_ssm

    try:
        fn, extra = import_mamba_ssm("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
    except ImportError as e:
        return {}, [f"mamba_ssm: not importable ({e}); its rows are skipped (its Triton modules suffice: put them "
                    "on PYTHONPATH)"]
    import mamba_ssm

    return {"mamba_ssm": fn}, [f"mamba_ssm: {getattr(mamba_ssm, '__version__', '?')} Triton mamba_chunk_scan_combined, "
                               f"chunk_size {MAMBA_SSM_CHUNK}, dt_bias, dt_softplus, D, seq_idx and cu_seqlens "
                               f"(return_varlen_states) when packed, initial_states at B = 1{extra}"]


def make_ops(inp: Packed, ours: Callable, peers: Mapping, variants: Mapping | None = None) -> dict:
    """{op name: f(set index) -> (output (N, Hv, V), final states (B, Hv, K, V) in kvbuffer's layout, or None
    where the op wrote them into the pool at the set's slots, as our kernel does)}; `variants` {name: run}
    are more of ours.

    Everything an op's call needs besides its inputs (A = -exp(A_log), seq_idx, mamba_ssm's initial
    states in its (H, P, N) layout) is made here, before any timing."""
    def kernel(run):
        def op(s):
            run(*our_args(inp, s))
            return inp.out, None
        return op

    ops = {"kvbuffer": kernel(ours), **{name: kernel(run) for name, run in (variants or {}).items()}}
    if inp.family == "gdn":
        return {**ops, **_gdn_ops(inp, peers)}
    return {**ops, **_mamba2_ops(inp, peers)}


def _gdn_ops(inp: Packed, peers) -> dict:
    K = inp.heads["K"]
    cu_long = inp.cu.long()

    def fla(fn, raw: bool):
        def run(s):
            t = inp.tokens[s % inp.sets]
            q, k = (t["q"], t["k"]) if raw else (t["q_unit"], t["kn"])
            o, final = fn(q[None], k[None], t["v"][None], t["g"][None], t["beta"][None], scale=K ** -0.5,
                          initial_state=inp.window(s), output_final_state=True, cu_seqlens=cu_long,
                          use_qk_l2norm_in_kernel=raw)
            return o[0], final
        return run

    ops = {}
    if "fla" in peers:
        ops["fla"] = fla(peers["fla"], raw=False)
        ops["fla_qk_l2norm"] = fla(peers["fla_qk_l2norm"], raw=True)
    return ops


def _mamba2_ops(inp: Packed, peers) -> dict:
    A = -torch.exp(inp.params[0].float())
    ops = {}
    if "mamba_ssm" in peers:
        ops["mamba_ssm"] = _mamba_ssm_op(inp, peers["mamba_ssm"], A)
    return ops


def _mamba_ssm_op(inp: Packed, fn, A):
    """mamba_chunk_scan_combined as vLLM calls it on a packed batch (B = 1: with the initial state)."""
    _, dt_bias, D = inp.params
    packed = inp.B > 1
    seq_idx = torch.repeat_interleave(torch.arange(inp.B, dtype=torch.int32, device=inp.device),
                                      inp.cu.diff().long())[None] if packed else None
    initial = [None if packed else inp.window(s).transpose(-1, -2).contiguous() for s in range(inp.sets)]

    def run(s):
        t = inp.tokens[s % inp.sets]
        out = fn(t["x"][None], t["dt"][None], A, t["B"][None], t["C"][None], MAMBA_SSM_CHUNK, D=D, dt_bias=dt_bias,
                 dt_softplus=True, initial_states=initial[s % inp.sets], seq_idx=seq_idx, cu_seqlens=inp.cu,
                 return_final_states=not packed, return_varlen_states=packed)
        y, final = out
        return y[0], final.transpose(-1, -2)  # its (B, H, P, N) states in kvbuffer's (B, H, N, P)
    return run


def reference(inp: Packed, s: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 outputs (N, Hv, V) of the layer and of the recurrence alone (Mamba-2's without the D skip;
    GDN's are the same) and final states (B, Hv, K, V) of set s, every token folded
    (kvbuffer.reference.chunked with flush_at = 1), from a copy of the pool."""
    from ..reference import chunked, chunked_ops

    h, B, f64 = inp.heads, inp.B, torch.float64
    state = inp.state.to(f64)
    dev = state.device
    bufs = (torch.zeros(B, 1, h["Hk"], h["K"], dtype=f64, device=dev), torch.zeros(B, 1, h["Hv"], h["V"], dtype=f64,
            device=dev), torch.zeros(B, 1, h["Hv"], dtype=f64, device=dev))
    rows = (torch.arange(B, dtype=torch.int32, device=dev), torch.zeros(B, dtype=torch.int32, device=dev))
    t, slots = {k: v.to(f64) for k, v in inp.tokens[s % inp.sets].items()}, inp.slots(s)
    if inp.family == "gdn":
        o, _ = chunked.prefill(t["qn"], t["kn"], t["v"], t["g"], t["beta"], inp.cu, state, slots, *bufs, *rows,
                               flush_at=1)
        return o, o, state[slots.long()]
    A_log, dt_bias, D = (p.to(f64) for p in inp.params)
    y, _ = chunked_ops.mamba2_prefill(t["x"], t["dt"], A_log, dt_bias, t["B"], t["C"], D, inp.cu, state, slots,
                                      *bufs, *rows, flush_at=1)
    return y, y - D[:, None] * t["x"], state[slots.long()]


def gate(family: str, heads: Mapping, ours: Callable, peers: Mapping, *, device="cuda",
         cases: Mapping = GATE_LENGTHS, variants: Mapping | None = None) -> dict:
    """{"op/case/o" and "op/case/state": relative error against the fp64 reference} for every op (our
    `variants` too), on `cases` (outputs poisoned with NaN first; each op from the same starting pool)."""
    errors = {}
    for case, lengths in cases.items():
        inp = Packed(family, heads, lengths, zero_states=family == "mamba2" and len(lengths) > 1, device=device,
                     seed=1)
        want_y, _, want_s = reference(inp)
        start = inp.state.clone()
        for name, op in make_ops(inp, ours, peers, variants).items():
            inp.state.copy_(start)
            inp.out.fill_(float("nan"))
            o, final = op(0)
            final = inp.state[inp.slots(0).long()] if final is None else final
            errors[f"{name}/{case}/o"] = common.rel_err(o, want_y)
            errors[f"{name}/{case}/state"] = common.rel_err(final, want_s)
    return errors


def eager_median(fn: Callable[[int], object], sets: int, *, launches: int, replays: int) -> float:
    """Median seconds per call of `launches` eager calls between two CUDA events (after one warm-up call)."""
    fn(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(launches):
            fn(i % sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / launches)
    return statistics.median(times)


def time_op(fn: Callable[[int], object], inp: Packed, rotated: float, *, launches: int, replays: int):
    """(seconds per call, "graph" or "eager: why the capture failed")."""
    return time_sets(fn, inp.sets, rotated, launches=launches, replays=replays)


def time_sets(fn: Callable[[int], object], sets: int, rotated: float, *, launches: int, replays: int):
    """time_op for fn over `sets` input sets."""
    try:
        return timing.graph_median(fn, sets, rotated_bytes=rotated, launches=launches, replays=replays).seconds, \
            "graph"
    except RuntimeError as e:  # a peer that syncs with the host inside its call cannot be captured
        torch.cuda.synchronize()
        why = str(e).splitlines()[0][:160]
        return eager_median(fn, sets, launches=launches, replays=replays), f"eager: capture failed ({why})"


def kernel_row(family: str, preset: str, heads: Mapping, B: int, P: int, measured: Mapping) -> dict:
    """One (family, B, P)'s figures: µs, tokens/s, TFLOP/s per op, and each peer's time over kvbuffer's."""
    tokens = B * P
    flops = chunk_flops(family == "gdn", tokens, heads["Hv"], heads["K"], heads["V"])
    secs = {op: s for op, (s, _) in measured.items()}
    row = {"family": family, "preset": preset, "B": B, "P": P, "tokens": tokens, "flops": flops,
           "us": {op: s * 1e6 for op, s in secs.items()}, "tokens_per_s": {op: tokens / s for op, s in secs.items()},
           "tflops": {op: flops / s / 1e12 for op, s in secs.items()},
           "method": {op: m for op, (_, m) in measured.items()}}
    row["over_kvbuffer"] = {op: s / secs["kvbuffer"] for op, s in secs.items() if op != "kvbuffer"}
    return row


def new_result(what: str, **fields) -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"benchmark": f"prefill_{what}", "date": datetime.date.today().isoformat(), "gpu": gpu, **fields,
            "rows": []}


def run_kernels(*, families=("gdn", "mamba2"), prompt_lens=PROMPT_LENS, batches=BATCHES,
                launches: int = DEFAULT_LAUNCHES, replays: int = DEFAULT_REPLAYS,
                on_row: Callable[[dict], None] = lambda result: None, variants: Mapping | None = None) -> dict:
    """Gate, then time every op at every (family, B, P), each launch of ours and each peer's stages too (the
    row's "breakdown"); `variants` {family: [tunables, ...]} (default VARIANTS) are more of ours, timed in the
    same run. Returns the result dict."""
    check_lengths(prompt_lens, lo=MIN_LEN, hi=MAX_LEN)
    check_lengths(batches, option="--batches")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"--families: unknown {unknown}; families: {', '.join(FAMILIES)}")
    timing.require_cuda("kvbuffer bench prefill --what kernels")
    result = new_result("kernels", flops=f"chunk form, C = {CHUNK}: Hv x tokens x (6CK + 4CV + 6KV) (delta rule), "
                                         "(2C(K + V) + 4KV) (decay only)", launches=launches, replays=replays,
                        timing=f"cuda-graph, {launches} launches, median of {replays} replays, inputs rotated past "
                               "twice the L2 (eager where a capture failed: see each row's method)", peers={}, gate={})
    for family in families:
        preset = FAMILIES[family]
        if family == "attention":
            run_attention(result, preset, prompt_lens, batches, launches=launches, replays=replays, on_row=on_row)
            continue
        heads = common.heads_of(preset)
        peers, notes = load_peers(family)
        print("\n".join(notes), flush=True)
        result["peers"][family] = notes
        ours = our_kernel(heads, delta_rule=family == "gdn")
        mine = {variant_name(t): our_kernel(heads, delta_rule=family == "gdn", tunables=t)
                for t in (VARIANTS if variants is None else variants).get(family, ())}
        mine = _built_variants(mine, result.setdefault("dropped_variants", {}))
        errors = gate(family, heads, ours, peers, variants=mine)
        print(f"gate {family}: " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()), flush=True)
        result["gate"][family] = errors
        for name in [n for n in mine if any(not v < common.GATE_TOLERANCE for k, v in errors.items()
                                            if k.startswith(n + "/"))]:
            result["dropped_variants"][name] = "failed the correctness gate"
            print(f"{name}: dropped, it failed the correctness gate", flush=True)
            del mine[name]
        common.check_gate({k: v for k, v in errors.items() if k.split("/")[0] not in result["dropped_variants"]},
                          preset)
        for B in batches:
            for P in prompt_lens:
                result["rows"].append(_time_case(family, preset, heads, B, P, ours, peers, launches, replays, mine))
                on_row(result)
    return result


def _built_variants(variants: Mapping, dropped: dict) -> dict:
    """The variants that compile (each built now, once); the others go to `dropped` with their error: a
    variant that does not build or fails the gate costs its own rows only."""
    kept = {}
    for name, run in variants.items():
        try:
            run.load(1)
            kept[name] = run
        except Exception as e:  # noqa: BLE001 (a template's own error, reported in the result)
            dropped[name] = f"did not build: {' '.join(str(e).split())[:300]}"
            print(f"{name}: dropped, it did not build ({dropped[name]})", flush=True)
    return kept


def _time_case(family, preset, heads, B, P, ours, peers, launches, replays, variants=None) -> dict:
    probe = Packed(family, heads, (P,) * B, sets=1, zero_states=family == "mamba2" and B > 1)
    sets = timing.sets_to_exceed(probe.set_bytes(), 2 * timing.l2_bytes(), at_least=1)
    inp = probe if sets == 1 else Packed(family, heads, (P,) * B, sets=sets, zero_states=family == "mamba2" and B > 1)
    del probe
    rotated = sets * inp.set_bytes()
    ops = make_ops(inp, ours, peers, variants)
    measured = {name: time_op(op, inp, rotated, launches=launches, replays=replays) for name, op in ops.items()}
    row = kernel_row(family, preset, heads, B, P, measured)
    row["rotated_MB"] = round(rotated / 1e6)
    row["breakdown"] = {name: our_breakdown(run, inp, launches=launches, replays=replays)
                        for name, run in {"kvbuffer": ours, **(variants or {})}.items()}
    for peer, fn in peers.items():
        if peer in PEER_STAGES:
            row["breakdown"][peer] = peer_breakdown(fn, PEER_STAGES[peer], ops[peer], replays=replays)
    print(f"{family:6s} B={B:2d} P={P:6d} " + " ".join(f"{k}={v / 1e3:.2f}ms" for k, v in row["us"].items()), flush=True)
    print(breakdown_lines(row), flush=True)
    del inp
    torch.cuda.empty_cache()
    return row


def our_breakdown(run: Callable, inp: Packed, *, launches: int, replays: int) -> dict:
    """{part: µs} of each launch of our op alone (module docstring), in launch order, and their "sum"."""
    parts = run.launches(*our_args(inp, 0))
    for _, call in parts:  # the workspace each launch reads, filled in order
        call()
    torch.cuda.synchronize()
    us = {part: timing.graph_median(lambda i, call=call: call(), 1, rotated_bytes=0, launches=launches,
                                    replays=replays).seconds * 1e6 for part, call in parts}
    return {**us, "sum": sum(us.values())}


def peer_breakdown(fn: Callable, stages: tuple, op: Callable[[int], object], *, replays: int) -> dict | str:
    """{stage: µs per call of the peer} by CUDA events around each named stage its entry point's module calls
    (eager: launch gaps included), median of `replays` calls after one warm-up, and their "sum"; a line
    saying why where no stage is found."""
    import inspect

    scope = inspect.unwrap(fn).__globals__
    found = [name for name in stages if callable(scope.get(name))]
    if not found:
        return f"not separable: none of {', '.join(stages)} in {scope.get('__name__', '?')}"
    events: dict[str, list] = {name: [] for name in found}
    originals = {name: scope[name] for name in found}

    def timed(name, original):
        def stage(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = original(*args, **kwargs)
            end.record()
            events[name].append((start, end))
            return out
        return stage

    scope.update({name: timed(name, f) for name, f in originals.items()})
    try:
        op(0)
        for name in found:
            events[name].clear()
        per_call = {name: [] for name in found}
        for _ in range(replays):
            op(0)
            torch.cuda.synchronize()
            for name in found:
                per_call[name].append(sum(a.elapsed_time(b) for a, b in events[name]) * 1e3)
                events[name].clear()
    finally:
        scope.update(originals)
    us = {name: statistics.median(t) for name, t in per_call.items() if any(t)}
    return {**us, "sum": sum(us.values())} if us else f"not separable: {', '.join(found)} were not called"


def breakdown_lines(row: dict) -> str:
    """One line per op of a row's breakdown: µs per launch or stage."""
    lines = []
    for op, parts in row.get("breakdown", {}).items():
        body = parts if isinstance(parts, str) else " ".join(f"{k}={v:.1f}" for k, v in parts.items())
        lines.append(f"  {row['family']:6s} B={row['B']:2d} P={row['P']:6d}  {op:16s} us: {body}")
    return "\n".join(lines)


def kernels_table(result: dict) -> str:
    lines = [f"{result['gpu']}  {result['timing']}",
             f"{'family':7s} {'B':>3s} {'P':>7s}  {'op':16s} {'ms':>9s} {'Mtok/s':>8s} {'TFLOP/s':>8s} {'x kvb':>6s}"]
    for r in result["rows"]:
        for op in r["us"]:
            over = r["over_kvbuffer"].get(op)
            lines.append(f"{r['family']:7s} {r['B']:3d} {r['P']:7d}  {op:16s} {r['us'][op] / 1e3:9.3f} "
                         f"{r['tokens_per_s'][op] / 1e6:8.3f} {r['tflops'][op]:8.1f} "
                         + (f"{over:6.2f}" if over is not None else f"{'':6s}")
                         + ("" if r["method"][op] == "graph" else "  (eager)"))
    lines.append("x kvb: the op's time over kvbuffer's (above 1: kvbuffer is faster)")
    if result.get("attention_rows"):
        lines.append(attention_table(result["attention_rows"]))
    breakdown = [breakdown_lines(r) for r in result["rows"] if r.get("breakdown")]
    if breakdown:
        lines += ["per launch (ours: each launch alone in a CUDA graph; peers: CUDA events around each stage)",
                  *breakdown]
    return "\n".join(lines)


# -- the prompt's attention: cuDNN against FlashAttention-2 -----------------------------------------

def attention_heads(preset: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of the preset's attention layers."""
    from .. import presets

    c = presets.get(preset).config
    return c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]


class PromptKV:
    """`sets` copies of B rows' caches of P positions (slot s * B + b) and the queries of every piece."""

    def __init__(self, heads: tuple, B: int, P: int, *, sets: int = 1, device="cuda", seed: int = 0):
        H, Hkv, D = heads
        g = torch.Generator(device=device).manual_seed(seed)
        self.B, self.P, self.sets, self.scale = B, P, sets, D ** -0.5
        self.k, self.v = (torch.randn(sets * B, P, Hkv, D, generator=g, device=device).bfloat16() for _ in range(2))
        self.q = torch.randn(B, P, H, D, generator=g, device=device).bfloat16()

    def call(self, s: int, start: int, T: int, backend: str) -> torch.Tensor:
        """T new tokens after `start` cached positions of set s, on `backend`."""
        rows = slice(s * self.B, (s + 1) * self.B)
        k, v = self.k[rows, start:start + T], self.v[rows, start:start + T]
        slots = list(range(s * self.B, (s + 1) * self.B))
        from ..runtime import flash_prompt

        return flash_prompt.flash_prompt_attention(self.q[:, start:start + T], k, v, self.k, self.v, slots,
                                                   [start] * self.B, self.scale, backend=backend)


def attention_cases(P: int, piece: int = ATTENTION_PIECE) -> dict:
    """{case: [(cached, T) of each call]}: the fresh prompt, its last piece, all of its pieces in order."""
    starts = range(0, P, piece)
    return {"fresh": [(0, P)], "last_piece": [(starts[-1], P - starts[-1])],
            "pieces": [(a, min(piece, P - a)) for a in starts]}


def attention_backends(heads: tuple, device="cuda") -> tuple[str, ...]:
    """The backends the attention rows time: FlashAttention-2, and cuDNN where torch's gate takes the heads."""
    from ..runtime import cudnn_prompt

    H, Hkv, D = heads
    probe = torch.empty(1, 2, H, D, device=device, dtype=torch.bfloat16)
    cudnn = cudnn_prompt.available(probe, torch.empty(1, 2, Hkv, D, device=device, dtype=torch.bfloat16))
    return ("flash", "cudnn") if cudnn else ("flash",)


def attention_gate(heads: tuple, *, device="cuda", cases: Mapping = ATTENTION_GATE) -> dict:
    """{"backend/case": relative error against the fp64 reference} for every backend."""
    from ..reference.prefill_attention import prefill_attention

    errors = {}
    for case, (T, cached) in cases.items():
        inp = PromptKV(heads, 1, cached + T, device=device, seed=1)
        H, D = heads[0], heads[2]
        one = torch.tensor([0, T], device=device)
        want = prefill_attention(inp.q[0, cached:].double(), inp.k.double(), inp.v.double(), one,
                                 torch.zeros(1, dtype=torch.int64, device=device),
                                 torch.tensor([cached], device=device), inp.scale)
        for backend in attention_backends(heads, device):
            got = inp.call(0, cached, T, backend)
            errors[f"{backend}/{case}"] = common.rel_err(got.reshape(T, H, D), want)
    return errors


def attention_flops(heads: tuple, calls) -> float:
    """4 H D per visible (query, key) pair: T new tokens after c cached positions see T c + T (T + 1) / 2."""
    H, _, D = heads
    return sum(4.0 * H * D * (T * c + T * (T + 1) / 2) for c, T in calls)


def run_attention(result: dict, preset: str, prompt_lens, batches, *, launches: int, replays: int,
                  on_row: Callable[[dict], None]) -> None:
    """Gate, then the attention rows of every (B, P, case) into result["attention_rows"]."""
    heads = attention_heads(preset)
    if "cudnn" not in attention_backends(heads):
        print("attention: torch's gate refuses cuDNN for these heads here; FlashAttention-2 alone", flush=True)
    errors = attention_gate(heads)
    print("gate attention: " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()), flush=True)
    result["gate"]["attention"] = errors
    common.check_gate(errors, preset)
    rows = result.setdefault("attention_rows", [])
    for B in batches:
        for P in prompt_lens:
            set_bytes = 2 * B * P * heads[1] * heads[2] * 2  # both caches, bf16
            sets = timing.sets_to_exceed(set_bytes, 2 * timing.l2_bytes(), at_least=1)
            inp = PromptKV(heads, B, P, sets=sets)
            for case, calls in attention_cases(P).items():
                def op(backend, calls=calls):
                    return lambda s: [inp.call(s, c, T, backend) for c, T in calls]
                measured = {b: time_sets(op(b), sets, sets * set_bytes, launches=launches, replays=replays)
                            for b in attention_backends(heads)}
                flops = B * attention_flops(heads, calls)
                rows.append({"family": "attention", "preset": preset, "heads": list(heads), "B": B, "P": P,
                             "case": case, "calls": len(calls), "piece": ATTENTION_PIECE, "flops": flops,
                             "us": {b: t * 1e6 for b, (t, _) in measured.items()},
                             "tflops": {b: flops / t / 1e12 for b, (t, _) in measured.items()},
                             "method": {b: m for b, (_, m) in measured.items()},
                             "rotated_MB": round(sets * set_bytes / 1e6)})
                print(attention_line(rows[-1]), flush=True)
                on_row(result)
            del inp
            torch.cuda.empty_cache()


def attention_line(r: dict) -> str:
    ops = " ".join(f"{b}={us / 1e3:.3f}ms ({r['tflops'][b]:.0f} TFLOP/s"
                   + (")" if r["method"][b] == "graph" else ", eager)") for b, us in r["us"].items())
    ratio = r["us"]["flash"] / r["us"]["cudnn"] if "cudnn" in r["us"] and "flash" in r["us"] else None
    return (f"attention B={r['B']:2d} P={r['P']:6d} {r['case']:10s} ({r['calls']} calls) {ops}"
            + (f"  flash/cudnn {ratio:.2f}" if ratio is not None else ""))


def attention_table(rows) -> str:
    """The attention rows, one line each: ms, TFLOP/s and FlashAttention-2's time over cuDNN's."""
    head = (f"prompt attention ({rows[0]['preset']}: H, Hkv, D = {tuple(rows[0]['heads'])}; pieces of "
            f"{rows[0]['piece']} tokens; cudnn after a prefix = [prefix, no mask] + [piece, causal] merged)")
    return "\n".join([head, *(attention_line(r) for r in rows)])


# -- end to end: time to first token ---------------------------------------------------------------

def hf_config(preset: str) -> dict:
    """The preset's config as transformers' config class takes it (num_hidden_layers from the layer list)."""
    from .. import presets

    cfg = presets.get(preset).hf_config()
    if "layer_types" in cfg:
        cfg["num_hidden_layers"] = len(cfg["layer_types"])
    return cfg


def hf_model(preset: str, device, dtype) -> torch.nn.Module:
    """Stock transformers' model of the preset's shapes, random weights (transformers' init), built on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**hf_config(preset))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def hf_path(family: str, device) -> str:
    """Which linear-attention kernel transformers runs the prompt on: the package's where it is importable
    and the inputs are on CUDA (transformers picks it so), else its torch path."""
    package, module, fn = {"gdn": ("fla", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
                           "mamba2": ("mamba_ssm", "mamba_ssm.ops.triton.ssd_combined",
                                      "mamba_chunk_scan_combined")}[family]
    if torch.device(device).type != "cuda":
        return f"torch (inputs on {torch.device(device).type})"
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"torch ({package} not importable: {e})"
    return f"{package} {getattr(importlib.import_module(package), '__version__', '?')} {fn}"


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure_ttft(call: Callable[[], object], *, device, repeats: int) -> dict:
    """One warm-up call, then `repeats` timed ones: median seconds, and on CUDA the peak memory of the
    last (absolute, and above what was allocated before it)."""
    call()
    _sync(device)
    cuda = torch.device(device).type == "cuda"
    times, before = [], 0
    for _ in range(repeats):
        if cuda:
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return {"ttft_s": statistics.median(times), "peak_gib": peak / 2**30 if cuda else None,
            "prefill_gib": (peak - before) / 2**30 if cuda else None,
            **(device_busy(call) if cuda else {"device_busy_s": None})}


def device_busy(call: Callable[[], object], top: int = 12) -> dict:
    """One more call under torch.profiler (CUDA activity): the device time of its kernels, their count,
    the time by kernel class (kvbuffer.bench.e2e.device_by_class) and the `top` kernels by device time
    ([name, seconds, launches]). Set against the call's wall time, it says how much of a prompt the GPU
    sits idle waiting on the host; the top kernels say where the device time goes."""
    from torch.profiler import ProfilerActivity, profile

    from .e2e import device_by_class

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = timing.device_kernels(prof)
    by_class = device_by_class(kernels, 1e6)  # seconds
    return {"device_busy_s": sum(by_class.values()), "launches": sum(e.count for e in kernels),
            "device_s_by_class": by_class,
            "device_top": [[e.key, e.self_device_time_total / 1e6, e.count] for e in kernels[:top]]}


def _prompt(P: int, vocab: int) -> list[int]:
    from .e2e import random_prompts

    return random_prompts(1, P, vocab, seed=P)[0]


def kvbuffer_rows(preset: str, prompt_lens, *, device, dtype, repeats: int, engine: Mapping,
                  fp8: bool = False) -> list[dict]:
    """TTFT rows of kvbuffer's engine (LLM with `engine`'s EngineConfig fields) on the preset's random model."""
    from .. import LLM
    from .e2e import random_model, release

    model = random_model(preset, device, dtype, fp8)
    llm = LLM(model, device=device, max_batch=1, max_len=max(prompt_lens) + 8, **engine)
    path = f"{llm.backend.name} backend" + ("" if llm.kernels else f" ({llm.kernels_reason})")
    rows = []
    for P in prompt_lens:
        prompt = _prompt(P, llm.vocab_size)
        m = measure_ttft(functools.partial(llm.generate, prompt, max_new_tokens=1, stop_token_ids=[]), device=device,
                         repeats=repeats)
        rows.append(dict(side="kvbuffer", P=P, path=path, max_prefill_tokens=llm.max_prefill_tokens, **m))
        print(_e2e_line(rows[-1]), flush=True)
    del llm, model
    release(device)
    return rows


def transformers_rows(preset: str, prompt_lens, *, device, dtype, repeats: int) -> list[dict]:
    """TTFT rows of stock transformers' generate (one new token); none, with a line, without transformers."""
    from .e2e import release

    try:
        model = hf_model(preset, device, dtype)
    except ImportError as e:
        print(f"transformers: rows skipped ({e})", flush=True)
        return []
    path = hf_path(common.heads_of(preset)["family"], device)
    rows = []
    for P in prompt_lens:
        ids = torch.tensor([_prompt(P, model.config.vocab_size)], device=device)
        call = functools.partial(model.generate, ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                                 do_sample=False, pad_token_id=0)
        rows.append(dict(side="transformers", P=P, path=path, **measure_ttft(call, device=device, repeats=repeats)))
        print(_e2e_line(rows[-1]), flush=True)
    del model
    release(device)
    return rows


def _e2e_line(r: dict) -> str:
    mem = f" peak {r['peak_gib']:.2f} GiB (prefill +{r['prefill_gib']:.2f})" if r.get("peak_gib") is not None else ""
    busy = (f" device busy {r['device_busy_s'] * 1e3:.1f} ms ({_busy_share(r)}), {r['launches']} launches"
            if r.get("device_busy_s") is not None else "")
    return (f"{r['side']:12s} P={r['P']:6d} TTFT {r['ttft_s'] * 1e3:9.1f} ms  {r['P'] / r['ttft_s']:10.0f} tok/s"
            f"{mem}{busy}  [{r['path']}]")


def _busy_share(r: dict) -> str:
    """The device-busy time as a share of the median time to first token."""
    return f"{100 * r['device_busy_s'] / r['ttft_s']:.0f}% of TTFT"


def run_e2e(*, preset: str, prompt_lens=E2E_PROMPT_LENS, device="cuda", dtype=None, repeats: int = 3,
            engine: Mapping | None = None, on_row: Callable[[dict], None] = lambda result: None,
            fp8: bool = False, transformers: bool = True) -> dict:
    """TTFT and prompt tokens/s of kvbuffer's engine and (with `transformers`) of stock transformers at every
    prompt length, B = 1."""
    from .. import presets

    check_lengths(prompt_lens)
    presets.get(preset)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"--repeats must be an integer >= 1, got {repeats!r}")
    if torch.device(device).type == "cuda":
        timing.require_cuda("kvbuffer bench prefill --what e2e")
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    result = new_result("e2e", preset=preset, dtype=str(dtype).replace("torch.", ""), batch=1, repeats=repeats,
                        engine={k: v for k, v in (engine or {}).items()},
                        timing=f"wall clock of generate(max_new_tokens=1), host-synchronised, median of {repeats} "
                               "after one warm-up", note="random weights; each side its own")
    result["rows"] = kvbuffer_rows(preset, prompt_lens, device=device, dtype=dtype, repeats=repeats,
                                   engine=engine or {}, fp8=fp8)
    result["fp8"] = presets.get(preset).fp8_format if fp8 else None
    on_row(result)
    if transformers:
        result["rows"] += transformers_rows(preset, prompt_lens, device=device, dtype=dtype, repeats=repeats)
    for r in result["rows"]:
        r["tokens_per_s"] = r["P"] / r["ttft_s"]
    on_row(result)
    return result


def e2e_table(result: dict) -> str:
    lines = [f"{result['preset']}  {result['gpu']}  {result['dtype']}  B = 1  {result['timing']}",
             f"{'side':12s} {'P':>7s} {'TTFT ms':>10s} {'tok/s':>10s} {'peak GiB':>9s} {'+prefill':>9s} "
             f"{'busy ms':>9s} {'launches':>9s}  path"]
    for r in result["rows"]:
        mem = (f"{r['peak_gib']:9.2f} {r['prefill_gib']:9.2f}" if r.get("peak_gib") is not None
               else f"{'-':>9s} {'-':>9s}")
        busy = (f"{r['device_busy_s'] * 1e3:9.1f} {r['launches']:9d}" if r.get("device_busy_s") is not None
                else f"{'-':>9s} {'-':>9s}")
        lines.append(f"{r['side']:12s} {r['P']:7d} {r['ttft_s'] * 1e3:10.1f} {r['tokens_per_s']:10.0f} {mem} {busy}  "
                     f"{r['path']}")
    return "\n".join(lines)
