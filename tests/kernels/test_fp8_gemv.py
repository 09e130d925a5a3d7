"""The FP8 one-row projection on the CPU: the template (tiles/gemv.py `fp8_gemv`) compiled for sm_90a and
run through tests/support/simt_emulator.py against the dequantized product in fp64 (outputs NaN-poisoned;
awkward N, K and rows; block FP8 (128, 128), one scale per row (1, K) and an odd block); its parameter
checks; the kernel key, spec and record shape; the custom op (CPU: the reference) and its fake; the
launcher's refusals, each before anything runs. The GPU tests are tests/gpu/test_fp8_gemv.py.
"""

import importlib.util
import os
import shutil

import pytest
import torch

from kvbuffer.errors import DeviceError, DTypeError, ShapeError
from kvbuffer.kernels import CompiledOp, fp8_gemv, launch, specs
from kvbuffer.kernels.keys import FP8_DTYPE, GemvDims, KernelKey, fp8_gemv_fits, projection_shape
from kvbuffer.reference import fp8 as ref_fp8

_BUILD = importlib.util.find_spec("tilelang") is not None and bool(
    shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")) and bool(shutil.which("g++"))

# what TileLang's FP8 loads and conversions emit (tl_templates/cuda/cuda_fp8.h), for the emulator
FP8_PRELUDE = r"""
struct fp8_e4_t {
  uint8_t bits;
  explicit operator float() const {  // e4m3fn: bias 7, no infinity, S.1111.111 is NaN
    int e = (bits >> 3) & 15, m = bits & 7;
    float v = (e == 15 && m == 7) ? NAN : e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
    return (bits & 0x80) ? -v : v;
  }
};
struct alignas(2) fp8_e4_2_t { fp8_e4_t v[2]; };
struct alignas(4) fp8_e4_4_t { fp8_e4_t v[4]; };
struct alignas(8) fp8_e4_8_t { fp8_e4_t v[8]; };
struct alignas(16) fp8_e4_16_t { fp8_e4_t v[16]; };
"""


def _fp8_case(N, K, rows, block, seed, dtype=torch.bfloat16):
    """x ~ N(0, 1); q spread over e4m3's range (subnormals to 448); scales ~ 1 / (16 sqrt(K))."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    q = (torch.randn(N, K, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = ref_fp8.scale_grid(N, K, block)
    scale = (0.5 + torch.rand(grid, generator=gen)) / (16 * K ** 0.5)
    return x, q, scale


def _fp64(x, q, scale, block):
    return x.double() @ ref_fp8.dequantize(q, scale, block).double().T


@pytest.mark.tilelang
@pytest.mark.slow
@pytest.mark.skipif(not _BUILD, reason="needs TileLang, nvcc and g++")
@pytest.mark.parametrize("N,K,rows,block,tunables", [
    (37, 2688, 1, (128, 128), {}),                                        # Nemotron's K: a ragged pass
    (300, 1040, 3, (128, 128), dict(per_warp=1, threads=64, unroll=2)),   # partial blocks both ways, two passes
    (50, 720, 2, (1, 720), dict(per_warp=4, threads=64, unroll=16)),      # a scale per row; N not a block's multiple
    (20, 256, 8, (1, 256), {}),                                           # eight rows
    (130, 384, 1, (64, 32), dict(per_warp=2, threads=32, unroll=4)),      # a small odd block
    (70, 192, 2, (3, 32), dict(per_warp=4, threads=64, unroll=2)),        # a warp's rows across block rows
], ids=["block-ragged", "block-partial", "per-row", "rows8", "block64x32", "block3x32"])
def test_template_matches_fp64_emulated(monkeypatch, N, K, rows, block, tunables):
    from kvbuffer.gpus import get_gpu
    from kvbuffer.tiles import gemv

    from tests.support import simt_emulator

    monkeypatch.setattr(simt_emulator, "PRELUDE", simt_emulator.PRELUDE + FP8_PRELUDE)
    t = dict(gemv.FP8_DEFAULT, **tunables)
    prim = gemv.fp8_gemv(N, K, rows, bn=block[0], bk=block[1], **t)
    emu = simt_emulator.emulated(prim, get_gpu("h200").target)
    x, q, scale = _fp8_case(N, K, rows, block, N + K + rows)
    y = torch.full((rows, N), float("nan")).to(torch.bfloat16)
    per_block = t["threads"] // 32 * t["per_warp"]
    emu((-(-N // per_block), 1, 1), t["threads"], x=x, q=q, scale=scale, y=y)
    ref = _fp64(x, q, scale, block)
    assert bool(torch.isfinite(y).all())
    assert float((y.double() - ref).norm() / ref.norm()) < 4e-3
    # the dequantized model's product (fp32, rounded once) up to the summation order: within a rounding
    want = ref_fp8.linear(x, q, scale, block).double()
    assert float((y.double() - want).abs().max()) <= float(2 ** -7 * ref.abs().max())


@pytest.mark.parametrize("kwargs,message", [
    (dict(N=8, K=24, bn=128, bk=128), "multiple of 16"), (dict(N=8, K=32, bn=0, bk=32), "bn >= 1"),
    (dict(N=8, K=32, bn=1, bk=24), "bk a positive multiple of 16"), (dict(N=8, K=32, bn=1, bk=8), "bk"),
    (dict(N=8, K=32, bn=1, bk=32, rows=9), "rows must be"), (dict(N=8, K=32, bn=1, bk=32, dtype="float32"), "dtype"),
    (dict(N=8, K=32, bn=1, bk=32, threads=48), "threads"),
])
def test_template_parameters_are_checked(kwargs, message):
    from kvbuffer.tiles.gemv import check_fp8_gemv

    with pytest.raises(ValueError, match=message):
        check_fp8_gemv(**kwargs)


def test_configs_start_with_the_default():
    from kvbuffer.tiles.gemv import FP8_DEFAULT, get_fp8_configs

    configs = get_fp8_configs()
    assert configs[0] == FP8_DEFAULT and len({tuple(sorted(c.items())) for c in configs}) == len(configs)


def test_fits():
    assert fp8_gemv_fits(4096, (128, 128), "bfloat16") and fp8_gemv_fits(2688, (1, 2688), "float16")
    assert not fp8_gemv_fits(4104, (128, 128), "bfloat16")      # K not whole 16-byte chunks
    assert not fp8_gemv_fits(4096, (128, 120), "bfloat16")      # a chunk across two scale blocks
    assert not fp8_gemv_fits(4096, (128, 128), "float32")


def test_key_names_its_spec_template_record_and_command():
    q = torch.zeros(300, 1024, dtype=torch.float8_e4m3fn)
    key = launch.fp8_gemv_key(q, 128, 128, "bfloat16")
    assert key == KernelKey("gemv", "fp8_gemv", GemvDims(300, 1024, 128, 128), "bfloat16", w_dtype=FP8_DTYPE)
    spec = specs.spec_for(key)
    assert spec is specs.FP8_GEMV and spec.kind == "fp8_gemv" and spec.args == ("x", "q", "scale", "out")
    assert specs.tune_template(key) == "fp8_gemv" and specs.layouts(key) == [(None, 0)]
    assert specs.record_shapes(key) == [projection_shape("fp8_gemv", 300, 1024, "bfloat16", (128, 128))] == [
        {"family": "fp8_gemv", "N": 300, "K": 1024, "dtype": "bfloat16", "bn": 128, "bk": 128}]
    assert specs.tune_command(key) == "kvbuffer tune --gpu <gpu> --model <model>"
    assert spec.launch_params(key, {"threads": 64}) == dict(threads=64, N=300, K=1024, rows=1, bn=128, bk=128,
                                                            dtype="bfloat16")
    assert specs.tune_template(launch.fp8_gemv_key(q, 128, 128, "bfloat16", rows=2)) is None  # tune builds one row
    x, q, scale = _fp8_case(5, 64, 2, (1, 64), 0)
    assert torch.equal(spec.reference(x, q, scale, 1, 64), ref_fp8.linear(x, q, scale, (1, 64)))


def test_op_is_registered_with_cpu_cuda_and_fake_kernels_and_writes_nothing():
    import kvbuffer.ops  # noqa: F401  (the documented entry point registers the ops)

    packet = torch.ops.kvbuffer.fp8_gemv
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(packet.default.name(), key), key
    assert not [a for a in packet.default._schema.arguments if a.alias_info and a.alias_info.is_write]
    assert launch.CUDA_LAUNCHES["fp8_gemv"] is launch.fp8_gemv and launch.FP8_GEMV.launch is launch.fp8_gemv


def test_engine_op_runs_the_reference_off_cuda():
    x, q, scale = _fp8_case(24, 64, 1, (1, 64), 6)
    assert torch.equal(launch.FP8_GEMV(x, q, scale, 1, 64), ref_fp8.linear(x, q, scale, (1, 64)))


@pytest.mark.parametrize("block", [(128, 128), (1, 160), (3, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_custom_op_is_the_reference_on_cpu(block, dtype):
    x, q, scale = _fp8_case(40, 160, 2, block, 1, dtype)
    got = torch.ops.kvbuffer.fp8_gemv(x, q, scale, *block)
    assert got.dtype == dtype and got.shape == (2, 40)
    assert torch.equal(got, ref_fp8.linear(x, q, scale, block))
    ref = _fp64(x, q, scale, block)
    assert float((got.double() - ref).norm() / ref.norm()) < {torch.float32: 1e-6}.get(dtype, 4e-3)


def test_fake_has_the_output_shape_and_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, q = torch.empty(3, 256, dtype=torch.bfloat16), torch.empty(130, 256, dtype=torch.float8_e4m3fn)
        assert torch.ops.kvbuffer.fp8_gemv(x, q, torch.empty(2, 2), 128, 128).shape == (3, 130)
        with pytest.raises(ShapeError, match="scale must have shape"):
            torch.ops.kvbuffer.fp8_gemv(x, q, torch.empty(1, 2), 128, 128)


def _bad_op_calls():
    x, q, scale = _fp8_case(40, 160, 1, (128, 128), 2)
    return [
        ((x, q, scale[:, :1], 128, 128), ShapeError, "scale must have shape \\(1, 2\\)"),
        ((x, q, scale.double(), 128, 128), DTypeError, "scale must have dtype"),
        ((x, q.view(torch.uint8), scale, 128, 128), DTypeError, "q must have dtype"),
        ((x[:, :144], q, scale, 128, 128), ShapeError, "q must have shape \\(\\*, 144\\)"),
        ((x, q, scale, 0, 128), ShapeError, "block"),
        ((x[0], q, scale, 128, 128), ShapeError, "x must have shape"),
        ((x, q, scale.to("meta"), 128, 128), DeviceError, "every tensor"),
    ]


@pytest.mark.parametrize("args,error,message", _bad_op_calls())
def test_custom_op_refuses_bad_calls(args, error, message):
    with pytest.raises(error, match=message):
        torch.ops.kvbuffer.fp8_gemv(*args)


def _launcher_refusals():
    x, q, scale = _fp8_case(40, 160, 1, (128, 128), 3)
    wide = _fp8_case(40, 320, 1, (128, 128), 3)
    return {
        "x-dtype": (dict(x=x.half()), DTypeError, "x must have dtype in \\(bfloat16\\)"),
        "x-rows": (dict(x=torch.cat([x, x])), ShapeError, "x must have shape \\(1, 160\\)"),
        "q-dtype": (dict(q=q.view(torch.int8)), DTypeError, "q must have dtype in \\(float8_e4m3fn\\)"),
        "q-shape": (dict(q=q[:39]), ShapeError, "q must have shape \\(40, 160\\)"),
        "scale-grid": (dict(scale=scale.T.contiguous()), ShapeError, "scale must have shape \\(1, 2\\)"),
        "scale-dtype": (dict(scale=scale.half()), DTypeError, "scale must have dtype in \\(float32\\)"),
        "scale-device": (dict(scale=scale.to("meta")), DeviceError, "scale is on meta"),
        "x-strided": (dict(x=wide[0][:, ::2]), ShapeError, "x must be contiguous"),
        "q-strided": (dict(q=wide[1][:, ::2]), ShapeError, "q must be contiguous"),
        "scale-strided": (dict(scale=_fp8_case(40, 320, 1, (128, 128), 3)[2][:, ::2]), ShapeError,
                          "scale must be contiguous"),
        "out-shape": (dict(out=torch.empty(1, 41, dtype=torch.bfloat16)), ShapeError, "out must have shape"),
        "out-dtype": (dict(out=torch.empty(1, 40)), DTypeError, "out must have dtype"),
    }


REFUSALS = _launcher_refusals()


@pytest.mark.parametrize("name", REFUSALS)
def test_launcher_refuses_before_the_launch(monkeypatch, name):
    """Every tensor checked (the device check for CUDA stubbed so that CPU tensors reach the others),
    and nothing launched."""
    import importlib

    monkeypatch.setattr(importlib.import_module("kvbuffer.kernels.fp8_ops"), "check_on_cuda", lambda name, dev: None)
    x, q, scale = _fp8_case(40, 160, 1, (128, 128), 3)
    call, error, message = REFUSALS[name]
    launched = []
    op = CompiledOp(lambda *a: launched.append(a), "fp8_gemv", dict(N=40, K=160, rows=1, bn=128, bk=128,
                                                                    dtype="bfloat16"))
    with pytest.raises(error, match=message):
        fp8_gemv(op, **dict(dict(x=x, q=q, scale=scale), **call))
    assert not launched
    fp8_gemv(op, x, q, scale)
    assert len(launched) == 1 and launched[0][3].shape == (1, 40)


def test_launcher_refuses_cpu_tensors_and_another_kernel():
    x, q, scale = _fp8_case(40, 160, 1, (128, 128), 4)
    op = CompiledOp(lambda *a: None, "fp8_gemv", dict(N=40, K=160, rows=1, bn=128, bk=128, dtype="bfloat16"))
    with pytest.raises(DeviceError, match="run on CUDA tensors; x is on cpu"):
        fp8_gemv(op, x, q, scale)
    with pytest.raises(TypeError, match="expected a compiled 'fp8_gemv' kernel"):
        fp8_gemv(CompiledOp(lambda *a: None, "gemv", {}), x, q, scale)


@pytest.mark.tilelang
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="needs TileLang")
def test_tuner_jit_and_build_trace_the_same_function(monkeypatch):
    """`kvbuffer tune`'s template, the JIT and build_fp8_gemv build one TileLang function (compiling
    stubbed), and the template's inputs are the spec's arguments with a reference output."""
    import kvbuffer.tiles as tiles
    from kvbuffer.autotune import tuner
    from kvbuffer.autotune.registry import templates
    from kvbuffer.kernels import build_fp8_gemv, lookup

    monkeypatch.setattr(tiles, "compile_template", lambda prim, target: prim)
    monkeypatch.setattr(specs, "local_target", lambda: {"kind": "cuda", "arch": "sm_90a"})
    shape = projection_shape("fp8_gemv", 72, 160, "bfloat16", (128, 128))
    (tpl, chunk, drafts), = tuner.plan(templates("fp8_gemv"), shape, (8,), (0, 2))
    assert tpl.name == "fp8_gemv" and tpl.defaults_for(shape) == specs.FP8_GEMV.defaults(None)
    tuned = tpl.compile(shape, chunk, drafts, target={}, **tpl.defaults_for(shape))
    key = launch.fp8_gemv_key(torch.empty(72, 160), 128, 128, "bfloat16")
    assert tuned.script() == lookup.jit(key).fn.script() == build_fp8_gemv(72, 160, (128, 128)).fn.script()
    args = tpl.named(tpl.inputs(shape, 1, 8, "cpu", torch.Generator().manual_seed(0)))
    want = tpl.reference(shape, 8, args)["out"]
    assert want.shape == (1, 72) and torch.allclose(want, _fp64(args["x"], args["q"], args["scale"], (128, 128)))


def test_tune_shapes_of_fp8_models():
    """A preset with fp8 gets its family's format (Qwen: 128 x 128 blocks; Nemotron: a scale per row);
    a checkpoint's config.json or hf_quant_config.json decides for itself."""
    from kvbuffer.autotune import models

    plain = models.preset_gemv_shapes("qwen3.5-9b")
    qwen = models.preset_gemv_shapes("qwen3.5-9b", fp8=True)
    fp8 = [s for s in qwen if s["family"] == "fp8_gemv"]
    assert all((s["bn"], s["bk"]) == (128, 128) for s in fp8)
    # in_proj: q, k, v and z in FP8 (12288 rows), b and a kept in bf16 (64 rows), as the engine holds them;
    # the LM head stays bf16
    kept = {(12352, 4096), (248320, 4096)}
    assert {(s["N"], s["K"]) for s in fp8} == {(s["N"], s["K"]) for s in plain} - kept | {(12288, 4096)}
    assert [(s["N"], s["K"]) for s in qwen if s["family"] == "gemv"] == [(64, 4096), (248320, 4096)]
    nemotron = [s for s in models.preset_gemv_shapes("nemotron-3-nano", fp8=True) if s["family"] == "fp8_gemv"]
    assert nemotron and all((s["bn"], s["bk"]) == (1, s["K"]) for s in nemotron)
    cfg = models.presets.get("qwen3.5-9b").hf_config()
    block = {**cfg, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}
    assert {(s["bn"], s["bk"]) for s in models.config_gemv_shapes(block) if s["family"] == "fp8_gemv"} == {(128, 64)}
    assert models.config_fp8_format(cfg) is None
    assert models.config_fp8_format(cfg, {"quantization": {"quant_algo": "FP8"}}) == models.FP8_ROW
    assert models.config_fp8_format({**cfg, "quantization_config": {"quant_method": "gptq"}}) is None


def test_tune_plans_the_projection_kernels_the_engine_looks_up(tmp_path):
    """`kvbuffer tune` on a block-FP8 checkpoint plans exactly the projection kernels the engine asks for
    (the keys computed as kvbuffer.engine.one_row does, without CUDA): the FP8 group of in_proj's q, k,
    v, z, the bf16 Linear of its b, a, never the bf16 model's packed in_proj."""
    from kvbuffer.autotune import models
    from kvbuffer.kernels.keys import dtype_name, gemv_fits
    from kvbuffer.models.layers import one_row_linears
    from kvbuffer.models.loader import load_checkpoint
    from kvbuffer.models.quant.config import BLOCK
    from kvbuffer.models.quant.linear import FP8Linear
    from kvbuffer.models.quant.write import write_checkpoint
    from tests.support.tiny_models import CONFIGS, tiny_model

    cfg = dict(CONFIGS["qwen3_5"], torch_dtype="bfloat16")
    path = write_checkpoint(tiny_model("qwen3_5").to(torch.bfloat16), cfg, tmp_path / "ckpt", BLOCK, block=(16, 16))
    model = load_checkpoint(path, dtype=torch.bfloat16)
    engine = {launch.gemv_key(m.weight) for m in one_row_linears(model)
              if gemv_fits(m.weight.shape[-1], dtype_name(m.weight))}
    engine |= {launch.fp8_gemv_key(m.weight, *m.block, "bfloat16") for m in model.modules()
               if isinstance(m, FP8Linear) and m.bias is None and fp8_gemv_fits(m.in_features, m.block, "bfloat16")}
    shapes = models.checkpoint_gemv_shapes(path)
    planned = {KernelKey("gemv", "gemv", GemvDims(s["N"], s["K"]), s["dtype"]) for s in shapes if s["family"] == "gemv"}
    planned |= {KernelKey("gemv", "fp8_gemv", GemvDims(s["N"], s["K"], s["bn"], s["bk"]), s["dtype"], w_dtype=FP8_DTYPE)
                for s in shapes if s["family"] == "fp8_gemv"}
    assert planned == engine
    qkvz = 2 * 2 * 32 + 2 * 4 * 32  # q, k, v and z rows
    assert GemvDims(qkvz, 64, 16, 16) in {k.dims for k in planned} and GemvDims(8, 64) in {k.dims for k in planned}
    assert not {k for k in planned if k.dims.N == qkvz + 8}  # the bf16 model's whole in_proj
