"""The compiled-kernel launchers refuse tensors off CUDA with a DeviceError naming the argument,
before anything launches (checked on the CPU with stand-in compiled ops that must never run)."""

import pytest
import torch

from kvbuffer.errors import DeviceError
from kvbuffer.kernels import conv, gdn, mamba2
from kvbuffer.kernels.compiled import CompiledOp

B, bf16 = 3, torch.bfloat16


def _never(*args):
    raise AssertionError("a kernel launched with CPU tensors")


def _op(kind: str, **params) -> CompiledOp:
    return CompiledOp(_never, kind, params)


def _gdn_step():
    Hk, Hv, K, V = 2, 4, 16, 16
    op = _op("recurrent", Hk=Hk, Hv=Hv, K=K, V=V)
    t = lambda *s: torch.zeros(B, *s, dtype=bf16)  # noqa: E731
    f32 = torch.zeros(Hv)
    return lambda: gdn.gdn_recurrent_step(op, t(Hk, K), t(Hk, K), t(Hv, V), t(Hv), t(Hv), f32, f32,
                                          torch.zeros(4, Hv, K, V), torch.arange(B, dtype=torch.int32))


def _mamba2_step():
    G, H, N, P = 1, 2, 16, 16
    op = _op("recurrent", G=G, H=H, N=N, P=P)
    t = lambda *s: torch.zeros(B, *s, dtype=bf16)  # noqa: E731
    f32 = torch.zeros(H)
    return lambda: mamba2.mamba2_recurrent_step(op, t(H, P), t(H), f32, f32, t(G, N), t(G, N), f32,
                                                torch.zeros(4, H, N, P), torch.arange(B, dtype=torch.int32))


def _conv_update():
    D, W = 8, 4
    op = _op("conv_advance", D=D, W=W, span=W - 1, T=1, dtype="bfloat16", w_dtype="bfloat16", has_bias=False)
    return lambda: conv.conv1d_update(op, torch.zeros(B, 1, D, dtype=bf16), torch.zeros(4, D, W - 1, dtype=bf16),
                                      torch.arange(B, dtype=torch.int32), torch.zeros(D, W, dtype=bf16))


def _conv_accept():
    D, W = 8, 4
    op = _op("conv_accept", D=D, W=W, span=W + 1, dtype="bfloat16")
    return lambda: conv.conv1d_accept(op, torch.zeros(4, D, W + 1, dtype=bf16), torch.arange(B, dtype=torch.int32),
                                      torch.zeros(B, dtype=torch.int32))


@pytest.mark.parametrize("call, arg", [(_gdn_step, "q"), (_mamba2_step, "x"), (_conv_update, "x"),
                                       (_conv_accept, "slots")],
                         ids=["gdn_recurrent_step", "mamba2_recurrent_step", "conv1d_update", "conv1d_accept"])
def test_cpu_tensors_are_a_device_error_naming_the_argument(call, arg):
    with pytest.raises(DeviceError, match=f"{arg} is on cpu"):
        call()()
