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


def test_stall_statistics_on_synthetic_timestamps():
    from kvbuffer.serve.benchmark import stall_stats

    streams = [[0.0, 0.01, 0.02, 0.03, 0.13, 0.14], [0.005, 0.015, 0.025, 0.125], [1.0]]  # one lone token: no gap
    s = stall_stats(streams)
    assert s["itl_median_ms"] == pytest.approx(10.0) and s["itl_max_ms"] == pytest.approx(100.0)
    assert s["itl_max_over_median"] == pytest.approx(10.0) and "long_prefill_itl_max_ms" not in s
    during = stall_stats(streams, window=(0.04, 0.1))  # overlapped by the gaps 0.03-0.13 and 0.025-0.125 only
    assert during["long_prefill_itl_max_ms"] == pytest.approx(100.0)
    assert during["long_prefill_itl_max_over_median"] == pytest.approx(10.0)
    assert during["long_prefill_stream_max_over_median"] == pytest.approx(10.0)  # each stream's median is 10 ms
    calm = stall_stats(streams, window=(0.131, 0.135))
    assert calm["long_prefill_itl_max_ms"] == pytest.approx(10.0)
    assert calm["long_prefill_stream_max_over_median"] == pytest.approx(1.0)  # the second stream has no gap there
    slow = stall_stats([[0.0, 0.05, 0.1, 0.15, 0.2], [0.0, 0.01, 0.02, 0.03, 0.09, 0.1]], window=(0.035, 0.08))
    assert slow["long_prefill_itl_max_over_median"] == pytest.approx(60 / 50)  # the run's median gap (50) hides it
    assert slow["long_prefill_stream_max_over_median"] == pytest.approx(6.0)  # the fast stream: 60 ms over its 10
    empty = stall_stats([[0.5]], window=(0.0, 1.0))
    assert all(v != v for v in empty.values())  # NaN: no gap at all


def test_summary_reports_the_long_prompt_apart():
    from kvbuffer.serve.benchmark import RequestResult, summarize

    runs = [RequestResult(True, 8, 3, 0.01, 0.05, sent=0.0, token_times=[0.01, 0.02, 0.05]),
            RequestResult(True, 8, 3, 0.01, 0.04, sent=0.0, token_times=[0.01, 0.03, 0.04])]
    long = RequestResult(True, 500, 2, 0.025, 0.03, sent=0.015, token_times=[0.04, 0.045])
    s = summarize("kvbuffer", 2, float("inf"), runs, 0.05, long)
    assert s.completed == 2 and s.long_prompt_len == 500 and s.long_prompt_ttft_ms == pytest.approx(25.0)
    assert s.itl_median_ms == pytest.approx(15.0) and s.itl_max_over_median == pytest.approx(2.0)  # gaps 10 30 10 20
    assert s.long_prefill_itl_max_ms == pytest.approx(30.0)  # 0.02-0.05 overlaps its prefill, 0.015-0.04
    plain = summarize("kvbuffer", 2, float("inf"), runs, 0.05)
    assert plain.long_prompt_len == 0 and plain.long_prompt_ttft_ms != plain.long_prompt_ttft_ms


def test_bench_serve_with_a_long_prompt(tmp_path):
    out = tmp_path / "serve.json"
    r = CliRunner().invoke(bench_serve, ["--modes", "kvbuffer", "--concurrency", "2", "--num-requests", "4",
                                         "--input-len", "12", "--output-len", "16", "--long-prompt-len", "200",
                                         "--long-prompt-at", "0.05", "--server-arg=--device=cpu", "--out", str(out)])
    assert r.exit_code == 0, r.output
    saved = json.loads(out.read_text())
    row, = saved["results"]
    assert saved["config"]["long_prompt_len"] == 200 and row["long_prompt_len"] == 200
    assert row["completed"] == 4 and row["failed"] == 0 and row["long_prompt_ttft_ms"] > 0
    assert row["itl_median_ms"] > 0 and row["itl_max_over_median"] >= 1
    assert "prefill max/med" in r.output and "TPOT med" in r.output
