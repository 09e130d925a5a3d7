"""torch.ops.kvbuffer.conv1d_update / conv1d_accept on CPU (the reference implementations), and the
engine's wiring of them (kvbuffer.runtime.backend.KernelBackend): with a conv kernel
"available" the engine routes every short conv and accept through the custom ops; without one (no
artifact, no JIT) it stays on the reference conv. The CUDA kernels: tests/gpu/test_conv1d_kernels.py.
"""

import pytest
import torch
from torch.library import opcheck

from kvbuffer.errors import ArtifactError
from kvbuffer.kernels import lookup
from kvbuffer.kernels.keys import ConvDims, KernelKey
from kvbuffer.reference import conv as ref

D, W, SPAN = 10, 4, 3 + 8


def _pool(B=3):
    g = torch.Generator().manual_seed(B)
    state = torch.randn(B + 3, D, SPAN, generator=g)
    slots = torch.randperm(B + 3, generator=g)[:B].int()
    slots[1 % B] = -1
    return g, state, slots


@pytest.mark.parametrize("kind,T", [("advance", 1), ("advance", 5), ("verify", 1), ("verify", 3)])
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
def test_update_op_is_the_reference(kind, T, has_bias):
    g, state, slots = _pool()
    x = torch.randn(3, T, D, generator=g)
    w, b = torch.randn(D, W, generator=g), (torch.randn(D, generator=g) if has_bias else None)
    mine, theirs = state.clone(), state.clone()
    out = torch.ops.kvbuffer.conv1d_update(x, mine, slots, w, b, kind)
    if kind == "verify":
        want = ref.verify_rows(x, theirs, slots, w, b)
    elif T == 1:
        want = ref.step_rows(x[:, 0], theirs, slots, w, b)[:, None]
    else:
        want = ref.prefill_rows(x, theirs, slots, w, b)
    assert torch.equal(out, want) and torch.equal(mine, theirs)
    opcheck(torch.ops.kvbuffer.conv1d_update.default, (x, state.clone(), slots, w, b, kind, True))


def test_accept_op_is_the_reference():
    _, state, slots = _pool()
    accepted = torch.tensor([3, 0, 8], dtype=torch.int32)
    mine, theirs = state.clone(), state.clone()
    torch.ops.kvbuffer.conv1d_accept(mine, slots, accepted, W)
    ref.accept_rows(theirs, slots, accepted, W)
    assert torch.equal(mine, theirs)
    opcheck(torch.ops.kvbuffer.conv1d_accept.default, (state.clone(), slots, accepted, W))


def test_bad_calls_raise():
    _, state, slots = _pool()
    with pytest.raises(ValueError, match="mode"):
        torch.ops.kvbuffer.conv1d_update(torch.randn(3, 1, D), state, slots, torch.randn(D, W), None, "rollback")
    with pytest.raises(ValueError, match="pending"):
        torch.ops.kvbuffer.conv1d_update(torch.randn(3, 9, D), state, slots, torch.randn(D, W), None, "verify")


def test_no_kernel_and_no_jit_is_an_artifact_error(monkeypatch):
    monkeypatch.setattr(lookup, "jit_allowed", lambda: False)
    with pytest.raises(ArtifactError, match="KVBUFFER_JIT"):
        lookup.kernel_for(KernelKey("conv1d", "advance", ConvDims(D, W, SPAN), "bfloat16", w_dtype="bfloat16"))


def _kernel_runner(llm):
    from kvbuffer.engine.runner import ModelRunner
    from kvbuffer.runtime.backend import KernelBackend

    return ModelRunner(llm.model, llm.runner.spec, mode="kvbuffer", device=llm.device, dtype=llm.dtype,
                       buffer_dtype=torch.bfloat16, backend=KernelBackend())


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("available", [True, False], ids=["conv-kernel", "no-conv-kernel"])
def test_engine_routes_the_conv_through_the_ops(kind, available, monkeypatch):
    """kernels=True caches on CPU: with a conv kernel "there", every short conv (prefill, decode, verify)
    and accept goes through torch.ops.kvbuffer.conv1d_* (the reference on CPU) with the same tokens;
    without one (no JIT) the reference conv runs and nothing fails."""
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM

    calls = {"advance": 0, "verify": 0, "accept": 0}

    def kernel_for(key, batch=1):
        if not available:
            raise ArtifactError("no conv kernel (test)")
        calls[key.op] += 1
        return object()

    monkeypatch.setattr(lookup, "kernel_for", kernel_for)
    prompts = [[5, 17, 3, 44, 9, 61, 2, 30, 11, 7, 12, 90, 4], [8, 1, 33]]
    spec = {"method": "ngram", "num_draft_tokens": 3}
    ref_llm = LLM(tiny_model(kind), device="cpu", chunk_size=4, max_batch=2, kernels=False, speculative=spec)
    want = ref_llm.generate(prompts, max_new_tokens=12, stop_token_ids=[])
    llm = LLM(tiny_model(kind), device="cpu", chunk_size=4, max_batch=2, kernels=False, speculative=spec)
    llm.runner = _kernel_runner(llm)
    got = llm.generate(prompts, max_new_tokens=12, stop_token_ids=[])
    assert [a.token_ids for a in got] == [b.token_ids for b in want]
    if available:
        assert calls["advance"] and calls["verify"] and calls["accept"], calls
    else:
        assert len(llm.runner.backend.conv_on_reference) >= 2  # each missing kernel tried once, then remembered


def test_the_prompt_kernel_reads_in_place_only_views_it_can_index():
    """A packed projection's columns are read in place; a view whose channels are not adjacent, or whose
    last element lies 2**31 or more past its first (the kernel indexes in int32), is copied first."""
    from kvbuffer.kernels.conv import reads_in_place

    packed = torch.empty(2, 4096, 12352, device="meta", dtype=torch.bfloat16)
    assert reads_in_place(packed[..., :8192]) and reads_in_place(packed[..., 4096:8192])
    assert not reads_in_place(packed[..., :8192].transpose(1, 2))
    wide = torch.empty(3, 70000, 12352, device="meta", dtype=torch.bfloat16)[..., :8192]
    assert max(wide.stride()) < 2**31 and not reads_in_place(wide)
