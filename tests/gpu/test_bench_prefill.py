"""`kvbuffer bench prefill` on a CUDA GPU, small: the gate with the real kernels and peers, the timed rows, the
end-to-end harness on a tiny preset.

Run: PYTHONPATH=.kvb-dev/peers pytest -v tests/gpu/test_bench_prefill.py (mamba_ssm's Triton modules there;
without them its rows are skipped and the tests say so).
"""

import json

import pytest
import torch

from kvbuffer.bench import kernels as common
from kvbuffer.bench import prefill

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_gate_with_the_real_kernels_and_peers(family):
    heads = common.heads_of(prefill.FAMILIES[family])
    peers, notes = prefill.load_peers(family)
    ours = prefill.our_kernel(heads, delta_rule=family == "gdn")
    errors = prefill.gate(family, heads, ours, peers)
    print(notes, errors)
    common.check_gate(errors, family)
    want = {"gdn": {"kvbuffer", "fla", "fla_qk_l2norm"}, "mamba2": {"kvbuffer", "mamba_ssm"}}[family]
    assert {k.split("/")[0] for k in errors} == want & ({"kvbuffer"} | set(peers))


def test_run_kernels_small():
    result = prefill.run_kernels(prompt_lens=(512, 1000), batches=(1, 3), launches=2, replays=2)
    assert {(r["family"], r["B"], r["P"]) for r in result["rows"]} == {
        (f, B, P) for f in ("gdn", "mamba2") for B in (1, 3) for P in (512, 1000)}
    for row in result["rows"]:
        assert all(v > 0 for v in row["us"].values()) and "kvbuffer" in row["method"]
        assert row["method"]["kvbuffer"] == "graph"  # our kernel captures in a CUDA graph
        parts = ["chunks", "prep", "states", "output"] if row["family"] == "gdn" else ["chunks", "states", "output"]
        for name in ["kvbuffer"] + [op for op in row["us"] if op.startswith("kvbuffer[")]:
            times = row["breakdown"][name]
            assert list(times) == parts + ["sum"] and all(v > 0 for v in times.values())
    json.dumps(result)
    print(prefill.kernels_table(result))


def test_e2e_on_a_tiny_preset():
    result = prefill.run_e2e(preset="tiny-qwen", prompt_lens=(64, 300), device="cuda", dtype=torch.float32, repeats=2)
    mine = [r for r in result["rows"] if r["side"] == "kvbuffer"]
    assert [r["P"] for r in mine] == [64, 300]
    assert all(r["peak_gib"] >= r["prefill_gib"] > 0 for r in mine)
    for r in result["rows"]:  # every side's device time of one prompt, by kernel class
        assert r["device_busy_s"] == pytest.approx(sum(r["device_s_by_class"].values())) and r["launches"] > 0
        assert r["device_s_by_class"]["gemm"] > 0
        assert 0 < len(r["device_top"]) <= 12 and r["device_top"][0][1] <= r["device_busy_s"]
    print(prefill.e2e_table(result))


def test_attention_rows_small():
    result = prefill.run_kernels(families=("attention",), prompt_lens=(512, 4097), batches=(1, 2), launches=2,
                                 replays=2)
    rows = result["attention_rows"]
    assert {(r["B"], r["P"], r["case"]) for r in rows} == {
        (B, P, c) for B in (1, 2) for P in (512, 4097) for c in ("fresh", "last_piece", "pieces")}
    common.check_gate(result["gate"]["attention"], "attention")
    for r in rows:
        assert "flash" in r["us"] and all(v > 0 for v in r["us"].values())
        if torch.cuda.get_device_capability() == (9, 0):
            assert "cudnn" in r["us"], "cuDNN is taken at the 9B's heads on Hopper"
    json.dumps(result)
    print(prefill.kernels_table(result))
