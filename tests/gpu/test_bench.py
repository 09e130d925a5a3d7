"""The benchmarks on a CUDA GPU, small: the timing method, both kernel benchmarks, the engine benchmarks.

Run: pytest -v tests/gpu/test_bench.py (compiles the GDN and Mamba-2 kernels of one shape each).
"""

import json

import pytest
import torch

from kvbuffer.bench import e2e, gdn, kernels, mamba2, timing

pytestmark = pytest.mark.gpu


def test_graph_timing_agrees_with_the_profiler():
    src = torch.randn(64 * 2**20, device="cuda")  # 256 MB: no launch overhead can matter
    dst = torch.empty_like(src)
    t = timing.graph_median(lambda i: dst.copy_(src), 1, rotated_bytes=2 * src.nbytes, launches=8, replays=5)
    assert t.launches == 8 and t.method.startswith("cuda-graph, 8 launches, median of 5 replays")
    device = timing.profiler_seconds(lambda i: dst.copy_(src), 1, launches=8)
    assert 0.7 < device / t.seconds < 1.4, (device, t.seconds)
    assert timing.copy_bandwidth(2**28) > 1e11


def test_graph_timing_rotates_sets():
    seen, x = [], torch.zeros(1, device="cuda")
    timing.graph_median(lambda i: (seen.append(i), x.add_(1)), 3, rotated_bytes=0, launches=4, replays=2)
    assert seen[0] == 0 and seen[1:] == [0, 1, 2, 0, 1, 2]  # warm-up, then 6 captured launches (4 raised to 2 x 3)


@pytest.mark.parametrize("family, shape", [(gdn, "qwen3.5-9b"), (mamba2, "nemotron-3-nano")], ids=["gdn", "mamba2"])
def test_kernel_benchmark_gates_and_times(family, shape):
    result = family.run(shapes=(shape,), batches=(1, 5), launches=4, replays=3)
    assert result["timing"].startswith("cuda-graph, ")
    kernels.check_gate(result["gate"][shape], shape, result["gate_bounds"][shape])  # each peer's own bound
    for row in result["rows"]:
        assert {"state_read", "recurrent", "buffered", "verify2", "verify4", "verify5", "verify8"} <= set(row["us"])
        assert all(v > 0 for v in row["us"].values())
        assert "buffered" in row["profiler_us"]
    json.dumps(result)


def test_engine_benchmarks_on_tiny_models(tmp_path):
    dec = e2e.run("decode", preset="tiny-nemotron", device="cuda", out_dir=tmp_path, batches=(2,), profile_batch=2,
                  prompt_len=20, new_tokens=16, chunk_size=8)
    prof = dec["rows"][0]["profile"]
    assert prof["launches_per_step"] > 0
    assert sum(prof["device_us_per_step_by_class"].values()) == pytest.approx(prof["device_busy_ms_per_step"] * 1e3)
    spec = e2e.run("spec", preset="tiny-qwen", device="cuda", dtype=torch.float32, out_dir=tmp_path,
                   settings=("equal",), batches=(3,), alphas=(1.0,), drafts=3, prompt_len=20, new_tokens=12,
                   chunk_size=8)
    for row in (r for r in spec["rows"] if r.get("alpha") == 1.0):
        assert row["acceptance"] == 1.0 and row["diverged_requests"] == 0 and row["compiled"] in (True, False)
