"""The FP8 one-row projection (tiles/gemv.py `fp8_gemv` through kvbuffer.kernels) on CUDA against the
dequantized product in fp64: Qwen3.5-9B's projections in 128 x 128 blocks, Nemotron-3-Nano's with a scale
per row, awkward sizes (partial blocks, ragged passes, N not a multiple of a block's columns), 1, 2 and 8
rows, every tuner config, outputs NaN-poisoned before the launch; refusals before the launch; the custom op
in a CUDA graph; and a timing printout at the 9B's shapes against the bf16 one-row kernel on the same
(dequantized) weights, each a CUDA graph of many launches with the weights rotated past twice the L2.

Kernels come from JIT (kvbuffer.ops.allow_jit()). Run with -s to see the errors and the timings:

    pytest -s tests/gpu/test_fp8_gemv.py
"""

import pytest
import torch

from kvbuffer import ops
from kvbuffer.kernels import build_fp8_gemv, fp8_gemv, launch, specs
from kvbuffer.reference import fp8 as ref_fp8

pytestmark = pytest.mark.gpu

TOL = 4e-3  # relative (norm) error: the bf16 output's rounding
BLOCK = (128, 128)
SHAPES = [  # (N, K, block)
    (12352, 4096, BLOCK), (4096, 12288, BLOCK), (24576, 4096, BLOCK), (10240, 4096, BLOCK),
    (10304, 2688, (1, 2688)), (2688, 3712, (1, 3712)),
    (37, 2688, BLOCK), (1000, 80, BLOCK), (300, 1040, (64, 32)), (3, 16, (1, 16)),
]


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


def _case(N, K, rows, block, seed, dtype=torch.bfloat16):
    """x ~ N(0, 1); q spread over e4m3's range; scales ~ 1 / (64 sqrt(K)), so y ~ N(0, 1)-sized."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, K, generator=gen, device="cuda").to(dtype)
    q = (torch.randn(N, K, generator=gen, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = ref_fp8.scale_grid(N, K, block)
    scale = (0.5 + torch.rand(grid, generator=gen, device="cuda")) / (64 * K ** 0.5)
    return x, q, scale


def _fp64(x, q, scale, block):
    return x.double() @ ref_fp8.dequantize(q, scale, block).double().T


def _rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("N,K,block", SHAPES, ids=[f"{n}x{k}-{b[0]}x{b[1]}" for n, k, b in SHAPES])
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_kernel_matches_fp64(N, K, block, rows):
    for dtype in (torch.bfloat16, torch.float16):
        x, q, scale = _case(N, K, rows, block, N + K + rows, dtype)
        op = build_fp8_gemv(N, K, block, rows, dtype=str(dtype).removeprefix("torch."))
        y = torch.full((rows, N), float("nan"), device="cuda", dtype=dtype)
        fp8_gemv(op, x, q, scale, out=y)
        ref = _fp64(x, q, scale, block)
        err = _rel(y, ref)
        print(f"N={N} K={K} block={block} rows={rows} {dtype}: rel err {err:.2e} "
              f"(the reference's {_rel(ref_fp8.linear(x, q, scale, block), ref):.2e})")
        assert bool(torch.isfinite(y).all()) and err < TOL


@pytest.mark.parametrize("config", range(6))
def test_every_tuner_config_matches_fp64(config):
    from kvbuffer.tiles.gemv import get_fp8_configs

    tunables = get_fp8_configs()[config]
    for N, K, block in ((4096, 4096, BLOCK), (37, 2688, BLOCK), (1000, 80, (1, 80))):
        x, q, scale = _case(N, K, 1, block, config)
        y = fp8_gemv(build_fp8_gemv(N, K, block, **tunables), x, q, scale)
        assert _rel(y, _fp64(x, q, scale, block)) < TOL, (tunables, N, K)


def test_bad_calls_raise_before_the_launch():
    from kvbuffer.errors import DeviceError, DTypeError, ShapeError

    op = build_fp8_gemv(256, 256, BLOCK)
    x, q, scale = _case(256, 256, 1, BLOCK, 0)
    out = torch.full((1, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
    bad = [((x, q, scale[:, :1]), ShapeError, "scale must have shape"),
           ((x, q, scale.T.contiguous().T), ShapeError, "scale must be contiguous"),
           ((x, q.view(torch.uint8), scale), DTypeError, "q must have dtype"),
           ((x.half(), q, scale), DTypeError, "x must have dtype"),
           ((x, q, scale.cpu()), DeviceError, "scale is on cpu"),
           ((x, q.T.contiguous().T, scale), ShapeError, "q must be contiguous")]
    for args, error, message in bad:
        with pytest.raises(error, match=message):
            fp8_gemv(op, *args, out=out)
    assert bool(out.isnan().all())  # nothing written
    with pytest.raises(DTypeError, match="bfloat16 or float16"):
        torch.ops.kvbuffer.fp8_gemv(x.float(), q, scale, *BLOCK)


def test_custom_op_in_a_cuda_graph():
    """torch.ops.kvbuffer.fp8_gemv on CUDA, captured once and replayed after x changed in place."""
    x, q, scale = _case(10240, 4096, 1, BLOCK, 3)
    torch.ops.kvbuffer.fp8_gemv(x, q, scale, *BLOCK)  # the lookup (and JIT compile) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.kvbuffer.fp8_gemv(x, q, scale, *BLOCK)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(y, _fp64(x, q, scale, BLOCK)) < TOL
    assert specs.tune_template(launch.fp8_gemv_key(q, *BLOCK, "bfloat16")) == "fp8_gemv"


def test_engine_op_launches_directly_on_cuda_and_runs_the_reference_on_cpu():
    x, q, scale = _case(512, 1024, 1, BLOCK, 4)
    got = launch.FP8_GEMV(x, q, scale, *BLOCK)
    assert _rel(got, _fp64(x, q, scale, BLOCK)) < TOL
    cpu = launch.FP8_GEMV(x.cpu(), q.cpu(), scale.cpu(), *BLOCK)
    assert torch.equal(cpu, ref_fp8.linear(x.cpu(), q.cpu(), scale.cpu(), BLOCK))


NINE_B = [(12352, 4096), (4096, 4096), (10240, 4096), (24576, 4096), (4096, 12288)]  # Qwen3.5-9B's, lm_head aside


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_timing_against_the_bf16_kernel_at_9b_shapes(rows):
    """A printout, no bar: per shape the FP8 kernel's and the bf16 kernel's times on the same weights
    (dequantized to bf16), their achieved bandwidth (each weight's bytes once) against the copy
    bandwidth, the ratio, and over a decode step's projections (each shape times how many the 9B has)."""
    from kvbuffer import presets
    from kvbuffer.autotune.models import config_projection_counts
    from kvbuffer.bench.timing import copy_bandwidth, graph_median, l2_bytes, sets_to_exceed

    copy = copy_bandwidth()
    counts = config_projection_counts(presets.get("qwen3.5-9b").hf_config())
    step = {"fp8": 0.0, "bf16": 0.0}
    for N, K in NINE_B:
        sets = sets_to_exceed(2 * N * K, 2 * l2_bytes())  # the bf16 weights; the FP8 ones rotate the same sets
        cases = [_case(N, K, rows, BLOCK, N + K + i) for i in range(sets)]
        weights = [ref_fp8.dequantize(q, s, BLOCK).bfloat16() for _, q, s in cases]
        fp8 = lambda i: launch.fp8_gemv(cases[i][0], cases[i][1], cases[i][2], *BLOCK, checked=False)  # noqa: E731
        bf16 = lambda i: launch.gemv(cases[i][0], weights[i], checked=False)  # noqa: E731
        x, q, scale = cases[0]
        ref = _fp64(x, q, scale, BLOCK)
        assert _rel(fp8(0), ref) < TOL and _rel(bf16(0), ref) < TOL  # the correctness gate first
        t8 = graph_median(fp8, sets, rotated_bytes=N * K * sets)
        t16 = graph_median(bf16, sets, rotated_bytes=2 * N * K * sets)
        n = counts[(N, K)]
        step["fp8"] += n * t8.seconds
        step["bf16"] += n * t16.seconds
        print(f"rows={rows} N={N:6d} K={K:5d} x{n:2d}: fp8 {t8.us:7.1f} us ({N * K / t8.seconds / 1e9:5.0f} GB/s)  "
              f"bf16 {t16.us:7.1f} us ({2 * N * K / t16.seconds / 1e9:5.0f} GB/s)  fp8/bf16 "
              f"{t8.seconds / t16.seconds:4.2f}", flush=True)
        del cases, weights
        torch.cuda.empty_cache()
    print(f"rows={rows} per decode step (these projections): fp8 {step['fp8'] * 1e3:.3f} ms, bf16 "
          f"{step['bf16'] * 1e3:.3f} ms, fp8/bf16 {step['fp8'] / step['bf16']:.2f}; copy bandwidth "
          f"{copy / 1e9:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
