"""The ops' metadata checks on CUDA: they run before the kernel lookup and launch, so a bad call
is a typed error naming the argument (nothing compiled or launched) and every pool is unchanged.
CPU twin: tests/kernels/test_ops_hardening.py."""

import random

import pytest
import torch

from kvbuffer.errors import DeviceError, ShapeError
from kvbuffer.kernels import lookup
from tests.support.op_calls import OPS, call_op, snapshot, unchanged, valid_call

pytestmark = pytest.mark.gpu


def cuda_call(name: str, seed: int = 0) -> dict:
    for s in range(seed, seed + 500):
        call = valid_call(name, random.Random(s), torch.Generator().manual_seed(s))
        if all(call[p].shape[0] > 1 for p in ("state", "conv_state") if p in call):
            return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    raise AssertionError(name)


def _no_lookup(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a rejected call reached the kernel lookup")
    monkeypatch.setattr(lookup, "kernel_for", refuse)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", OPS)
def test_a_slots_tensor_on_another_device_is_a_device_error(name, device, monkeypatch):
    _no_lookup(monkeypatch)
    call = cuda_call(name)
    slots = "slots" if name.startswith("conv1d") else "state_slots"
    call[slots] = call[slots].to(device)
    before = snapshot(call)
    with pytest.raises(DeviceError, match=slots):
        call_op(name, call)
    assert unchanged(before, call)


@pytest.mark.parametrize("name", [op for op in OPS if "flush" not in op and "conv" not in op])
def test_a_one_element_A_log_is_a_shape_error_on_cuda(name, monkeypatch):
    _no_lookup(monkeypatch)
    call = cuda_call(name)
    call["A_log"] = call["A_log"][:1]
    with pytest.raises(ShapeError, match="A_log must have shape"):
        call_op(name, call)


@pytest.mark.parametrize("name", [op for op in OPS if op != "conv1d_accept"])
def test_an_expanded_pool_is_a_shape_error_on_cuda(name, monkeypatch):
    _no_lookup(monkeypatch)
    call = cuda_call(name)
    pool = "conv_state" if name.startswith("conv1d") else "state"
    call[pool] = call[pool][:1].expand_as(call[pool])
    with pytest.raises(ShapeError, match="overlapping memory"):
        call_op(name, call)
