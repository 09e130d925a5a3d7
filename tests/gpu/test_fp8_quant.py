"""The block-FP8 activation quantizer (tiles/fp8_quant.py through kvbuffer.kernels.fp8_ops) on CUDA: bit for
bit against kvbuffer.reference.fp8 (awkward M, K of one group to 12288, both dtypes, rows of zeros, huge and
tiny magnitudes; NaN and inf by their NaN-ness), every tuner config, outputs poisoned first; the custom op
in a CUDA graph; the block-wise GEMM with the kernel against the torch path (identical); and a timing
printout at K = 4096 against the torch ops it replaces, and of the whole block-wise GEMM at the 9B's
2048 x 12288 x 4096 against bf16, each a CUDA graph of 32 launches (median of 20 replays), inputs rotated
past twice the L2.

Kernels come from JIT (kvbuffer.ops.allow_jit()). Run with -s to see the timings:

    pytest -s tests/gpu/test_fp8_quant.py
"""

import math

import pytest
import torch

from kvbuffer import ops
from kvbuffer.kernels import fp8_ops, launch, lookup
from kvbuffer.reference import fp8 as ref_fp8

pytestmark = pytest.mark.gpu

ROWS = [1, 3, 4, 5, 127, 1000, 4099]
COLUMNS = [128, 256, 2688, 4096, 12288]
L2_BYTES = 60e6


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


def _case(M, K, seed, dtype=torch.bfloat16, kind="extremes"):
    """x (M, K): N(0, 1) scaled per row and group by 10^U(-3, 3); rows of zeros, huge and tiny rows, a
    lone value in a group; or NaN and inf."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K // 128, 128, generator=gen, device="cuda")
    x *= 10 ** (6 * torch.rand(M, K // 128, 1, generator=gen, device="cuda") - 3)
    x = x.view(M, K)
    if kind == "extremes":
        x[::3] = 0
        x[1::5] = (x[1::5] * 1e30).clamp(-6e4, 6e4) if dtype == torch.float16 else x[1::5] * 1e30
        x[2::7] *= 1e-38 if dtype == torch.bfloat16 else 1e-4
        x[4::6, K - 128:] = 0
        x[4::6, K - 127] = -3.0
    if kind == "nonfinite":
        x[0, 3], x[-1, K - 1], x[M // 2, 0] = float("nan"), float("inf"), -float("inf")
    return x.to(dtype)


def _poisoned(M, K):
    rows = ref_fp8.padded_rows(M)
    q = torch.full((rows, K), 0x7F, dtype=torch.uint8, device="cuda").view(ref_fp8.FP8)
    return q, torch.full((K // 128, rows), float("nan"), device="cuda")


def _assert_bit_identical(got, want):
    (q, scale), (q_ref, scale_ref) = got, want
    assert q.shape == q_ref.shape and scale.shape == scale_ref.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), scale_ref.view(torch.int32))


@pytest.mark.parametrize("K", COLUMNS)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_is_the_reference_bit_for_bit(M, K, dtype):
    x = _case(M, K, M * 7 + K, dtype)
    op = lookup.kernel_for(fp8_ops.fp8_quant_key(K, str(dtype).removeprefix("torch.")))  # compiled once per K
    got = fp8_ops.run_fp8_quant_act(op, x, *_poisoned(M, K))
    _assert_bit_identical(got, ref_fp8.quantize_activations_padded(x))
    _assert_bit_identical(fp8_ops.launch_fp8_quant_act(x), got)  # the looked-up kernel
    _assert_bit_identical(torch.ops.kvbuffer.fp8_quant_act(x), got)  # the op on CUDA
    _assert_bit_identical(launch.FP8_QUANT_ACT(x), got)  # as a projection calls it (the launch, no dispatch)


def test_nonfinite_values_keep_their_nan_ness():
    x = _case(6, 384, 1, kind="nonfinite")
    (q, scale), (q_ref, scale_ref) = fp8_ops.launch_fp8_quant_act(x), ref_fp8.quantize_activations_padded(x)
    nan = q_ref.view(torch.uint8) & 0x7F == 0x7F
    assert bool(nan.any()) and torch.equal(q.view(torch.uint8) & 0x7F == 0x7F, nan)
    assert torch.equal(q.view(torch.uint8)[~nan], q_ref.view(torch.uint8)[~nan])
    assert torch.equal(scale.isnan(), scale_ref.isnan()) and torch.equal(scale.nan_to_num(), scale_ref.nan_to_num())


def test_every_tuner_config_is_the_reference():
    from kvbuffer.tiles.fp8_quant import get_configs

    x = _case(1000, 2688, 5)
    want = ref_fp8.quantize_activations_padded(x)
    for tunables in get_configs():
        op = fp8_ops.build_fp8_quant_act(2688, **tunables)
        _assert_bit_identical(fp8_ops.run_fp8_quant_act(op, x, *_poisoned(1000, 2688)), want)


def test_refusals_come_before_the_launch():
    from kvbuffer.errors import DTypeError, ShapeError

    op = fp8_ops.build_fp8_quant_act(256)
    x = _case(5, 256, 2)
    q, scale = _poisoned(5, 256)
    with pytest.raises(ShapeError, match="scale must have shape \\(2, 8\\)"):
        fp8_ops.run_fp8_quant_act(op, x, q, scale.t().contiguous())
    with pytest.raises(DTypeError, match="x must have dtype"):
        fp8_ops.run_fp8_quant_act(op, x.half(), q, scale)
    assert bool((q.view(torch.uint8) == 0x7F).all()) and bool(scale.isnan().all())
    with pytest.raises(ShapeError, match="multiple of 128"):
        torch.ops.kvbuffer.fp8_quant_act(_case(5, 256, 2)[:, :200].contiguous())


def test_op_in_a_cuda_graph():
    x = _case(300, 4096, 3)
    static = torch.zeros_like(x)
    torch.ops.kvbuffer.fp8_quant_act(static)  # the kernel looked up before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.kvbuffer.fp8_quant_act(static)
    static.copy_(x)
    graph.replay()
    _assert_bit_identical(out, ref_fp8.quantize_activations_padded(x))


def _blockwise_or_skip():
    from kvbuffer.models.quant.fp8 import device_support

    if not device_support(torch.device("cuda"))[1]:
        pytest.skip("this torch's _scaled_mm takes no block-wise scales here")


@pytest.mark.parametrize("M", [1, 5, 256, 2048])
@pytest.mark.parametrize("N,K", [(12288, 4096), (4096, 12288), (256, 2688)])
def test_blockwise_gemm_with_the_kernel_is_the_torch_paths(M, N, K):
    """The fused quantizer changes nothing downstream: the same bytes reach _scaled_mm."""
    from kvbuffer.models.quant.fp8 import _blockwise, quantize

    _blockwise_or_skip()
    gen = torch.Generator(device="cuda").manual_seed(M + N + K)
    q, s = quantize(torch.randn(N, K, generator=gen, device="cuda") * K ** -0.5, (128, 128))
    x = _case(M, K, M + N, kind="normal")
    fused, torch_path = _blockwise(x, q, s, torch.bfloat16, fused=True), _blockwise(x, q, s, torch.bfloat16, fused=False)
    assert fused.shape == (M, N) and torch.equal(fused, torch_path)


# ----------------------------------------------------------------------------------------------
# timings (printed; run with -s)


def _sets(nbytes: float) -> int:
    """Input copies that span twice the L2 (2 to 64)."""
    return max(2, min(64, math.ceil(2 * L2_BYTES / nbytes)))


def _median_us(fn, inputs) -> float:
    from kvbuffer.bench.timing import graph_median

    nbytes = sum(t.numel() * t.element_size() for t in inputs)
    return graph_median(lambda i: fn(inputs[i]), len(inputs), rotated_bytes=nbytes).seconds * 1e6


def _torch_ops(x):
    """The block-wise GEMM's activation quantization before the fused kernel."""
    from kvbuffer.models.quant.fp8 import quantize_activations

    m = x.shape[0]
    xq, xs = quantize_activations(torch.nn.functional.pad(x, (0, 0, 0, -(-m // 4) * 4 - m)))
    return xq, xs.t().contiguous().t()


def test_timing_against_the_torch_ops(capsys):
    K = 4096
    rows = []
    for M in (1, 256, 2048, 16384):
        xs = [_case(M, K, i, kind="normal") for i in range(_sets(M * K * 2))]
        fused = _median_us(torch.ops.kvbuffer.fp8_quant_act, xs)
        torch_ops = _median_us(_torch_ops, xs)
        moved = M * K * 3 + 4 * M * K // 128  # x read, q and the scales written
        rows.append(f"M={M:6d} K={K}: fused {fused:8.2f} us ({moved / fused / 1e3:7.1f} GB/s), torch ops "
                    f"{torch_ops:8.2f} us, {torch_ops / fused:5.1f}x")
    with capsys.disabled():
        print(f"\n{torch.cuda.get_device_name()}: block-FP8 activation quantization, CUDA graph of 32 launches, "
              "median of 20 replays\n" + "\n".join(rows))


def test_timing_of_the_blockwise_gemm(capsys):
    from kvbuffer.models.quant.fp8 import _blockwise, quantize

    _blockwise_or_skip()
    M, N, K = 2048, 12288, 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, K, generator=gen, device="cuda") * K ** -0.5
    q, s = quantize(w, (128, 128))
    wb = w.bfloat16()
    xs = [_case(M, K, i, kind="normal") for i in range(8)]
    bf16 = _median_us(lambda x: x @ wb.t(), xs)
    fused = _median_us(lambda x: _blockwise(x, q, s, torch.bfloat16, fused=True), xs)
    torch_ops = _median_us(lambda x: _blockwise(x, q, s, torch.bfloat16, fused=False), xs)
    with capsys.disabled():
        print(f"\n{torch.cuda.get_device_name()}: {M} x {N} x {K}, bf16 {bf16:.1f} us; block FP8 with the fused "
              f"quantizer {fused:.1f} us ({bf16 / fused:.2f}x bf16), with the torch ops {torch_ops:.1f} us "
              f"({bf16 / torch_ops:.2f}x)")
