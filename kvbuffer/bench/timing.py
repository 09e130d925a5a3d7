"""One timing method for every kernel figure kvbuffer reports: a CUDA graph of many launches.

A CUDA event pair around one Python call times the caller as well whenever the GPU waits for
the CPU: a peer's Python wrapper (tens of microseconds) then counts as kernel time. Servers
launch these kernels inside CUDA graphs, so that is how they are timed here: after one eager
warm-up call (which also runs a Triton peer's autotuning), `launches` calls are captured in one
`torch.cuda.CUDAGraph`, the graph is replayed `replays` times, and the median replay divided by
`launches` is the time per launch. Each call gets a set index; the caller keeps `sets` copies of
its inputs and states, together larger than twice the L2, so every launch reads from HBM as in
a server whose batch of states does not fit in cache.

`profiler_seconds` is the cross-check: the device time torch.profiler attributes to the kernels of
eager calls, which no host overhead can inflate either.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

from ..errors import KVBufferError

DEFAULT_LAUNCHES = 32
DEFAULT_REPLAYS = 20


class NoCudaError(KVBufferError, RuntimeError):
    """A benchmark or a measurement needs a CUDA GPU and none is visible."""


def require_cuda(what: str = "this benchmark") -> None:
    import torch

    if not torch.cuda.is_available():
        raise NoCudaError(f"{what} times GPU kernels and needs a CUDA GPU; none is visible")


def l2_bytes() -> int:
    """The L2 cache size of CUDA device 0."""
    import torch

    return int(torch.cuda.get_device_properties(0).L2_cache_size)


def sets_to_exceed(bytes_per_set: float, cache_bytes: float, *, at_least: int = 2, multiple_of: int = 1) -> int:
    """How many copies of `bytes_per_set` together exceed `cache_bytes` (rounded up to `multiple_of`)."""
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be positive, got {bytes_per_set}")
    if multiple_of < 1 or at_least < 1:
        raise ValueError(f"multiple_of and at_least must be >= 1, got {multiple_of}, {at_least}")
    n = max(at_least, math.floor(cache_bytes / bytes_per_set) + 1)
    return -(-n // multiple_of) * multiple_of


@dataclass(frozen=True)
class Timing:
    """A median time per launch and how it was obtained."""

    seconds: float
    launches: int
    replays: int
    rotated_bytes: float

    @property
    def us(self) -> float:
        return self.seconds * 1e6

    @property
    def method(self) -> str:
        """The line every results file records under "timing"."""
        return describe(self.launches, self.replays, self.rotated_bytes)


def describe(launches: int, replays: int, rotated_bytes: float) -> str:
    return (f"cuda-graph, {launches} launches, median of {replays} replays, "
            f"inputs rotated over {rotated_bytes / 1e6:.0f} MB")


def graph_median(fn: Callable[[int], object], sets: int, *, rotated_bytes: float,
                 launches: int = DEFAULT_LAUNCHES, replays: int = DEFAULT_REPLAYS) -> Timing:
    """Median seconds per launch of fn(set index), `launches` calls captured in one CUDA graph.

    Launch i uses set i % sets; `launches` is raised to a multiple of `sets` so every set is used
    equally often. `rotated_bytes`: the bytes those sets span (recorded, not checked).
    """
    import torch

    require_cuda("graph_median")
    if sets < 1 or launches < 1 or replays < 1:
        raise ValueError(f"sets, launches and replays must be >= 1, got {sets}, {launches}, {replays}")
    launches = -(-max(launches, sets) // sets) * sets
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with _ffi_follows(torch.cuda.stream(side)):  # warm-up off the default stream, as graph capture requires
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    from ..engine.graphs import collection_paused

    graph = torch.cuda.CUDAGraph()
    with collection_paused(), _ffi_follows(torch.cuda.graph(graph)):
        for i in range(launches):
            fn(i % sets)
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / launches)
    del graph
    return Timing(statistics.median(times), launches, replays, rotated_bytes)


def _ffi_follows(context):
    """`context` (a torch stream or graph context) with TVM-FFI launches following torch's stream in it.

    TileLang kernels launch through TVM-FFI on TVM's own current stream; without this they would run
    outside the graph being captured.
    """
    try:
        import tvm_ffi
    except ImportError:  # no TileLang kernel can be running
        return context
    return tvm_ffi.use_torch_stream(context)


def profiler_seconds(fn: Callable[[int], object], sets: int, *, launches: int = DEFAULT_LAUNCHES) -> float:
    """Device seconds per launch that torch.profiler attributes to the kernels of eager calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    require_cuda("profiler_seconds")
    fn(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(launches):
            fn(i % sets)
        torch.cuda.synchronize()
    busy_us = sum(e.self_device_time_total for e in device_kernels(prof))
    return busy_us / 1e6 / launches


def device_kernels(prof) -> list:
    """The profile's GPU kernels (averaged by name), longest total first; host-side events left out."""
    from torch.autograd import DeviceType

    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    return sorted(kernels, key=lambda e: -e.self_device_time_total)


def copy_bandwidth(nbytes: int = 2 * 2**30, replays: int = DEFAULT_REPLAYS) -> float:
    """Bytes per second (read + written) of a large device-to-device copy by an SM kernel, timed like the
    kernels. Not `dst.copy_(src)`: captured in a CUDA graph that is a memcpy node, far slower than the
    same copy run eagerly (docs/results.md); the kernels compared against it are SM kernels in graphs too."""
    import torch

    require_cuda("copy_bandwidth")
    src = torch.rand(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    t = graph_median(lambda i: torch.mul(src, 1.0, out=dst), 1, rotated_bytes=2 * nbytes, launches=4,
                     replays=replays)
    return 2 * nbytes / t.seconds
