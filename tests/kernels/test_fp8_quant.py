"""The block-FP8 activation quantizer on the CPU: the template (tiles/fp8_quant.py `fp8_quant_act`) compiled
for sm_90a and run through tests/support/simt_emulator.py against kvbuffer.reference.fp8, bit for bit
(outputs poisoned first; awkward M; K of one group to 4096; rows of zeros, huge and tiny magnitudes,
NaN and inf); its parameter checks; the reference against the torch path it replaces; the kernel key,
spec and record shape; the custom op (CPU: the reference) and its fake; the launcher's refusals, each
before anything runs. The GPU tests are tests/gpu/test_fp8_quant.py.
"""

import importlib.util
import os
import shutil

import pytest
import torch

import kvbuffer.ops  # noqa: F401  (the documented entry point registers the ops)
from kvbuffer.reference import fp8 as ref_fp8

_BUILD = importlib.util.find_spec("tilelang") is not None and bool(
    shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")) and bool(shutil.which("g++"))

# what TileLang's FP8 stores and fp16 loads emit (tl_templates/cuda/cuda_fp8.h, cute's float_e4m3_t), for the
# emulator: float -> e4m3fn rounds to nearest even and saturates to +-448 (cvt.rn.satfinite), NaN -> 0x7F
FP8_PRELUDE = r"""
struct fp8_e4_t {
  uint8_t bits;
  fp8_e4_t() = default;
  explicit fp8_e4_t(float f) {
    uint8_t sign = std::signbit(f) ? 0x80 : 0;
    if (std::isnan(f)) { bits = 0x7F; return; }
    double a = std::fabs(double(f));
    if (a >= 448.0) { bits = sign | 0x7E; return; }
    int e; std::frexp(a, &e);                       // a = m 2^e, m in [0.5, 1): the leading bit is 2^(e - 1)
    int lead = a == 0 ? -6 : std::max(e - 1, -6);    // below 2^-6 the subnormals' step, 2^-9
    double step = std::ldexp(1.0, lead - 3);
    double r = std::nearbyint(a / step) * step;      // to nearest, ties to even (the default rounding mode)
    if (r >= 448.0) { bits = sign | 0x7E; return; }
    if (r == 0) { bits = sign; return; }
    std::frexp(r, &e);
    int E = e - 1;
    if (E < -6) { bits = sign | uint8_t(r / std::ldexp(1.0, -9)); return; }
    bits = sign | uint8_t((E + 7) << 3) | uint8_t(r / std::ldexp(1.0, E - 3) - 8);
  }
};
struct alignas(8) fp8_e4_8_t { fp8_e4_t v[8]; };
struct half_t {
  _Float16 v;
  half_t() = default;
  explicit half_t(float f) : v(f) {}
  explicit operator float() const { return float(v); }
};
static inline uint __pack_half2(half_t a, half_t b) {
  uint16_t lo, hi; std::memcpy(&lo, &a, 2); std::memcpy(&hi, &b, 2); return uint(lo) | (uint(hi) << 16);
}
"""


def _case(M, K, seed, dtype=torch.bfloat16, kind="normal"):
    """x (M, K): N(0, 1) with each row and group scaled by 10^U(-3, 3); kinds add rows of zeros, huge and
    tiny magnitudes (bf16 subnormals too), a lone value per group, and NaN / inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen)
    x *= 10 ** (6 * torch.rand(M, K // 128, 1, generator=gen) - 3).repeat_interleave(128, -1).view(M, K)
    if kind == "extremes":
        x[::3] = 0                                            # rows of zeros (the padded rows' case too)
        x[1::5] = (x[1::5] * 1e30).clamp(-6e4, 6e4) if dtype == torch.float16 else x[1::5] * 1e30  # huge
        x[2::7] *= 1e-38 if dtype == torch.bfloat16 else 1e-4  # tiny: bf16 subnormals, fp16 subnormals
        x[:, 5] = 0
        x[4::6, K - 128:] = 0
        x[4::6, K - 127] = -3.0                               # a lone value in its group: it maps to -448
    if kind == "nonfinite":
        x[0, 3], x[1, 200], x[2, 7] = float("nan"), float("inf"), -float("inf")
    return x.to(dtype)


def _emulate(monkeypatch, x, tunables):
    from kvbuffer.gpus import get_gpu
    from kvbuffer.tiles import fp8_quant

    from tests.support import simt_emulator

    monkeypatch.setattr(simt_emulator, "PRELUDE", simt_emulator.PRELUDE + FP8_PRELUDE)
    M, K = x.shape
    t = dict(fp8_quant.DEFAULT, **tunables)
    prim = fp8_quant.fp8_quant_act(K, dtype=str(x.dtype).removeprefix("torch."), **t)
    emu = simt_emulator.emulated(prim, get_gpu("h200").target)
    Mp = ref_fp8.padded_rows(M)
    q = torch.full((Mp, K), 0x7F, dtype=torch.uint8).view(ref_fp8.FP8)  # poisoned: NaN bytes
    scale = torch.full((K // 128, Mp), float("nan"))
    teams = t["threads"] // 16
    emu((-(-(K // 128) * Mp // teams), 1, 1), t["threads"], x=x, q=q, scale=scale, rows=M, padded_rows=Mp)
    return q, scale


def _assert_bit_identical(got, want):
    (q, scale), (q_ref, scale_ref) = got, want
    assert q.shape == q_ref.shape and scale.shape == scale_ref.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), scale_ref.view(torch.int32))


@pytest.mark.tilelang
@pytest.mark.slow
@pytest.mark.skipif(not _BUILD, reason="needs TileLang, nvcc and g++")
@pytest.mark.parametrize("M,K,kind,dtype,tunables", [
    (1, 128, "normal", torch.bfloat16, {}),                    # one group; three padded rows
    (3, 4096, "extremes", torch.bfloat16, {}),                # the 9B's hidden size
    (4, 256, "extremes", torch.bfloat16, dict(threads=64)),   # no padding
    (5, 2688, "normal", torch.bfloat16, dict(threads=128)),   # Nemotron's K: 21 groups, a partial block of teams
    (127, 384, "extremes", torch.float16, dict(threads=32)),  # fp16; one team past a warp's two
    (1000, 256, "normal", torch.bfloat16, dict(threads=1024)),
    (6, 256, "nonfinite", torch.bfloat16, {}),                # NaN makes its group's scale NaN; inf its q NaN
    # a group's rows on consecutive teams
    (5, 2688, "extremes", torch.bfloat16, dict(threads=128, order="rows")),
    (127, 384, "normal", torch.float16, dict(threads=32, order="rows")),
    (6, 256, "nonfinite", torch.bfloat16, dict(order="rows")),
], ids=["M1-K128", "M3-K4096", "M4-K256", "M5-K2688", "M127-fp16", "M1000", "nonfinite", "rows-M5-K2688",
        "rows-M127-fp16", "rows-nonfinite"])
def test_template_is_the_reference_bit_for_bit_emulated(monkeypatch, M, K, kind, dtype, tunables):
    x = _case(M, K, M + K, dtype, kind)
    got = _emulate(monkeypatch, x, tunables)
    want = ref_fp8.quantize_activations_padded(x)
    if kind == "nonfinite":  # NaN bytes compare by their NaN-ness: e4m3fn has two, the GPU writes 0x7F
        nan = want[0].view(torch.uint8) & 0x7F == 0x7F
        assert torch.equal(got[0].view(torch.uint8) & 0x7F == 0x7F, nan) and bool(nan.any())
        assert torch.equal(got[0].view(torch.uint8)[~nan], want[0].view(torch.uint8)[~nan])
        assert torch.equal(got[1].isnan(), want[1].isnan()) and bool(want[1].isnan().any())
        assert torch.equal(got[1].nan_to_num(), want[1].nan_to_num())
        return
    _assert_bit_identical(got, want)


@pytest.mark.parametrize("kwargs,message", [
    (dict(K=96), "multiple of 128"), (dict(K=200), "multiple of 128"), (dict(K=0), "multiple of 128"),
    (dict(K=256, dtype="float32"), "dtype"), (dict(K=256, threads=48), "threads"),
    (dict(K=256, threads=2048), "threads"), (dict(K=256, order="columns"), "order"),
])
def test_template_parameters_are_checked(kwargs, message):
    from kvbuffer.tiles.fp8_quant import check_fp8_quant_act

    with pytest.raises(ValueError, match=message):
        check_fp8_quant_act(**kwargs)


def test_configs_start_with_the_default():
    from kvbuffer.tiles.fp8_quant import DEFAULT, get_configs

    configs = get_configs()
    assert configs[0] == DEFAULT and len({tuple(sorted(c.items())) for c in configs}) == len(configs)


# ----------------------------------------------------------------------------------------------
# the reference, the key and spec, the op, the launcher, the tuner


def _torch_path(x):
    """What the block-wise GEMM ran before the op: rows padded to 4, quantized, scales copied column-major."""
    from kvbuffer.models.quant.fp8 import quantize_activations

    m = x.shape[0]
    xq, xs = quantize_activations(torch.nn.functional.pad(x, (0, 0, 0, -(-m // 4) * 4 - m)))
    return xq, xs.t().contiguous().t()


@pytest.mark.parametrize("M", [1, 3, 4, 5, 127, 1000])
@pytest.mark.parametrize("K", [128, 256, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_custom_op_is_the_reference_and_the_torch_path_on_cpu(M, K, dtype):
    x = _case(M, K, 7 * M + K, dtype, "extremes" if M > 2 else "normal")
    q, scale = torch.ops.kvbuffer.fp8_quant_act(x)
    assert q.dtype == ref_fp8.FP8 and scale.dtype == torch.float32
    assert q.shape == (ref_fp8.padded_rows(M), K) and scale.shape == (K // 128, ref_fp8.padded_rows(M))
    _assert_bit_identical((q, scale), ref_fp8.quantize_activations_padded(x))
    old_q, old_scale = _torch_path(x)
    _assert_bit_identical((q, scale.t()), (old_q, old_scale))
    if K > 128:  # _scaled_mm's scale_a layout (one group: a size-1 axis, whose stride torch leaves free)
        assert scale.t().stride() == old_scale.stride() == (1, ref_fp8.padded_rows(M))
    assert not bool(q.view(torch.uint8)[M:].any())  # the padded rows quantize zeros


def test_reference_is_the_definition_in_fp64():
    """Each group's scale is its amax / 448 (floored), each q the nearest e4m3 value of x / scale."""
    x = _case(6, 384, 3, torch.bfloat16, "extremes")
    q, scale = ref_fp8.quantize_activations(x)
    amax = x.double().view(6, 3, 128).abs().amax(-1).clamp(min=1e-12)
    assert torch.allclose(scale.double(), amax / 448, rtol=2 ** -23, atol=0)
    y = (x.double().view(6, 3, 128) / scale.double()[..., None]).view(6, 384)
    assert float((q.double() - y).abs().max()) <= float(y.abs().max()) * 2 ** -4  # half an e4m3 step at most
    assert float(q.double().abs().max()) == 448.0


@pytest.mark.parametrize("x,error,message", [
    (torch.zeros(4, 2696, dtype=torch.bfloat16), "ShapeError", "multiple of 128"),  # 2688 (21 groups) + 8
    (torch.zeros(4, 64, dtype=torch.bfloat16), "ShapeError", "multiple of 128"),
    (torch.zeros(4, 0, dtype=torch.bfloat16), "ShapeError", "multiple of 128"),
    (torch.zeros(2, 2, 128, dtype=torch.bfloat16), "ShapeError", "x must have shape"),
    (torch.zeros(4, 128, dtype=torch.float64), "DTypeError", "x must have dtype"),
    (torch.zeros(4, 128, dtype=torch.int32), "DTypeError", "x must have dtype"),
])
def test_custom_op_refuses_bad_calls(x, error, message):
    from kvbuffer import errors

    with pytest.raises(getattr(errors, error), match=message):
        torch.ops.kvbuffer.fp8_quant_act(x)


def test_zero_rows_quantize_to_nothing():
    q, scale = torch.ops.kvbuffer.fp8_quant_act(torch.zeros(0, 256, dtype=torch.bfloat16))
    assert q.shape == (0, 256) and scale.shape == (2, 0)


def test_key_names_its_spec_template_record_and_command():
    from kvbuffer.kernels import fp8_ops, specs
    from kvbuffer.kernels.keys import FP8_DTYPE, GEMV_FAMILIES, GemvDims, KernelKey, projection_shape

    key = fp8_ops.fp8_quant_key(4096, "bfloat16")
    assert key == KernelKey("gemv", "fp8_quant", GemvDims(4096, 4096, 1, 128), "bfloat16", w_dtype=FP8_DTYPE)
    spec = specs.spec_for(key)
    assert spec is specs.FP8_QUANT_ACT and spec.kind == "fp8_quant_act" and spec.args == ("x", "q", "scale")
    assert specs.tune_template(key) == "fp8_quant_act" and specs.layouts(key) == [(None, 0)]
    assert specs.record_shapes(key) == [projection_shape("fp8_quant", 4096, 4096, "bfloat16", (1, 128))] == [
        {"family": "fp8_quant", "N": 4096, "K": 4096, "dtype": "bfloat16", "bn": 1, "bk": 128}]
    assert "fp8_quant" in GEMV_FAMILIES  # kvbuffer tune builds it as a projection kernel: chunk-free, one size
    assert specs.tune_command(key) == "kvbuffer tune --gpu <gpu> --model <model>"
    assert spec.launch_params(key, {"threads": 128}) == dict(threads=128, K=4096, dtype="bfloat16")
    assert spec.custom_ops == ("fp8_quant_act",) and spec.reference is ref_fp8.quantize_activations_padded
    assert fp8_ops.fp8_quant_fits(4096, "float16") and fp8_ops.fp8_quant_fits(2688, "bfloat16")
    assert not fp8_ops.fp8_quant_fits(2696, "bfloat16") and not fp8_ops.fp8_quant_fits(64, "bfloat16")
    assert not fp8_ops.fp8_quant_fits(4096, "float32")


def test_op_is_registered_with_cpu_cuda_and_fake_kernels_and_writes_nothing():
    import kvbuffer.ops  # noqa: F401  (the documented entry point registers the ops)

    packet = torch.ops.kvbuffer.fp8_quant_act
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(packet.default.name(), key), key
    assert not [a for a in packet.default._schema.arguments if a.alias_info and a.alias_info.is_write]


def test_fake_has_the_output_shapes_and_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kvbuffer.errors import ShapeError

    with FakeTensorMode():
        q, scale = torch.ops.kvbuffer.fp8_quant_act(torch.empty(5, 384, dtype=torch.bfloat16))
        assert q.shape == (8, 384) and q.dtype == ref_fp8.FP8 and scale.shape == (3, 8)
        with pytest.raises(ShapeError, match="multiple of 128"):
            torch.ops.kvbuffer.fp8_quant_act(torch.empty(5, 200, dtype=torch.bfloat16))


def test_compiled_caller_runs_the_op():
    """One graph, and row counts that change (the fake pads a symbolic count)."""
    def quantize(x):
        q, scale = torch.ops.kvbuffer.fp8_quant_act(x * 2)
        return q.float(), scale

    compiled = torch.compile(quantize, backend="eager", fullgraph=True, dynamic=True)
    for M in (5, 9, 12):
        x = _case(M, 256, 11)
        got, want = compiled(x), quantize(x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _op(K=256, dtype="bfloat16", launched=None):
    from kvbuffer.kernels import CompiledOp

    return CompiledOp(lambda *a: launched.append(a) if launched is not None else None, "fp8_quant_act",
                      dict(K=K, dtype=dtype, threads=256))


def _launcher_refusals():
    x = _case(5, 256, 1)
    return {
        "x-dtype": (dict(x=x.half()), "DTypeError", "x must have dtype in \\(bfloat16\\)"),
        "x-columns": (dict(x=x[:, :128].contiguous()), "ShapeError", "x must have shape \\(\\*, 256\\)"),
        "x-strided": (dict(x=_case(5, 512, 1)[:, ::2]), "ShapeError", "x must be contiguous"),
        "q-rows": (dict(q=torch.empty(5, 256, dtype=ref_fp8.FP8)), "ShapeError", "q must have shape \\(8, 256\\)"),
        "q-dtype": (dict(q=torch.empty(8, 256, dtype=torch.uint8)), "DTypeError", "q must have dtype"),
        "scale-layout": (dict(scale=torch.empty(8, 2)), "ShapeError", "scale must have shape \\(2, 8\\)"),
        "scale-dtype": (dict(scale=torch.empty(2, 8, dtype=torch.float64)), "DTypeError", "scale must have dtype"),
        "scale-strided": (dict(scale=torch.empty(8, 2).t()), "ShapeError", "scale must be contiguous"),
        "scale-device": (dict(scale=torch.empty(2, 8, device="meta")), "DeviceError", "scale is on meta"),
    }


REFUSALS = _launcher_refusals()


@pytest.mark.parametrize("name", REFUSALS)
def test_launcher_refuses_before_the_launch(monkeypatch, name):
    """Every tensor checked (the device check for CUDA stubbed so that CPU tensors reach the others),
    and nothing launched."""
    from kvbuffer import errors
    from kvbuffer.kernels import fp8_ops

    monkeypatch.setattr(fp8_ops, "check_on_cuda", lambda name, dev: None)
    call, error, message = REFUSALS[name]
    launched = []
    with pytest.raises(getattr(errors, error), match=message):
        fp8_ops.run_fp8_quant_act(_op(launched=launched), **dict(dict(x=_case(5, 256, 1)), **call))
    assert not launched
    q, scale = fp8_ops.run_fp8_quant_act(_op(launched=launched), _case(5, 256, 1))
    assert len(launched) == 1 and q.shape == (8, 256) and scale.shape == (2, 8)
    assert launched[0][1] is q and launched[0][2] is scale


def test_launcher_refuses_cpu_tensors_and_another_kernel():
    from kvbuffer.errors import DeviceError
    from kvbuffer.kernels import CompiledOp, fp8_ops

    with pytest.raises(DeviceError, match="run on CUDA tensors; x is on cpu"):
        fp8_ops.run_fp8_quant_act(_op(), _case(5, 256, 1))
    with pytest.raises(TypeError, match="expected a compiled 'fp8_quant_act' kernel"):
        fp8_ops.run_fp8_quant_act(CompiledOp(lambda *a: None, "fp8_gemv", {}), _case(5, 256, 1))


def test_without_a_kernel_the_cuda_op_runs_the_reference_and_says_why_once(monkeypatch, caplog):
    """No artifact, no JIT, and the first-use build refused: the torch ops, one log line per shape; a
    kernel that loads is launched instead."""
    from kvbuffer.errors import ArtifactError
    from kvbuffer.kernels import autobuild, fp8_ops, lookup

    def missing(key, batch=1):
        raise ArtifactError("no compiled fp8_quant_act kernel")

    built = []
    monkeypatch.setattr(fp8_ops, "_NO_KERNEL", set())
    monkeypatch.setattr(lookup, "kernel_for", missing)
    monkeypatch.setattr(lookup, "jit_allowed", lambda: False)
    monkeypatch.setattr(autobuild, "ensure_gemv_kernels", lambda keys: built.append(keys) or "no TileLang here")
    x = _case(5, 256, 2)
    with caplog.at_level("INFO", logger="kvbuffer"):
        for _ in range(3):
            _assert_bit_identical(fp8_ops._quant_cuda(x), ref_fp8.quantize_activations_padded(x))
        fp8_ops._quant_cuda(x.float())  # fp32: the kernel does not take it
    assert built == [[fp8_ops.fp8_quant_key(256, "bfloat16")]]
    lines = [r.getMessage() for r in caplog.records if "quantized with torch ops" in r.getMessage()]
    assert len(lines) == 2 and "no TileLang here" in lines[0] and "float32" in lines[1]

    launched = []
    monkeypatch.setattr(fp8_ops, "_NO_KERNEL", set())
    monkeypatch.setattr(lookup, "kernel_for", lambda key, batch=1: _op(launched=launched))
    monkeypatch.setattr(fp8_ops, "check_on_cuda", lambda name, dev: None)
    monkeypatch.setattr(fp8_ops, "on_torch_stream", lambda fn, *a: fn(*a))
    q, scale = fp8_ops._quant_cuda(x)
    assert len(launched) == 1 and launched[0][0] is x and q.shape == (8, 256) and scale.shape == (2, 8)


@pytest.mark.parametrize("M", [0, 1, 5, 64])
def test_the_engines_unchecked_launch_gives_the_checked_launchs_outputs(monkeypatch, M):
    """launch_quant(checked=False) (a projection's quantizer) allocates and launches as run_fp8_quant_act
    does, without its checks: same shapes, dtypes and kernel arguments; nothing launched for no rows."""
    from kvbuffer.kernels import fp8_ops, lookup

    monkeypatch.setattr(fp8_ops, "_NO_KERNEL", set())
    monkeypatch.setattr(fp8_ops, "check_on_cuda", lambda name, dev: None)
    monkeypatch.setattr(fp8_ops, "on_torch_stream", lambda fn, *a: fn(*a))
    x = _case(M, 256, 3)
    results = []
    for checked in (True, False):
        launched = []
        monkeypatch.setattr(lookup, "kernel_for", lambda key, batch=1: _op(launched=launched))
        q, scale = fp8_ops.launch_quant(x, checked=checked)
        assert [a[0] for a in launched] == ([x] if M else []) and all(a[1] is q and a[2] is scale for a in launched)
        results.append([(t.shape, t.dtype, t.device, t.is_contiguous()) for t in (q, scale)])
    assert results[0] == results[1]


def test_a_gpu_without_a_target_falls_back_too(monkeypatch, caplog):
    from kvbuffer.errors import DeviceError
    from kvbuffer.kernels import fp8_ops, lookup

    def no_target(key, batch=1):
        raise DeviceError("compute capability 7.5 has no TileLang target here")

    monkeypatch.setattr(fp8_ops, "_NO_KERNEL", set())
    monkeypatch.setattr(lookup, "kernel_for", no_target)
    x = _case(3, 128, 5)
    with caplog.at_level("INFO", logger="kvbuffer"):
        _assert_bit_identical(fp8_ops._quant_cuda(x), ref_fp8.quantize_activations_padded(x))
    assert fp8_ops.quant_kernel(x) is None and "capability 7.5" in caplog.text


def test_blockwise_gemm_takes_the_ops_outputs(monkeypatch):
    """_blockwise hands _scaled_mm the op's q and the transpose of its scales (column-major, 4-row padded),
    and returns the first M rows; the device probe quantizes with the torch ops alone."""
    from kvbuffer.models.quant import fp8

    calls = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        calls.append((a, b, scale_a, scale_b))
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    x = _case(5, 256, 4)
    q, s = fp8.quantize(torch.randn(384, 256), (128, 128))
    for fused in (True, False):
        y = fp8._blockwise(x, q, s, torch.bfloat16, fused=fused)
        a, b, scale_a, scale_b = calls[-1]
        want_q, want_scale = ref_fp8.quantize_activations_padded(x)
        assert y.shape == (5, 384) and torch.equal(a.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scale_a, want_scale.t()) and scale_a.stride() == (1, 8)
        assert b.shape == (256, 384) and torch.equal(scale_b, s.t())


@pytest.mark.tilelang
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="needs TileLang")
def test_tuner_jit_and_build_trace_the_same_function(monkeypatch):
    """`kvbuffer tune`'s template, the JIT and build_fp8_quant_act build one TileLang function (compiling
    stubbed), and the template's inputs are the spec's arguments with reference outputs."""
    import kvbuffer.tiles as tiles
    from kvbuffer.autotune import tuner
    from kvbuffer.kernels.fp8_ops import TIMED_ROWS
    from kvbuffer.autotune.registry import templates
    from kvbuffer.kernels import fp8_ops, lookup, specs
    from kvbuffer.kernels.keys import projection_shape

    monkeypatch.setattr(tiles, "compile_template", lambda prim, target: prim)
    monkeypatch.setattr(specs, "local_target", lambda: {"kind": "cuda", "arch": "sm_90a"})
    shape = projection_shape("fp8_quant", 384, 384, "bfloat16", (1, 128))
    (tpl, chunk, drafts), = tuner.plan(templates("fp8_quant"), shape, (8,), (0, 2))
    assert tpl.name == "fp8_quant_act" and tpl.defaults_for(shape) == specs.FP8_QUANT_ACT.defaults(None)
    assert tpl.tolerance == 0
    tuned = tpl.compile(shape, chunk, drafts, target={}, **tpl.defaults_for(shape))
    key = fp8_ops.fp8_quant_key(384, "bfloat16")
    assert tuned.script() == lookup.jit(key).fn.script() == fp8_ops.build_fp8_quant_act(384).fn.script()
    args = tpl.named(tpl.inputs(shape, 1, 8, "cpu", torch.Generator().manual_seed(0)))
    assert args["x"].shape == (TIMED_ROWS, 384) and bool(args["scale"].isnan().all())
    want = tpl.reference(shape, 8, args)
    assert want["q"].shape == (TIMED_ROWS, 384) and want["scale"].shape == (3, TIMED_ROWS)
    assert tuner.rel_err(want["q"], want["q"]) == 0 == tuner.rel_err(want["scale"], want["scale"])


def test_tune_shapes_of_fp8_models():
    """A block-FP8 model's quantizer shapes: each K of its block-scaled projections, bf16 only; none for a
    ModelOpt (per-tensor) one."""
    from kvbuffer.autotune import models

    qwen = [s for s in models.preset_gemv_shapes("qwen3.5-9b", fp8=True) if s["family"] == "fp8_quant"]
    assert [(s["N"], s["K"], s["bn"], s["bk"]) for s in qwen] == [(4096, 4096, 1, 128), (12288, 12288, 1, 128)]
    assert not [s for s in models.preset_gemv_shapes("qwen3.5-9b") if s["family"] == "fp8_quant"]
    assert not [s for s in models.preset_gemv_shapes("qwen3.5-9b", "float16", fp8=True) if s["family"] == "fp8_quant"]
    assert not [s for s in models.preset_gemv_shapes("nemotron-3-nano", fp8=True) if s["family"] == "fp8_quant"]
    cfg = models.presets.get("qwen3.5-9b").hf_config()
    odd = {**cfg, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}
    assert not [s for s in models.config_gemv_shapes(odd) if s["family"] == "fp8_quant"]
