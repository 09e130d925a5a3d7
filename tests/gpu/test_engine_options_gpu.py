"""Engine and CLI argument checks that only a CUDA machine can exercise: a device index past the
last GPU, a memory budget larger than the GPU, and `--device cuda` accepted where CUDA exists."""

import pytest
import torch
from click.testing import CliRunner

from kvbuffer import LLM, demo_checkpoint
from kvbuffer.cli.main import main

pytestmark = pytest.mark.gpu

DEMO = str(demo_checkpoint())


def test_a_device_index_past_the_last_gpu_is_refused():
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"this machine has {count} CUDA device"):
        LLM(DEMO, device=f"cuda:{count}")


def test_a_memory_budget_beyond_the_gpu_is_refused_and_one_within_is_used():
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(ValueError, match="more than the device has"):
        LLM(DEMO, device="cuda", memory_budget=total + 1)
    llm = LLM(DEMO, device="cuda", memory_budget=2**28, kernels=False, cuda_graphs=False)
    assert llm.runner.spec.max_requests >= 1
    out = llm.generate([[5, 6, 7]], max_new_tokens=3)[0]
    assert len(out.token_ids) == 3


def test_cli_generate_on_cuda_runs():
    r = CliRunner().invoke(main, ["generate", "--device", "cuda", "--prompt", "The ", "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output
