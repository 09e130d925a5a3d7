"""`kvbuffer tune`'s engine: build (and, on the named GPU, measure) every template for one head shape.

Two paths, both ending in artifacts + one tuning record in the cache:

- build only (the named GPU is not here): compile each template once per chunk size with its
  default tunables for that GPU's arch; every bucket uses it; status "untuned".
- measure (the named GPU is device 0): compile every config of each template, check it against
  kvbuffer.reference on fresh inputs (mismatches are rejected, never timed), time it per batch
  bucket inside one CUDA graph of many launches (kvbuffer.bench.timing; inputs rotated through
  enough copies to exceed twice the L2), keep the fastest per (kernel, bucket, chunk size) and
  derive the chunk-size policy from the buffered step (see kvbuffer.autotune.policy). Only winners are published,
  with status "tuned".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

from kvbuffer.artifacts import ArtifactKey
from kvbuffer.gpus import GPU
from kvbuffer.tuning import TUNING_FORMAT, ChunkPolicy, tuning_name

from .cache import ArtifactCache, build_versions
from .policy import POLICY_KERNELS, RECURRENT_KERNELS, Winner
from .progress import quiet_tilelang
from .template import Template

CHECK_BATCH = 7                      # an awkward batch for the correctness gate
BATCH_BUCKETS = (1, 16, 64, 256, 1024)  # what `kvbuffer tune` tunes for unless told otherwise


@dataclass(frozen=True)
class TuneRequest:
    gpu: GPU
    shape: Mapping                 # family, Hk, Hv, K, V, dtype (conv1d: D, W, dtype, w_dtype, bias)
    chunk_sizes: tuple[int, ...]
    batch_buckets: tuple[int, ...]
    draft_tokens: tuple[int, ...] = (0,)  # buffer layouts: C + T + 1 entries per T (0: plain decoding)


@dataclass
class BuildResult:
    kernel: str
    chunk_size: int
    tunables: dict
    artifact: str
    status: str
    seconds: float
    reused: bool
    median_us: dict = field(default_factory=dict)   # bucket -> µs (measured path)
    rejected: list = field(default_factory=list)    # (tunables, why)
    drafts: int = 0
    stored: dict = field(default_factory=dict)      # winner name -> artifact, one per launch ({kernel: artifact})


def plan(templates: Sequence[Template], shape: Mapping, chunk_sizes: Iterable[int],
         draft_tokens: Iterable[int] = (0,)) -> list[tuple[Template, int, int]]:
    """(template, chunk size, drafts) to build for `shape`: chunk-free templates with chunk_size 0,
    layout-free ones with drafts 0, the verify only for drafts >= 1, none a template does not take."""
    out = []
    layouts = sorted(set(draft_tokens) | {0})
    for tpl in (t for t in templates if t.takes(shape)):
        chunks = [c for c in sorted(set(chunk_sizes)) if c >= tpl.min_chunk] if tpl.uses_chunk else [0]
        out += [(tpl, c, d) for d in tpl.drafts_for(layouts) for c in chunks]
    return out


def label(tpl: Template, chunk: int, drafts: int) -> str:
    """How a progress line names one build: 'gdn_buffered_step C=16 drafts=4'."""
    return tpl.name + (f" C={chunk}" if chunk else "") + (f" drafts={drafts}" if drafts else "")


def function_name(kernel) -> str:
    return str(kernel.prim_func.attrs["global_symbol"])


def _key(req: TuneRequest, tpl: Template, chunk: int, tunables: Mapping, drafts: int = 0) -> ArtifactKey:
    return ArtifactKey(req.gpu.name, req.gpu.arch, tpl.name, dict(req.shape), chunk, dict(tunables),
                       build_versions(), tpl.source, drafts)


def _stored_keys(tpl: Template, key: ArtifactKey) -> dict:
    """{part: (winner name, artifact key)}: one artifact per launch of the kernel."""
    return {part: (name, replace(key, kernel=name)) for part, name in tpl.stored_as(key.shape).items()}


def _publish(cache: ArtifactCache, tpl: Template, key: ArtifactKey, kernel, status: str, info: Mapping) -> dict:
    """Store the kernel (each launch of a kernel of several) under `key`; returns {winner name: artifact}."""
    stored = {}
    for part, (name, part_key) in _stored_keys(tpl, key).items():
        fn = kernel if part is None else kernel.fn[part]
        with quiet_tilelang():  # export_library logs an INFO line per kernel
            stored[name] = cache.put(part_key, lambda path, fn=fn: fn.export_library(str(path)),
                                     function=function_name(fn), status=status, info=info)
    return stored


def _result(tpl: Template, chunk: int, tunables: Mapping, stored: dict, cache: ArtifactCache, seconds: float,
            reused: bool, **fields) -> BuildResult:
    """One build's result, named by its first artifact (its only one unless the kernel has several launches)."""
    first = next(iter(stored.values()))
    return BuildResult(tpl.name, chunk, dict(tunables), first, cache.status(first), seconds, reused,
                       stored=dict(stored), **fields)


# ----------------------------------------------------------------------------------------------
# build only


def build_untuned(cache: ArtifactCache, req: TuneRequest, templates: Sequence[Template],
                  progress: Callable[[BuildResult], None] = lambda r: None,
                  on_start: Callable[[str], None] = lambda label: None) -> tuple[list[BuildResult], str]:
    """Compile every template with its defaults for req.gpu's arch; returns (results, tuning name).
    `on_start` gets each build's label before it compiles, `progress` its result after."""
    results = []
    for tpl, chunk, drafts in plan(templates, req.shape, req.chunk_sizes, req.draft_tokens):
        on_start(label(tpl, chunk, drafts))
        defaults = tpl.defaults_for(req.shape, drafts, req.gpu.arch)
        key = _key(req, tpl, chunk, defaults, drafts)
        t0 = time.perf_counter()
        stored = {name: k.name for name, k in _stored_keys(tpl, key).values()}
        reused = all(cache.has(k) for _, k in _stored_keys(tpl, key).values())
        if not reused:
            with quiet_tilelang():
                kernel = tpl.compile(req.shape, chunk, drafts, target=req.gpu.target, **defaults)
            stored = _publish(cache, tpl, key, kernel, "untuned", {"compile_s": round(time.perf_counter() - t0, 2)})
        res = _result(tpl, chunk, defaults, stored, cache, time.perf_counter() - t0, reused, drafts=drafts)
        results.append(res)
        progress(res)
    winners = [Winner(name, b, r.chunk_size, artifact, r.tunables, drafts=r.drafts)
               for r in results for name, artifact in r.stored.items() for b in req.batch_buckets]
    policy = ChunkPolicy.default(req.batch_buckets, req.chunk_sizes)
    return results, _save_tuning(cache, req, winners, policy, "untuned")


def _save_tuning(cache: ArtifactCache, req: TuneRequest, winners: list[Winner], policy: ChunkPolicy,
                 status: str) -> str:
    """Merge this run's winners into the shape's tuning record (policy.merge_records); returns its name."""
    if not winners:
        raise ValueError("no kernel was built, so there is no tuning record to write")
    versions = build_versions()
    name = tuning_name(req.gpu.name, req.gpu.arch, req.shape, versions)
    record = {"format": TUNING_FORMAT, "status": status, "gpu": req.gpu.name, "arch": req.gpu.arch,
              "shape": dict(req.shape), "versions": versions, "chunk_policy": policy.to_json(),
              "batch_buckets": list(req.batch_buckets), "chunk_sizes": list(req.chunk_sizes),
              "draft_tokens": sorted(set(req.draft_tokens) | {0}),
              "winners": [w.to_json() for w in winners]}
    return cache.put_tuning(name, record, gpu=req.gpu.name, shape=req.shape, versions=versions)


# ----------------------------------------------------------------------------------------------
# measure


def rel_err(x, ref) -> float:
    import torch

    x, ref = x.double(), ref.double()
    if not bool(torch.isfinite(x).all()):
        return math.inf
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def check(tpl: Template, kernel, shape: Mapping, chunk: int, device, seed: int = 0, drafts: int = 0) -> float:
    """Worst relative error of the kernel's outputs against tpl.reference on fresh inputs."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    args = tpl.inputs(shape, CHECK_BATCH, chunk, device, gen, drafts)
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    expected = tpl.reference(dict(shape), chunk, tpl.named(copies))
    tpl.run(kernel, args)
    got = tpl.named(args)
    return max(rel_err(got[name], want) for name, want in expected.items())


def cuda_median_seconds(fn: Callable[[list], None], arg_sets: list) -> float:
    """Median seconds per launch, timed as every kvbuffer figure is (kvbuffer.bench.timing.graph_median:
    many launches in one CUDA graph, cycling through arg_sets, which rotate the inputs past L2)."""
    from kvbuffer.bench.timing import graph_median

    nbytes = sum(a.numel() * a.element_size() for args in arg_sets for a in args if hasattr(a, "element_size"))
    return graph_median(lambda i: fn(arg_sets[i]), len(arg_sets), rotated_bytes=nbytes).seconds


def rotation(args: list, l2_bytes: float, limit: int = 256) -> int:
    """How many input copies it takes to exceed twice the L2 (at least 2, at most `limit`); scalar
    arguments (attention's scale) take no memory. The limit spans twice a 60 MB L2 for any input set of
    0.5 MB or more; fewer copies would time reads that hit the L2."""
    nbytes = sum(a.numel() * a.element_size() for a in args if hasattr(a, "element_size"))
    return max(2, min(limit, math.ceil(2 * l2_bytes / max(nbytes, 1))))


def measure(cache: ArtifactCache, req: TuneRequest, templates: Sequence[Template], *, device="cuda",
            timer: Callable = cuda_median_seconds, progress: Callable[[BuildResult], None] = lambda r: None,
            on_start: Callable[[str], None] = lambda label: None,
            configs_limit: int | None = None) -> tuple[list[BuildResult], str]:
    """The measuring path; one BuildResult per (kernel, chunk size, bucket); on_start and progress
    once per build."""
    import torch

    results, winners, timings, recurrent = [], [], {}, {}
    for tpl, chunk, drafts in plan(templates, req.shape, req.chunk_sizes, req.draft_tokens):
        on_start(label(tpl, chunk, drafts))
        size = chunk or max(req.chunk_sizes)
        candidates, rejected = [], []
        for tunables in tpl.configs()[:configs_limit]:
            t0 = time.perf_counter()
            try:
                with quiet_tilelang():
                    kernel = tpl.compile(req.shape, chunk, drafts, target=req.gpu.target, **tunables)
            except Exception as e:  # a config the compiler rejects is a tuning outcome, not a failure
                rejected.append((tunables, f"compile: {type(e).__name__}: {str(e)[:200]}"))
                continue
            err = check(tpl, kernel, req.shape, size, device, drafts=drafts)
            if not err <= tpl.tolerance:
                rejected.append((tunables, f"mismatch: rel err {err:.2e} > {tpl.tolerance:.0e}"))
                continue
            medians = {}
            for bucket in req.batch_buckets:
                gen = torch.Generator(device=device).manual_seed(bucket)
                first = tpl.inputs(req.shape, bucket, size, device, gen, drafts)
                sets = [first] + [tpl.inputs(req.shape, bucket, size, device, gen, drafts)
                                  for _ in range(rotation(first, req.gpu.l2_mib * 2**20) - 1)]
                medians[bucket] = timer(lambda a: tpl.run(kernel, a), sets)
                del sets, first
            candidates.append((tunables, kernel, medians, time.perf_counter() - t0))
        if not candidates:
            raise RuntimeError(f"{tpl.name} C={chunk} drafts={drafts}: no config passed the reference check: "
                               f"{rejected}")
        for bucket in req.batch_buckets:
            tunables, kernel, medians, secs = min(candidates, key=lambda c: c[2][bucket])
            key = _key(req, tpl, chunk, tunables, drafts)
            stored = _publish(cache, tpl, key, kernel, "tuned",
                              {"median_us": {str(b): m * 1e6 for b, m in medians.items()}})
            winners += [Winner(name, bucket, chunk, artifact, tunables, medians[bucket] * 1e6, drafts)
                        for name, artifact in stored.items()]
            if tpl.name in POLICY_KERNELS and drafts == 0:  # plain decoding's layout decides C
                timings[(bucket, chunk)] = medians[bucket]
            if tpl.name in RECURRENT_KERNELS:  # and the recurrent step, where the buffer is skipped
                recurrent[bucket] = medians[bucket]
            results.append(_result(tpl, chunk, tunables, stored, cache, secs, False,
                                   median_us={bucket: medians[bucket] * 1e6}, rejected=rejected, drafts=drafts))
        progress(results[-1])
    policy = (ChunkPolicy.from_timings(timings, recurrent) if timings
              else ChunkPolicy.default(req.batch_buckets, req.chunk_sizes))
    return results, _save_tuning(cache, req, winners, policy, "tuned")
