"""The end-to-end benchmark runs (tiny shapes on the CPU); its real numbers come from a GPU run."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "benchmarks" / "bench_e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-nemotron"])
def test_decode_and_spec_benchmarks_run(tmp_path, preset):
    bench = _bench()
    dec = bench.main(["decode", "--preset", preset, "--device", "cpu", "--batches", "1,3", "--prompt-len", "20",
                      "--new-tokens", "4", "--chunk-size", "6", "--out", str(tmp_path)])
    assert {(r["batch"], r["mode"]) for r in dec["rows"]} == {(b, m) for b in (1, 3) for m in ("kvbuffer", "recurrent")}
    assert all(r["decode_tokens_per_s"] > 0 and r["peak_batch"] == r["batch"] for r in dec["rows"])
    spec = bench.main(["spec", "--preset", preset, "--device", "cpu", "--draft-tokens", "2", "--prompt-len", "20",
                       "--new-tokens", "4", "--chunk-size", "6", "--memory-budget", "0.002", "--max-requests", "6",
                       "--out", str(tmp_path)])
    rows = {r["mode"]: r for r in spec["rows"]}
    assert rows["kvbuffer"]["planned_requests"] > rows["recurrent"]["planned_requests"]
    for r in rows.values():
        assert r["admitted"] == min(r["planned_requests"], 6)
    assert len(list(tmp_path.glob("e2e_*.json"))) == 2
    json.loads(next(tmp_path.glob("e2e_spec_*.json")).read_text())


def test_nemotron_nano_preset_has_the_published_layer_mix():
    bench = _bench()
    p = bench.PRESETS["nemotron-3-nano"]["hybrid_override_pattern"]
    assert (len(p), p.count("M"), p.count("E"), p.count("*")) == (52, 23, 23, 6)
