"""End-to-end decode and speculative decoding through the engine: kvbuffer vs the recurrent scheme, same run.

Models are random-weight (bf16 on CUDA) with a preset's layer and head shapes (kvbuffer.presets),
built directly on the device; the numbers measure the serving path, not the model's quality.

decode: B requests of `prompt_len` .. `prompt_len` + C - 1 random tokens (so each step flushes 1/C of
the rows, as a server's staggered requests do: `random_prompts`), `new_tokens` greedy tokens each;
reported are the median decode step and the throughput it gives (prefill excluded; the first step,
which captures the CUDA graph, left out), for each mode in the same process.

spec: speculative decoding with T drafts from kvbuffer.bench.drafter (the model's own greedy
continuation, each draft right with probability alpha), so acceptance is what alpha makes it and
not what random weights allow. Two settings: "equal" (both modes admit the same B requests) and
"capacity" (a memory budget for the per-request caches; the planner says how many requests each
scheme admits, the engine's pools are sized for exactly those, capped by `max_requests`). Each row
reports acceptance, tokens per step and throughput; each batch also gets a plain-decoding row.

Every engine is freed (del, gc, empty_cache) before the next is built. With `profile_batch`, the
steps at that batch are profiled (decode steps; for spec also the verify steps of the last alpha):
wall vs device-busy time, kernel launches and device time by class (GEMM, state kernels,
attention, everything else) per step.

Mode "peers" (kvbuffer.bench.peers) is the recurrent scheme on the kernels today's servers call
(FLA's fused recurrent GDN update, mamba_ssm's selective_state_update; speculative decoding keeps one
state per fed token): the baseline vLLM and SGLang users have. Where the family's package is
missing, its rows are skipped with one line; its projections run on torch's GEMM, as the servers'
do. Mode "replayssm" (kvbuffer.bench.replayssm_engine) runs the servers' ReplaySSM kernels inside the
engine: SGLang's GDN decode step, or its verify and commit with drafts, and vLLM's Mamba-2 decode
step, on the servers' own layout (value-major checkpoints, rings of length chunk_size, cursors), in
place, compiled and graphed like the other modes: what a vLLM or SGLang user runs today. Its prompts
are prefilled by kvbuffer's path into that layout (not the peer's prefill) and must have at least
chunk_size tokens; `replayssm_ring` is SGLang's decode ring dtype ("float32", its default, or
"bfloat16"). Where the kernels' modules are not importable, or the heads or drafts are ones they do
not take (vLLM has no Mamba-2 verify), its rows are one skipped row with the reason.
`compile` is LLM(compile=...): compare "auto" (on CUDA with graphs) against False for the fused
step's effect; `gemv` is LLM(gemv=...): compare "auto" against False for the one-row projections'.
"""

from __future__ import annotations

import datetime
import gc
import statistics
import time

import torch

from .. import LLM, presets
from ..defaults import DEFAULT_CHUNK_SIZE
from ..models.loader import build_model
from ..plan import geometry_of, request_spec
from .drafter import ReferenceDrafter, expected_accepted
from .peers import PeersBackend, load_peers, reserve_pad_slot
from .replayssm_engine import RING_DTYPES, load_kernels, replayssm_llm, request_nbytes, unsupported

MODES = ("kvbuffer", "recurrent")  # the default rows; "peers" and "replayssm" are the others
PEERS = "peers"
REPLAYSSM = "replayssm"
ALL_MODES = MODES + (PEERS, REPLAYSSM)
ALPHAS = (0.0, 0.5, 0.7, 0.9)
REFERENCE_BATCH = 256  # the greedy reference runs in batches of at most this many requests


def random_model(preset: str, device, dtype, fp8: bool = False) -> torch.nn.Module:
    """The preset's architecture with random weights, allocated directly on `device` in `dtype`; its
    greedy continuation does not depend on rounding (see _greedy_far_from_ties). With `fp8`, its
    projections in the preset's FP8 format, as loading such a checkpoint gives (docs/fp8.md)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(presets.get(preset).hf_config())
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # matrices (experts are allocated uninitialised)
                p.normal_(0.0, 0.02, generator=g)
        _greedy_far_from_ties(model, g)
    if fp8:
        from ..models.quant.write import quantize_model

        quantize_model(model, presets.get(preset).fp8_format)
    return model.eval()


EMBED_STD = 8.0  # the token embeddings' scale, against ~1.5 per layer output of the 0.02-std matrices


def _greedy_far_from_ties(model, g) -> None:
    """Make each greedy next token the current one, by a margin no rounding can close.

    With every matrix random, the logits are nearly flat: the greedy continuation turns at near
    ties that bf16 rounding breaks differently per batch size and per step kind (a verify's GEMMs
    have other shapes than a decode step's), so a reference continuation computed in one run is
    not the one a speculative run produces and the alpha drafter's drafts all miss. Large token
    embeddings dominate the residual stream, and an LM head equal to them scores the current token
    far above all others. The layers see normalised inputs, so what each kernel does and costs is
    unchanged.
    """
    embedding = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    embedding.weight.normal_(0.0, EMBED_STD, generator=g)
    if model.lm_head.weight is not embedding.weight:
        model.lm_head.weight.copy_(embedding.weight)


def random_prompts(n: int, length: int, vocab: int, seed: int, spread: int = 1) -> list[list[int]]:
    """n prompts of random tokens; prompt i has length + i % spread tokens.

    With spread = the chunk size C, the rows' buffer fills (prompt length mod C) are spread evenly, so
    every decode step flushes 1/C of the rows, as in a server whose requests arrived at different
    times. Equal lengths put every row at the same fill: all rows flush in the same step, once every
    C steps, and a median step leaves the flushes out."""
    if spread < 1:
        raise ValueError(f"spread must be >= 1, got {spread}")
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length + i % spread,), generator=g).tolist() for i in range(n)]


def release(device) -> None:
    """Hand a freed engine's memory back before the next one is built (the caller has `del`ed it)."""
    gc.collect()
    torch._dynamo.reset()  # the next engine's compiled forward starts afresh (its pools differ in size)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _allocated(device) -> int:
    return torch.cuda.memory_allocated() if torch.device(device).type == "cuda" else 0


def _warm_steps(stats) -> tuple[list[float], list[int]]:
    """(seconds, tokens) of the decode steps after the first (which captures a CUDA graph)."""
    steps = list(zip(stats.step_seconds, stats.step_tokens))
    steps = steps[1:] or steps
    return [s for s, _ in steps], [t for _, t in steps]


def steady_rate(stats) -> float:
    """Tokens per second over the warm decode steps that fed every request of the run (a server keeps
    its batch full). Requests of a fixed-length run end at different steps when they speculate, and the
    shrinking batch of the last steps is an artefact of the run, not of the scheme; all_steps_rate keeps it."""
    steps = list(zip(stats.step_seconds, stats.step_tokens, stats.step_rows))
    steps = steps[1:] or steps
    full = [(s, t) for s, t, rows in steps if rows == stats.peak_batch] or [(s, t) for s, t, _ in steps]
    return sum(t for _, t in full) / sum(s for s, _ in full)


def all_steps_rate(stats) -> float:
    secs, toks = _warm_steps(stats)
    return sum(toks) / sum(secs)


# -- profiles --------------------------------------------------------------------------------------

_CLASSES = (  # first match wins; names lower-cased
    ("gemm", ("gemm", "gemv", "grouped_experts_kernel", "cutlass", "cublas", "nvjet", "xmma", "splitkreduce",
              "matmul")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient_attention")),
    ("state", ("gdn", "mamba", "linear_decode", "conv1d", "flush", "buffered", "recurrent", "verify",
               "selective_scan")),
)


def kernel_class(name: str) -> str:
    """GEMM, attention, state (kvbuffer's and the peers' state and conv kernels) or other, by kernel name."""
    low = name.lower()
    for cls, words in _CLASSES:
        if any(w in low for w in words):
            return cls
    return "other"


def device_by_class(kernels, per: float = 1.0) -> dict[str, float]:
    """timing.device_kernels' kernels' device time (the profiler's microseconds / `per`) by kernel_class."""
    by_class = {c: 0.0 for c in ("gemm", "state", "attention", "other")}
    for e in kernels:
        by_class[kernel_class(e.key)] += e.self_device_time_total / per
    return by_class


def profile_steps(llm, prompts, *, device, step: str = "decode", steps: int = 8, skip: int = 3,
                  max_new_tokens: int | None = None) -> dict:
    """torch.profiler over `steps` calls of the runner's `step` ("decode"; "verify_greedy": a greedy
    speculative step) after `skip` warm ones, in one generate call: wall and device-busy time per step, launches per step, device time by
    kernel class, the top kernels. Fewer steps are profiled if the generation ends first."""
    from torch.profiler import ProfilerActivity, profile

    from .timing import device_kernels

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    seen, started, wall = [0], [0.0], [None]
    original = getattr(llm.runner, step)

    def stop():
        _sync(device)
        wall[0] = time.perf_counter() - started[0]
        prof.stop()

    def profiled(*args, **kwargs):
        seen[0] += 1
        if seen[0] == skip + 1:
            _sync(device)
            prof.start()
            started[0] = time.perf_counter()
        out = original(*args, **kwargs)
        if seen[0] == skip + steps:
            stop()
        return out

    setattr(llm.runner, step, profiled)
    try:
        llm.generate(prompts, max_new_tokens=max_new_tokens or skip + steps + 1, stop_token_ids=[])
    finally:
        setattr(llm.runner, step, original)
    done = min(steps, seen[0] - skip)
    if done < 1:
        raise RuntimeError(f"the generation made {seen[0]} {step} steps, fewer than the {skip} warm ones")
    if wall[0] is None:
        stop()
    kernels = device_kernels(prof)
    by_class = device_by_class(kernels, done)
    busy_us = sum(by_class.values())
    return dict(step=step, steps=done, wall_ms_per_step=1e3 * wall[0] / done, device_busy_ms_per_step=busy_us / 1e3,
                launches_per_step=sum(e.count for e in kernels) / done, device_us_per_step_by_class=by_class,
                kernels=[dict(name=e.key[:400], cls=kernel_class(e.key), us_per_step=e.self_device_time_total / done,
                              calls_per_step=e.count / done) for e in kernels[:40]])


def format_profile(tag: str, prof: dict) -> str:
    cls = " ".join(f"{k} {v / 1e3:.2f}" for k, v in prof["device_us_per_step_by_class"].items())
    return (f"profile {tag}: {prof['wall_ms_per_step']:.2f} ms/step wall, device busy "
            f"{prof['device_busy_ms_per_step']:.2f} ms ({cls} ms), {prof['launches_per_step']:.0f} launches/step")


# -- decode ----------------------------------------------------------------------------------------

def _scheme(mode: str) -> str:
    """The engine mode (and planner scheme) a benchmark mode runs: peers is the recurrent scheme,
    replayssm runs in kvbuffer mode (kvbuffer.bench.replayssm_engine)."""
    return {PEERS: "recurrent", REPLAYSSM: "kvbuffer"}.get(mode, mode)


def check_modes(modes, *, prompt_len: int, chunk_size: int) -> None:
    """ValueError, before any model runs, for a mode that is none of ALL_MODES, or replayssm with
    prompts shorter than its rings (every request needs its state from admission)."""
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes:
        raise ValueError(f"modes must be among {', '.join(ALL_MODES)}, got {', '.join(modes) or 'none'}")
    if REPLAYSSM in modes and prompt_len < chunk_size:
        raise ValueError(f"prompt_len must be at least chunk_size ({chunk_size}) for the replayssm mode, got "
                         f"{prompt_len}")


def _family(model) -> str:
    return "gdn" if geometry_of(model).linear_shape.delta_rule else "mamba2"


def peers_missing(model) -> str | None:
    """Why the peers rows cannot run for this model (None: they can)."""
    if geometry_of(model).linear_shape is None:
        return "the model has no linear-attention layers"
    if load_peers()[_family(model)] is None:
        return {"gdn": "FLA (fla-core)", "mamba2": "mamba_ssm"}[_family(model)] + " could not be imported"
    return None


def replayssm_missing(model, *, chunk_size: int, drafts: int = 0) -> str | None:
    """Why the replayssm rows cannot run for this model, ring length and drafts (None: they can)."""
    why = unsupported(geometry_of(model).linear_shape, chunk_size, drafts + 1)
    if why is None:
        found, note = load_kernels(_family(model), drafts + 1)
        why = None if found else note
    return why


def _engine(model, *, device, mode, batch, max_len, chunk_size, kernels, cuda_graphs, compile="auto", drafts=0,
            gemv="auto", replayssm_ring="float32"):
    if mode == REPLAYSSM:  # torch's GEMM for the projections, as the servers' (and the peers rows)
        return replayssm_llm(model, drafts=drafts, ring_dtype=RING_DTYPES[replayssm_ring], device=device,
                             chunk_size=chunk_size, max_batch=batch, max_len=max_len, kernels=kernels,
                             cuda_graphs=cuda_graphs, compile=compile, gemv=False)
    spec = {"method": "ngram", "num_draft_tokens": drafts} if drafts else None
    states = reserve_pad_slot(batch) if mode == PEERS else None
    llm = LLM(model, device=device, mode=_scheme(mode), chunk_size=chunk_size, max_batch=batch, max_len=max_len,
              max_states=states, kernels=kernels, cuda_graphs=cuda_graphs, compile=compile, speculative=spec,
              gemv=False if mode == PEERS else gemv)
    if mode == PEERS:
        llm.backend = llm.runner.backend = PeersBackend(**{f"{f}_update": fn for f, fn in load_peers().items()})
    return llm


def _skipped(mode, model, rows: list, *, chunk_size: int, drafts: int = 0) -> bool:
    """Whether `mode`'s rows are skipped (one line says why; a replayssm skip is also a row with the reason)."""
    why = peers_missing(model) if mode == PEERS else \
        replayssm_missing(model, chunk_size=chunk_size, drafts=drafts) if mode == REPLAYSSM else None
    if why:
        print(f"{mode}: rows skipped ({why})", flush=True)
        if mode == REPLAYSSM:
            rows.append(dict(mode=mode, skipped=why))
    return bool(why)


def _decode_row(llm, prompts, *, device, new_tokens, sampling: dict | None = None) -> dict:
    """Start-up is reported beside the rates: `warmup_s` is the first call (kernels loaded, and with
    compile the first compilation), `first_step_s` the measured run's first decode step (its graph
    captured, with compile a recompilation for the batch's shapes); both are one-off costs.
    `sampling`: generate's temperature and top_p (greedy without)."""
    sampling = sampling or {}
    t0 = time.perf_counter()
    llm.generate(prompts[:1], max_new_tokens=2, stop_token_ids=[], **sampling)  # warm-up: kernels loaded
    _sync(device)
    warmup_s = time.perf_counter() - t0
    llm.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[], **sampling)
    st = llm.last_stats
    secs, _ = _warm_steps(st)
    med = statistics.median(secs)
    return dict(decode_tokens_per_s=steady_rate(st), step_ms=1e3 * med, warmup_s=warmup_s,
                first_step_s=st.step_seconds[0],
                step_ms_mean=1e3 * sum(secs) / len(secs), steps=len(secs), peak_batch=st.peak_batch,
                kernels=bool(llm.kernels), cuda_graphs=bool(llm.cuda_graphs and llm.runner.graphs.enabled),
                compiled=llm.runner.compiled is not None, unbuffered_rows=llm.runner.unbuffered_rows, gemv=llm.gemv)


def bench_decode(model, *, batches, modes=MODES, prompt_len=128, new_tokens=32, chunk_size=DEFAULT_CHUNK_SIZE,
                 device="cuda", kernels="auto", cuda_graphs="auto", compile="auto", profile_batch=0, temperature=0.0,
                 top_p=1.0, gemv="auto", replayssm_ring="float32", on_row=lambda rows: None) -> list[dict]:
    """Decode rows per batch and mode; temperature > 0 samples every request (unseeded), which is what
    most serving traffic does: its tokens are drawn after each step rather than picked inside it."""
    check_modes(modes, prompt_len=prompt_len, chunk_size=chunk_size)
    _check_ring(replayssm_ring)
    sampling = {} if temperature == 0.0 else dict(temperature=temperature, top_p=top_p)
    rows = []
    modes = [m for m in modes if not _skipped(m, model, rows, chunk_size=chunk_size)]
    for B in batches:
        prompts = random_prompts(B, prompt_len, model.config.vocab_size, seed=B, spread=chunk_size)
        for mode in modes:
            llm = _engine(model, device=device, mode=mode, batch=B, max_len=prompt_len + chunk_size + new_tokens + 8,
                          chunk_size=chunk_size, kernels=kernels, cuda_graphs=cuda_graphs, compile=compile, gemv=gemv,
                          replayssm_ring=replayssm_ring)
            row = dict(batch=B, mode=mode, temperature=temperature, top_p=top_p, **_ring(mode, replayssm_ring),
                       **_decode_row(llm, prompts, device=device, new_tokens=new_tokens, sampling=sampling))
            print(f"decode B={B:4d} {mode:9s} {row['decode_tokens_per_s']:10.1f} tok/s {row['step_ms']:8.2f} ms/step"
                  f" (start-up {row['warmup_s']:.1f} s + first step {row['first_step_s']:.1f} s)", flush=True)
            if B == profile_batch:
                row["profile"] = profile_steps(llm, prompts, device=device)
                print(format_profile(f"B={B} {mode}", row["profile"]), flush=True)
            rows.append(row)
            del llm
            release(device)
            on_row(rows)
    return rows


def _check_ring(ring: str) -> None:
    if ring not in RING_DTYPES:
        raise ValueError(f"replayssm_ring must be one of {', '.join(RING_DTYPES)}, got {ring!r}")


def _ring(mode: str, ring: str) -> dict:
    """The replayssm rows' record of SGLang's decode ring dtype (the Mamba-2 rings are vLLM's own)."""
    return {"replayssm_ring": ring} if mode == REPLAYSSM else {}


# -- speculative -----------------------------------------------------------------------------------

def greedy_references(model, prompts, *, tokens, device, chunk_size, kernels, cuda_graphs,
                      compile="auto") -> dict:
    """Each prompt's greedy continuation of `tokens` tokens (plain kvbuffer decoding, in batches)."""
    refs = {}
    for start in range(0, len(prompts), REFERENCE_BATCH):
        part = prompts[start:start + REFERENCE_BATCH]
        llm = _engine(model, device=device, mode="kvbuffer", batch=len(part), max_len=len(part[0]) + tokens + 8,
                      chunk_size=chunk_size, kernels=kernels, cuda_graphs=cuda_graphs, compile=compile)
        for p, out in zip(part, llm.generate(part, max_new_tokens=tokens, stop_token_ids=[])):
            refs[tuple(p)] = out.token_ids
        del llm
        release(device)
    return refs


def admitted_requests(model, *, mode, budget_bytes, context, drafts, chunk_size) -> int:
    """How many requests the planner admits for `mode` in `budget_bytes` of per-request caches. replayssm:
    the server's caches (states, conv, KV cache, its rings and cursors; not the kvbuffer buffers its
    engine allocates unused)."""
    geo = geometry_of(model)
    spec = request_spec(geo, scheme=_scheme(mode), context=context, draft_tokens=drafts, chunk_size=chunk_size)
    parts = spec.nbytes(next(model.parameters()).dtype)
    if mode == REPLAYSSM:
        parts = {k: v for k, v in parts.items() if not k.startswith("buffer_")}
        parts["rings"] = request_nbytes(geo.linear_shape, geo.num_linear_layers, chunk_size, drafts + 1)
    return int(budget_bytes // sum(parts.values()))


def _spec_row(llm, prompts, refs, *, alpha, drafts, device, new_tokens, vocab, profile=False) -> dict:
    # Warm-up: the same run, so every graph the measured run replays (its batch shrinks as requests
    # finish at different steps) is captured before it; the drafter's seed repeats its misses.
    llm.drafter = ReferenceDrafter(refs, alpha, vocab)  # the engine's drafter slot, as the tests use it
    llm.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])
    llm.drafter = ReferenceDrafter(refs, alpha, vocab)
    _sync(device)
    before = llm.stats.drafts
    llm.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])
    after = llm.stats.drafts
    st = {k: getattr(after, k) - getattr(before, k) for k in ("accepted", "proposed", "emitted", "request_steps")}
    secs, _ = _warm_steps(llm.last_stats)
    row = dict(alpha=alpha, draft_tokens=drafts, decode_tokens_per_s=steady_rate(llm.last_stats),
               decode_tokens_per_s_all_steps=all_steps_rate(llm.last_stats),
               step_ms=1e3 * statistics.median(secs), peak_batch=llm.last_stats.peak_batch,
               acceptance=st["accepted"] / st["proposed"] if st["proposed"] else 0.0,
               expected_acceptance=expected_accepted(alpha, drafts) / drafts,
               tokens_per_step=st["emitted"] / st["request_steps"] if st["request_steps"] else 0.0,
               diverged_requests=len(llm.drafter.diverged), kernels=bool(llm.kernels),
               compiled=llm.runner.compiled is not None)  # False also where a capture failure dropped it
    if profile:  # the verify steps; the reference continuations are long enough for new_tokens
        row["profile"] = profile_steps(llm, prompts, device=device, step="verify_greedy", steps=4, skip=1,
                                       max_new_tokens=new_tokens)
        print(format_profile(f"verify B={len(prompts)} alpha={alpha}", row["profile"]), flush=True)
    return row


def bench_spec(model, *, settings=("equal", "capacity"), batches=(1, 16, 64, 256), alphas=ALPHAS, drafts=4,
               budget_bytes=40 * 2**30, max_requests=1024, modes=MODES, prompt_len=128, new_tokens=32,
               chunk_size=DEFAULT_CHUNK_SIZE, device="cuda", kernels="auto", cuda_graphs="auto", compile="auto",
               profile_batch=0, replayssm_ring="float32", on_row=lambda rows: None) -> list[dict]:
    """Speculative rows (per setting, batch, alpha and mode) and a plain-decoding row per (batch, mode).

    At `profile_batch`, the last alpha's verify steps and the plain decode steps are profiled."""
    check_modes(modes, prompt_len=prompt_len, chunk_size=chunk_size)
    _check_ring(replayssm_ring)
    vocab = model.config.vocab_size
    context = prompt_len + new_tokens
    rows = []
    modes = [m for m in modes if not _skipped(m, model, rows, chunk_size=chunk_size, drafts=drafts)]
    plan = {}  # (setting, mode) -> [(batch, planned)]
    if "equal" in settings:
        for mode in modes:
            plan[("equal", mode)] = [(B, None) for B in batches]
    if "capacity" in settings:
        for mode in modes:
            n = admitted_requests(model, mode=mode, budget_bytes=budget_bytes, context=context, drafts=drafts,
                                  chunk_size=chunk_size)
            plan[("capacity", mode)] = [(min(n, max_requests), n)]
    if not plan:  # every mode skipped
        on_row(rows)
        return rows
    largest = max(B for runs in plan.values() for B, _ in runs)
    # equal lengths here: the rates are throughputs over whole runs, which count every flush step, and
    # rows that accept different numbers of drafts soon sit at different fills anyway
    prompts = random_prompts(largest, prompt_len, vocab, seed=drafts)
    refs = greedy_references(model, prompts, tokens=new_tokens + drafts + 2, device=device, chunk_size=chunk_size,
                             kernels=kernels, cuda_graphs=cuda_graphs, compile=compile)
    for (setting, mode), runs in plan.items():
        for B, planned in runs:
            if B < 1:
                rows.append(dict(setting=setting, mode=mode, alpha=None, planned_requests=planned, admitted=0))
                continue
            mine = prompts[:B]
            common = dict(device=device, mode=mode, batch=B, chunk_size=chunk_size, kernels=kernels,
                          cuda_graphs=cuda_graphs, compile=compile, replayssm_ring=replayssm_ring)
            before = _allocated(device)
            llm = _engine(model, max_len=context + drafts + 1, drafts=drafts, **common)  # the planner's max_len
            cache_gib = (_allocated(device) - before) / 2**30  # what the pools really took
            for alpha in alphas:
                row = dict(setting=setting, mode=mode, batch=B, planned_requests=planned, admitted=B,
                           cache_gib=cache_gib, **_spec_row(llm, mine, refs, alpha=alpha, drafts=drafts,
                                                            device=device, new_tokens=new_tokens, vocab=vocab,
                                                            profile=B == profile_batch and alpha == alphas[-1]))
                rows.append(row)
                print(f"spec {setting:8s} B={B:4d} {mode:9s} alpha={alpha:.1f} "
                      f"{row['decode_tokens_per_s']:10.1f} tok/s (all steps {row['decode_tokens_per_s_all_steps']:.1f}) "
                      f"acceptance {row['acceptance']:.2f} "
                      f"({row['tokens_per_step']:.2f} tokens/step){'' if row['compiled'] else ', uncompiled'}",
                      flush=True)
                on_row(rows)
            del llm
            release(device)
            llm = _engine(model, max_len=context + 8, **common)
            rows.append(dict(setting=setting, mode=mode, batch=B, planned_requests=planned, admitted=B, alpha=None,
                             draft_tokens=0, **_ring(mode, replayssm_ring),
                             **_decode_row(llm, mine, device=device, new_tokens=new_tokens)))
            if B == profile_batch:
                rows[-1]["profile"] = profile_steps(llm, mine, device=device)
                print(format_profile(f"decode B={B} {mode}", rows[-1]["profile"]), flush=True)
            del llm
            release(device)
            on_row(rows)
    return rows


def new_result(what: str, preset: str, *, device, dtype, args: dict) -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.device(device).type == "cuda" else "cpu"
    approx = presets.get(preset).approximate
    return dict(benchmark=what, preset=preset, date=datetime.date.today().isoformat(), gpu=gpu,
                dtype=str(dtype).replace("torch.", ""), args=args, rows=[],
                timing="engine steps: wall clock per step (host-synchronised by sampling), median over steps",
                note="random weights" + (f"; approximate config fields: {', '.join(approx)}" if approx else ""))


def run(what: str, *, preset: str, device: str = "cuda", dtype=None, out_dir=None, fp8: bool = False,
        **options) -> dict:
    """Build the preset's random model, run `what` ("decode" or "spec") with `options` (bench_decode's
    or bench_spec's keywords), write the results JSON after every row and its figure at the end."""
    from . import results

    if what not in ("decode", "spec"):
        raise ValueError(f"what must be 'decode' or 'spec', got {what!r}")
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    t0 = time.time()
    model = random_model(preset, device, dtype, fp8)
    print(f"{preset}: built in {time.time() - t0:.0f} s", flush=True)
    result = new_result(what, preset, device=device, dtype=dtype,
                        args={k: list(v) if isinstance(v, tuple) else v for k, v in options.items()})
    if what == "decode":
        result["prompts"] = "lengths prompt_len + i % chunk_size: each step flushes 1/chunk_size of the rows"
    settings = "_" + "-".join(options["settings"]) if "settings" in options else ""  # one file per setting run
    settings += "_sampled" if options.get("temperature") else ""  # beside the greedy run's file
    bf16_ring = REPLAYSSM in options.get("modes", ()) and options.get("replayssm_ring") == "bfloat16"
    settings += "_bf16ring" if bf16_ring else ""  # beside the run with SGLang's default ring
    name = f"e2e_{what}{settings}_{preset}" + ("_fp8" if fp8 else "")
    path = results.result_path(out_dir or results.DEFAULT_DIR, name, result)

    def save(rows):
        result["rows"] = rows
        results.write(result, path)

    bench = bench_decode if what == "decode" else bench_spec
    bench(model, device=device, on_row=save, **options)
    for p in results.finish(result, path):
        print(f"wrote {p}")
    return result
