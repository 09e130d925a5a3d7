"""The chunked GDN prefill templates (tiles/gdn_prefill.py) compile for sm_90a with nvcc (CPU only).

Skips cleanly when TileLang or nvcc is missing; tests/gpu/test_gdn_prefill.py covers the numerics.
"""

import importlib.util
import os
import shutil

import pytest

pytestmark = pytest.mark.tilelang

_NVCC = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
if importlib.util.find_spec("tilelang") is None or not _NVCC:
    pytest.skip("needs TileLang and nvcc", allow_module_level=True)

from kvbuffer.gpus import get_gpu  # noqa: E402
from kvbuffer.tiles import compile_template, gdn_prefill  # noqa: E402

CASES = {
    "chunks": (gdn_prefill.gdn_prefill_chunks, {}),
    "prep_qwen35_9b": (gdn_prefill.gdn_prefill_prep, dict(Hk=16, Hv=32)),
    "states_qwen35_9b": (gdn_prefill.gdn_prefill_states, dict(Hk=16, Hv=32)),
    "output_qwen35_9b": (gdn_prefill.gdn_prefill_output, dict(Hk=16, Hv=32)),
    # the state pass with its chunk loads pipelined (TMA loads from a producer warpgroup)
    "states_pipelined_qwen35_9b": (gdn_prefill.gdn_prefill_states, dict(Hk=16, Hv=32, stages=2)),
    # the decay-only form at Nemotron-3 Nano's shape (8 groups, 64 heads, state 128, head dim 64)
    "states_decay_only_nano": (gdn_prefill.gdn_prefill_states, dict(Hk=8, Hv=64, K=128, V=64, delta_rule=False)),
    "output_nano": (gdn_prefill.gdn_prefill_output, dict(Hk=8, Hv=64, K=128, V=64, BV=64)),
}


@pytest.mark.parametrize("case", CASES)
def test_prefill_template_compiles_for_sm90a(case):
    template, params = CASES[case]
    src = compile_template(template(**params), get_gpu("h200").target).get_kernel_source()
    assert "__global__" in src
    if case != "chunks":  # the products run on tensor cores
        assert "wgmma" in src
    if params.get("stages"):
        assert "tma_load" in src


def test_configs_fit_the_templates():
    """Every tunable configuration is accepted by the templates it names (no compile)."""
    for cfg in gdn_prefill.configs():
        gdn_prefill.gdn_prefill_states(16, 32, BV=cfg["states_BV"], stages=cfg.get("states_stages", 0))
        gdn_prefill.gdn_prefill_output(16, 32, BV=cfg["output_BV"])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="BV"):
        gdn_prefill.gdn_prefill_states(16, 32, BV=48)
    with pytest.raises(ValueError, match="multiple"):
        gdn_prefill.gdn_prefill_prep(16, 24)
    with pytest.raises(ValueError, match="stages"):
        gdn_prefill.gdn_prefill_states(8, 64, 128, 64, stages=2, delta_rule=False)
