"""The defaults a user gets, on the GPU: the demo's short run pays no compile and is faster than on the CPU;
a cache left partial (the conv step's artifact gone) is completed by the next run, which then runs the conv
on its kernel; with a 9B checkpoint ($KVBUFFER_TEST_CHECKPOINT), constructing LLM with a warm cache takes at
most twice as long as loading its weights. Each test prints what it measured (run with -s to read it)."""

import cProfile
import io
import os
import pstats
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]

CHECKPOINT = os.environ.get("KVBUFFER_TEST_CHECKPOINT")  # e.g. a Qwen3.5-9B directory
RATE = re.compile(r"\[(\d+) tokens from .* in ([\d.]+)s: ([\d.]+) tok/s")


def generate(cache: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, KVBUFFER_CACHE_DIR=str(cache))
    for name in ("KVBUFFER_JIT", "KVBUFFER_BUILD_KERNELS", "TORCHINDUCTOR_CACHE_DIR"):
        env.pop(name, None)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "kvbuffer.cli.main", "generate", *args], env=env,
                         capture_output=True, text=True, timeout=550)
    wall = time.perf_counter() - t0
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res, wall


def rate(res: subprocess.CompletedProcess) -> float:
    found = RATE.search(res.stderr)
    assert found, res.stderr
    return float(found.group(3))


def test_the_demo_short_run_compiles_nothing_and_beats_the_cpu(tmp_path):
    args = ("--prompt", "The built-in function ", "--max-new-tokens", "64")
    generate(tmp_path, *args)  # the first use builds the demo's kernels
    gpu, gpu_wall = generate(tmp_path, *args)
    cpu, cpu_wall = generate(tmp_path, *args, "--device", "cpu")
    print(f"\ndemo, 64 tokens: GPU {rate(gpu):.1f} tok/s ({gpu_wall:.1f} s wall), "
          f"CPU {rate(cpu):.1f} tok/s ({cpu_wall:.1f} s wall)\n{gpu.stderr}")
    assert "compiling" not in gpu.stderr, "a 64-token run compiled its decode step"
    assert "linear layers on kernels" in gpu.stderr and "no compiled" not in gpu.stderr, gpu.stderr
    assert rate(gpu) > rate(cpu), "the demo ran slower on the GPU than on the CPU"


def test_a_partial_cache_is_completed_by_the_next_run(tmp_path):
    """The report's cache: the first use built everything but the conv step (interrupted), so every later
    step ran the conv in torch and compile gave up at its capture. Here the conv step's artifact is
    deleted after a full build; the next run builds it alone and runs on it."""
    args = ("--prompt", "The built-in function ", "--max-new-tokens", "16")
    generate(tmp_path, *args)
    lost = [d for d in (tmp_path / "artifacts").iterdir() if d.name.startswith("conv1d_step")]
    assert lost, sorted(d.name for d in (tmp_path / "artifacts").iterdir())
    for d in lost:
        shutil.rmtree(d)
    again, _ = generate(tmp_path, *args)
    print(f"\n{again.stderr}")
    assert "conv1d_step: built" in again.stderr, again.stderr
    assert "gdn_buffered_step C=16: built" not in again.stderr, "the linear kernels were built again"
    assert "short conv ran on the reference ops" not in again.stderr, again.stderr
    third, _ = generate(tmp_path, *args)
    assert "building" not in third.stderr, third.stderr


def test_the_defaults_resolve_to_the_fast_path_on_cuda(tmp_path, monkeypatch):
    """LLM(dir) with no options on CUDA: compiled kernels, one-row projections, CUDA graphs, compile,
    overlap; and the decode step is captured once it repeats."""
    import kvbuffer

    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    llm = kvbuffer.LLM(kvbuffer.demo_checkpoint())
    print(f"\nkernels={llm.kernels} gemv={llm.gemv!r} cuda_graphs={llm.cuda_graphs} compiled={llm.compiled} "
          f"overlap={llm.overlap} unbuffered_rows={llm.unbuffered_rows} chunk_size={llm.chunk_size} "
          f"missing={llm.fast_path_missing}")
    assert llm.kernels and llm.cuda_graphs and llm.compiled and llm.overlap and not llm.fast_path_missing
    llm.generate(["The "], max_new_tokens=24)
    assert llm.runner.graphs.graphs and llm.runner.compiled is not None, "the decode step was not captured compiled"


@pytest.mark.skipif(CHECKPOINT is None, reason="set KVBUFFER_TEST_CHECKPOINT to a 9B checkpoint directory")
def test_start_up_with_a_warm_cache_is_within_twice_the_weights_load():
    import torch

    import kvbuffer
    from kvbuffer.models.loader import load_checkpoint

    kvbuffer.LLM(CHECKPOINT)  # warms the kernel cache (first use) and the page cache
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = load_checkpoint(Path(CHECKPOINT), device=torch.device("cuda"))
    torch.cuda.synchronize()
    load = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    llm = kvbuffer.LLM(CHECKPOINT)
    torch.cuda.synchronize()
    profile.disable()
    build = time.perf_counter() - t0
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(40)
    print(f"\nweights {load:.1f} s, LLM(dir) {build:.1f} s ({build / load:.2f}x)\n{out.getvalue()}")
    assert llm.kernels
    assert build <= 2 * load, f"LLM(dir) took {build:.1f} s, {build / load:.2f}x loading the weights ({load:.1f} s)"
