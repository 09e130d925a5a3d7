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
        x[4::6, 130:] = 0
        x[4::6, 129] = -3.0                                   # a lone value in its group: it maps to -448
    if kind == "nonfinite":
        x[0, 3], x[1, 200], x[2, 7] = float("nan"), float("inf"), -float("inf")
    return x.to(dtype)


def _emulate(monkeypatch, x, tunables):
    from kvbuffer.gpus import get_gpu
    from kvbuffer.tiles import compile_template, fp8_quant

    from tests.support import simt_emulator

    monkeypatch.setattr(simt_emulator, "PRELUDE", simt_emulator.PRELUDE + FP8_PRELUDE)
    M, K = x.shape
    t = dict(fp8_quant.DEFAULT, **tunables)
    prim = fp8_quant.fp8_quant_act(K, dtype=str(x.dtype).removeprefix("torch."), **t)
    emu = simt_emulator.Emulated(compile_template(prim, get_gpu("h200").target).get_kernel_source())
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
], ids=["M1-K128", "M3-K4096", "M4-K256", "M5-K2688", "M127-fp16", "M1000", "nonfinite"])
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
    (dict(K=256, threads=2048), "threads"),
])
def test_template_parameters_are_checked(kwargs, message):
    from kvbuffer.tiles.fp8_quant import check_fp8_quant_act

    with pytest.raises(ValueError, match=message):
        check_fp8_quant_act(**kwargs)


def test_configs_start_with_the_default():
    from kvbuffer.tiles.fp8_quant import DEFAULT, get_configs

    configs = get_configs()
    assert configs[0] == DEFAULT and len({tuple(sorted(c.items())) for c in configs}) == len(configs)
