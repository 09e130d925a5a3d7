"""tiles/simt_parts.py's `exp_of_f64` lowered by TileLang for sm_90a and run on the CPU through
tests/support/simt_emulator.py: exp of an fp64 log-decay difference, in fp32, without fp64 transcendentals."""

import importlib.util
import math
import shutil

import pytest
import torch

pytestmark = [pytest.mark.tilelang, pytest.mark.slow]

if importlib.util.find_spec("tilelang") is None or not shutil.which("nvcc") or not shutil.which("g++"):
    pytest.skip("needs TileLang, nvcc and g++", allow_module_level=True)

from kvbuffer.gpus import get_gpu  # noqa: E402

from tests.support.simt_emulator import emulated  # noqa: E402

N = 64


def _exp_kernel():
    import tilelang.language as T

    from kvbuffer.tiles.simt_parts import exp_of_f64

    @T.prim_func
    def exp_kernel(d: T.Tensor((N,), "float64"), out: T.Tensor((N,), "float32")):
        with T.Kernel(1, threads=N) as (bx,):
            tx = T.get_thread_binding()
            out[tx] = exp_of_f64(T, d[tx])

    return exp_kernel


def test_exp_of_f64_is_fp32_accurate_for_any_log_decay():
    """A few fp32 ulp over [-100, 0] (where an fp32-rounded difference would lose |d| 2^-24), exactly 1 at
    0, and 0 for differences that underflow, including -inf (no inf - inf)."""
    emu = emulated(_exp_kernel(), get_gpu("h200").target)
    g = torch.Generator().manual_seed(0)
    d = torch.cat([torch.tensor([0.0, -1e-12, -0.5, -1.0, -88.0, -104.0, -745.0, -1e308, -math.inf],
                                dtype=torch.float64),
                   -100 * torch.rand(N - 9, generator=g, dtype=torch.float64)])
    out = torch.full((N,), float("nan"))
    emu((1, 1, 1), N, d=d, out=out)
    want = torch.exp(d)
    assert out[0] == 1.0 and bool((out[5:9] == 0).all())
    finite = want > 1e-30  # normal fp32 results
    rel = ((out[finite].double() - want[finite]) / want[finite]).abs().max()
    assert rel < 4e-7, rel
