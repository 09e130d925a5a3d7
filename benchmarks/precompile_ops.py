"""Fill TileLang's disk cache in parallel before `benchmarks/device_all.sh` runs the GPU tests and the tuner.

Covers the kernels tests/gpu/test_ops_and_engine.py compiles through kvbuffer.ops (JIT keys), the
conv1d kernels of the GPU tests (kvbuffer.conv_ops), the first `--max-configs` configs `kvbuffer tune`
measures for one preset, and the other GPU tests' kernels (benchmarks/precompile_linear.py). A later
compile of the same template, parameters and target is a cache hit. Usage: python3 benchmarks/precompile_ops.py WORKERS PRESET MAX_CONFIGS CHUNKS [tests|engine|e2e]
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def ops_keys() -> list[dict]:
    """The kvbuffer.ops kernels of the GPU tests: head dims 32, C = 8, cap = 9."""
    d = dict(Hk=2, Hv=4, K=32, V=32)
    keys = []
    for fam in ("gdn", "mamba2"):
        keys += [dict(d, family=fam, kind="buffered", in_dtype="bfloat16", buf_dtype="bfloat16", cap=9, T=T, C=c)
                 for T, c in ((1, 8), (2, 8), (4, 8), (8, 8), (2, 0))]
        keys += [dict(d, family=fam, kind="recurrent", in_dtype="bfloat16", buf_dtype=""),
                 dict(d, family=fam, kind="flush", in_dtype="", buf_dtype="bfloat16", cap=9)]
    return keys


def engine_keys(heads=((True, 2, 4, 32, 32), (False, 2, 4, 32, 32)), chunk_size=8, feds=(1, 2, 5, 9)) -> list[dict]:
    """The kernels an engine launches in both modes, for each (delta rule?, Hk, Hv, K, V) linear layer;
    default: the engine tests' tiny models and the demo checkpoint, C = 8, plain decoding and speculative
    verify of T = 1, 4, 8 drafts (T + 1 fed tokens)."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from kvbuffer.runtime.kernel_ops import needed_kernels

    keys = []
    for delta_rule, hk, hv, k, v in heads:
        shape = SimpleNamespace(delta_rule=delta_rule, num_k_heads=hk, num_v_heads=hv, head_k_dim=k, head_v_dim=v)
        for fed in feds:
            spec = SimpleNamespace(linear_shape=shape, chunk_size=chunk_size, max_drafts=fed)
            for mode in ("kvbuffer", "recurrent"):
                keys += [dataclasses.asdict(k) for k in needed_kernels(spec, torch.bfloat16, mode)]
    return keys


def conv_keys() -> list[dict]:
    """The conv1d kernels (kvbuffer.conv_ops.ConvKey) of the GPU tests: the engine tests' tiny models and the
    demo (D = 256, width 4; GDN without, Mamba-2 with a conv bias; pools of 3 + fed positions, fed as in
    engine_keys) and tests/gpu/test_conv1d_kernels.py (pool span 11, bf16 D = 256, fp16 / fp32 D = 8229)."""
    import dataclasses

    from kvbuffer.conv_ops import ConvKey

    bf, keys = "bfloat16", []
    for fed in (1, 2, 5, 9):
        for bias in (False, True):
            keys += [ConvKey("advance", 256, 4, 3 + fed, T, bf, bf, bias) for T in (1, 0)]
            keys += [ConvKey("verify", 256, 4, 3 + fed, fed, bf, bf, bias)] if fed > 1 else []
        keys += [ConvKey("accept", 256, 4, 3 + fed, 0, bf)] if fed > 1 else []
    keys += [ConvKey("verify", 256, 4, 11, T, bf, bf, T % 2 == 0) for T in range(1, 9)]
    keys += [ConvKey("verify", 256, 4, 11, 2, bf, bf, False), ConvKey("advance", 256, 4, 11, 1, bf, bf, False),
             ConvKey("advance", 256, 4, 11, 0, bf, bf, False), ConvKey("advance", 256, 4, 11, 0, bf, bf, True),
             ConvKey("accept", 256, 4, 11, 0, bf)]
    for dt in ("float16", "float32"):
        keys += [ConvKey("advance", 8229, 4, 11, 1, dt, dt, False), ConvKey("advance", 8229, 4, 11, 0, dt, dt, True),
                 ConvKey("verify", 8229, 4, 11, 1, dt, dt, False), ConvKey("verify", 8229, 4, 11, 4, dt, dt, True)]
    return [dataclasses.asdict(k) for k in keys]


def e2e_keys() -> list[dict]:
    """bench_e2e.py's kernels (benchmarks/device_e2e.sh): Qwen3.5-9B GDN and Nemotron-3-Nano Mamba-2
    heads, C = 16, decoding and verify of 2, 4, 8 drafts."""
    return engine_keys(heads=((True, 16, 32, 128, 128), (False, 8, 64, 128, 64)), chunk_size=16, feds=(1, 3, 5, 9))


def _compile(job: dict) -> tuple[str, float, str]:
    t = time.time()
    try:
        if job["what"] == "ops":
            from kvbuffer import ops

            ops._jit(ops.KernelKey(**job["key"]))
        elif job["what"] == "conv":
            from kvbuffer import conv_ops

            conv_ops.jit(conv_ops.ConvKey(**job["key"]))
        elif job["what"] == "tune":
            from kvbuffer.autotune.registry import templates

            tpl = {t.name: t for t in templates(job["shape"]["family"])}[job["template"]]
            tpl.build(dict(job["shape"]), job["chunk"], target=SM90A, **job["tunables"])
        else:
            sys.path.insert(0, "benchmarks")
            from precompile_linear import _compile as linear

            return linear(job["spec"])
        return json.dumps(job), time.time() - t, "ok"
    except Exception as e:  # noqa: BLE001  (reported per job)
        return json.dumps(job), time.time() - t, f"{type(e).__name__}: {str(e)[-300:]}"


def tune_jobs(preset: str, max_configs: int, chunks: list[int]) -> list[dict]:
    from kvbuffer.autotune.models import preset_shape
    from kvbuffer.autotune.registry import templates
    from kvbuffer.autotune.tuner import plan

    shape = preset_shape(preset)
    return [dict(what="tune", shape=shape, template=tpl.name, chunk=c, tunables=t)
            for tpl, c in plan(templates(shape["family"]), chunks) for t in tpl.configs()[:max_configs]]


def linear_jobs() -> list[dict]:
    """The kernel tests' kernels, when the checkout has their precompile list."""
    import pathlib

    if not pathlib.Path("benchmarks/precompile_linear.py").exists():
        print("benchmarks/precompile_linear.py absent: the kernel tests compile on demand", flush=True)
        return []
    sys.path.insert(0, "benchmarks")
    from precompile_gdn import specs as gdn_specs
    from precompile_linear import mamba2_specs

    return [dict(what="linear", spec=s) for s in mamba2_specs() + gdn_specs(tune=False)]


def main(workers=15, preset="qwen3.5-9b", max_configs=2, chunks="8,16,32", what="tests") -> int:
    """what: "tests" (the GPU tests' kernels and the tuner's first configs), "engine" (only those of
    tests/gpu/test_ops_and_engine.py) or "e2e" (bench_e2e's)."""
    if what == "e2e":
        jobs = [dict(what="ops", key=k) for k in e2e_keys()]
    elif what == "engine":
        jobs = [dict(what="ops", key=k) for k in ops_keys() + engine_keys()]
        jobs += [dict(what="conv", key=k) for k in conv_keys()]
    else:
        jobs = [dict(what="ops", key=k) for k in ops_keys() + engine_keys()]
        jobs += [dict(what="conv", key=k) for k in conv_keys()]
        jobs += tune_jobs(preset, int(max_configs), [int(c) for c in chunks.split(",")])
        jobs += linear_jobs()
    jobs = list({json.dumps(j, sort_keys=True): j for j in jobs}.values())
    t0, bad = time.time(), 0
    with ProcessPoolExecutor(int(workers)) as ex:
        for fut in as_completed([ex.submit(_compile, j) for j in jobs]):
            job, dt, status = fut.result()
            if status != "ok":
                bad += 1
                print(f"FAILED {job}: {status}", flush=True)
    print(f"precompiled {len(jobs) - bad}/{len(jobs)} kernels in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
