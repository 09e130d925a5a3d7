"""What every kernel family's ops share: the launch on torch's stream, the engine's call of an op, and the
registration of a custom op's fake and CUDA implementations.

A family module (kvbuffer.kernels.conv, ...) defines its `torch.ops.kvbuffer.*` ops with
`torch.library.custom_op` (the CPU implementation: the reference, with its checks) and hands each to
`implement`: the checks that read no tensor data run in the fake and before every CUDA launch, so a
`meta` tensor among real ones is refused, never answered with the fake's uninitialised output.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..checks import check_same_device
from . import specs


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def on_torch_stream(fn, *args, **kwargs):
    """Launch on torch's current stream (the capture stream during CUDA graph capture)."""
    import tvm_ffi

    with tvm_ffi.use_torch_stream():
        return fn(*args, **kwargs)


def token_axis(t):
    """(B, ...) -> (B, 1, ...): the kernels take a token axis (a free view)."""
    return None if t is None else t.unsqueeze(1)


@dataclass(frozen=True)
class EngineOp:
    """A custom op as the engine calls it on rows whose slots and fills it built and checked itself: on
    CUDA the direct launch (it skips the checks that read the device back); elsewhere, or under
    torch.compile, the op itself (its CPU implementation is the reference; compiled, a graph node)."""

    launch: Callable = field(repr=False)  # the CUDA launch (takes checked=False)
    op: Callable = field(repr=False)      # () -> torch.ops.kvbuffer.<the op>

    def __call__(self, *args):
        if args[0].is_cuda and not torch.compiler.is_compiling():
            return self.launch(*args, checked=False)
        return self.op()(*args)


def engine_rows(name: str, *args):
    """torch.ops.kvbuffer.<name>(*args) as EngineOp runs it (for callers that hold the op's name; the
    engine's own layers hold the EngineOp)."""
    if args[0].is_cuda and not torch.compiler.is_compiling():
        return specs.CUDA_LAUNCHES[name](*args, checked=False)
    return getattr(torch.ops.kvbuffer, name)(*args)


def binder(op) -> Callable[[tuple, dict], dict]:
    """(args, kwargs) -> the call's arguments by name, defaults included (a zip over the schema: cheap per call)."""
    params = tuple(inspect.signature(op._init_fn).parameters.values())

    def bind(args: tuple, kwargs: dict) -> dict:
        bound = {p.name: p.default for p in params[len(args):]}
        bound.update(zip((p.name for p in params), args))
        bound.update(kwargs)
        return bound
    return bind


def implement(op, meta_checks: Callable[[dict], None], fake_result: Callable[[dict], object], launch: Callable) -> None:
    """Register custom op `op`'s fake (the checks that read no tensor data, then `fake_result` of the
    arguments by name) and CUDA implementation (the same checks, then `launch`)."""
    bind = binder(op)

    def checked(args, kwargs) -> dict:
        bound = bind(args, kwargs)
        check_same_device(bound)
        meta_checks(bound)
        return bound

    op.register_fake(lambda *args, **kwargs: fake_result(checked(args, kwargs)))

    def cuda_impl(*args, **kwargs):
        checked(args, kwargs)
        return launch(*args, **kwargs)
    op.register_kernel("cuda")(cuda_impl)
