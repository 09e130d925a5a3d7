"""The ReplaySSM peers in `kvbuffer bench gdn|mamba2` on a CUDA GPU, small: gated, timed, their ratios in the rows.

Run with the servers' kernels importable (docs/benchmarks.md):
PYTHONPATH=peers pytest -v tests/bench/test_replayssm_gpu.py (compiles our kernels of one shape each).
"""

import json

import pytest

from kvbuffer.bench import gdn, kernels, mamba2, replayssm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family, shape, modules", [
    (gdn, "qwen3.5-9b", ("sglang_step", "sglang_spec")), (mamba2, "nemotron-3-nano", ("vllm_step",))],
    ids=["gdn", "mamba2"])
def test_replayssm_rows_are_gated_and_timed(family, shape, modules):
    for m in modules:
        found, note = replayssm.load(m)
        if found is None:
            pytest.skip(note)
    names = [n for n, beside in family.PEERS.items() if beside != "recurrent"]
    result = family.run(shapes=(shape,), batches=(1, 5), launches=4, replays=3)
    gate = result["gate"][shape]
    assert all(gate[n] < replayssm.TOLERANCE for n in names), gate
    assert result["peer_compares"] == family.PEERS
    for row in result["rows"]:
        assert all(row["us"][n] > 0 for n in names), row["us"]
        for n in names:
            assert row[f"speedup_{kernels.ours_beside(family.PEERS[n])}_vs_{n}"] > 0
    json.dumps(result)
    assert all(n in kernels.table(result) for n in names)
