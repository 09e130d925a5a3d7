"""A prompt piece's forward on CUDA does not wait for the device: the kernel Backend's prompt path (flush,
chunked prefill, verify chunks for the rest) under torch's sync debug mode, which raises at the first
synchronising call; and the whole model's prompt forward, whose prompt attention slices its rows from
ForwardBatch.host_slots and host_cached (no read-back). Kernels from the JIT."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch

from kvbuffer import ops
from kvbuffer.runtime.backend import KernelBackend

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
@pytest.mark.parametrize("B,T,fill", [(1, 2048, 0), (1, 1000, 37), (3, 200, 5)], ids=str)
def test_kernel_prompt_path_never_reads_the_device_back(family, B, T, fill):
    from tests.gpu.test_kernel_prefill import C, problem

    inputs, state, state_slots, buf, slots = problem(family, B, T, fill)
    backend = KernelBackend()
    backend.prefill(inputs, state, state_slots, buf, slots, fill, C)  # every kernel built and loaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.prefill(inputs, state, state_slots, buf, slots, fill, C)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("tokens,fill", [(2048, 0), (1000, 5)], ids=str)
def test_prompt_forward_reads_nothing_back(kind, tokens, fill):
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM
    from kvbuffer.engine.request import Request
    from kvbuffer.engine.sampling import SamplingParams

    model = tiny_model(kind)
    llm = LLM(model, device="cuda", dtype=torch.bfloat16, chunk_size=16, max_batch=2, kernels=True,
              cuda_graphs=False, max_len=4096)
    llm.generate([list(range(1, 40))], max_new_tokens=2)  # the kernels loaded
    runner = llm.runner
    req = Request(0, [(7 * i) % 97 for i in range(fill + tokens)], SamplingParams(max_new_tokens=1))
    runner.admit(req)
    if fill:
        runner.prefill([req], fill)
    forward, syncs = runner._view_forward, []

    def watched(*a, **kw):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return forward(*a, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                syncs.extend(str(w.message) for w in seen if "synchroniz" in str(w.message))
    with mock.patch.object(runner, "_view_forward", watched):
        runner.prefill([req], tokens)
    assert not syncs, syncs
