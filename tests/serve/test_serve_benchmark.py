"""The serving benchmark runs end to end against the demo model (both modes, a few requests)."""

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("fastapi")

from kvbuffer.serve.benchmark import bench_serve, workload  # noqa: E402


def test_the_workload_is_reproducible_and_within_its_ranges():
    a, b = workload(20, 10, 8, 0.5, seed=3), workload(20, 10, 8, 0.5, seed=3)
    assert a == b
    assert all(5 <= len(p) <= 15 and 4 <= n <= 12 and max(p) < 256 for p, n in a)


def test_bench_serve_on_the_demo_model(tmp_path):
    out = tmp_path / "serve.json"
    r = CliRunner().invoke(bench_serve, ["--concurrency", "1,3", "--num-requests", "4", "--input-len", "12",
                                         "--output-len", "6", "--range-ratio", "0.3",
                                         "--server-arg=--device=cpu", "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["results"]
    assert [(x["mode"], x["concurrency"]) for x in rows] == [("kvbuffer", 1), ("kvbuffer", 3), ("recurrent", 1),
                                                            ("recurrent", 3)]
    assert all(x["completed"] == 4 and x["failed"] == 0 and x["ttft_median_ms"] > 0 for x in rows)
    assert "TPOT med" in r.output
