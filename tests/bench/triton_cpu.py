"""Triton's CPU interpreter (TRITON_INTERPRET=1) for tests that run the servers' Triton kernels on CPU
tensors, with its two known bugs worked around (triton 3.9; the kernels themselves are left alone):

- a mask that is a scalar comparison reaches load/store as a non-bool array ("mask has unsupported
  dtype"): masks are cast to bool;
- `tl.dot` on bf16 operands multiplies their raw uint16 bit patterns: bf16 operands are widened to
  fp32 first (exact), as the GPU's tensor cores read them.

TRITON_INTERPRET must be set before triton is first imported (triton's own library functions are
decorated then): `request_interpreter()`, called when a test module is imported, sets it if triton
is not imported yet and there is no CUDA; `interpreted()` patches the builder around a test, and
skips the test on a GPU (the GPU tests run these kernels compiled), when triton is absent, or when it
was imported without the interpreter (run that test file on its own then).
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import pytest


def _widen_bf16(data: np.ndarray) -> np.ndarray:
    return (data.astype(np.uint32) << 16).view(np.float32)


def request_interpreter() -> None:
    """Only on a machine without CUDA: the variable is process-wide, and on a GPU it would send every
    later Triton kernel of the same test process (Inductor's, FLA's) through the interpreter."""
    import torch

    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@contextlib.contextmanager
def interpreted():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: Triton stays compiled (tests/bench/test_replayssm_gpu.py runs these kernels on it)")
    pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime import interpreter

    if not isinstance(tl.cumsum, interpreter.InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run this test file on its own")

    builder = interpreter.InterpreterBuilder
    plain_load, plain_store, plain_dot = builder.create_masked_load, builder.create_masked_store, builder.create_dot

    def as_bool(mask):
        return interpreter.TensorHandle(np.asarray(mask.data).astype(bool), tl.int1)

    # the trailing arguments (cache and eviction hints, dot precision) differ between Triton releases: passed on
    def load(self, ptrs, mask, other, *hints):
        return plain_load(self, ptrs, as_bool(mask), other, *hints)

    def store(self, ptrs, value, mask, *hints):
        return plain_store(self, ptrs, value, as_bool(mask), *hints)

    def dot(self, a, b, d, *precision):
        def fp32(h):
            return interpreter.TensorHandle(_widen_bf16(h.data), tl.float32) if h.dtype.scalar == tl.bfloat16 else h
        return plain_dot(self, fp32(a), fp32(b), d, *precision)

    builder.create_masked_load, builder.create_masked_store, builder.create_dot = load, store, dot
    try:
        yield
    finally:
        builder.create_masked_load, builder.create_masked_store, builder.create_dot = plain_load, plain_store, plain_dot
