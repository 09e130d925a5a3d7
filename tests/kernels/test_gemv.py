"""The one-row projection on the CPU: the template (tiles/gemv.py) lowered for sm_90a and run through
tests/support/simt_emulator.py against the product in fp64 (outputs NaN-poisoned; awkward N and K);
its parameter checks; the kernel key; the custom op (CPU: F.linear) and its fake; the models' routing
(`project`, `one_row_linears`) and the engine switch off CUDA. The GPU tests are tests/gpu/test_gemv.py.
"""

import importlib.util
import os
import shutil

import pytest
import torch

from kvbuffer.kernels import launch, specs
from kvbuffer.kernels.keys import GemvDims, KernelKey
from kvbuffer.kernels.specs import spec_for

_BUILD = importlib.util.find_spec("tilelang") is not None and bool(
    shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")) and bool(shutil.which("g++"))


@pytest.mark.tilelang
@pytest.mark.slow
@pytest.mark.skipif(not _BUILD, reason="needs TileLang, nvcc and g++")
@pytest.mark.parametrize("N,K,rows,tunables", [
    (37, 2688, 1, {}),                                           # Nemotron's K: the last pass is ragged
    (64, 512, 2, dict(per_warp=1, threads=64, unroll=4)),        # two rows, two passes
    (50, 72, 1, dict(per_warp=4, threads=64, unroll=16)),        # N not a multiple of a block's 8 columns
])
def test_template_matches_fp64_emulated(N, K, rows, tunables):
    from kvbuffer.gpus import get_gpu
    from kvbuffer.tiles import gemv

    from tests.support.simt_emulator import emulated

    t = dict(gemv.DEFAULT, **tunables)
    emu = emulated(gemv.gemv(N, K, rows, **t), get_gpu("h200").target)
    gen = torch.Generator().manual_seed(N + K)
    x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(torch.bfloat16)
    y = torch.full((rows, N), float("nan")).to(torch.bfloat16)
    per_block = t["threads"] // 32 * t["per_warp"]
    emu((-(-N // per_block), 1, 1), t["threads"], x=x, weight=w, y=y)
    ref = x.double() @ w.double().T
    assert bool(torch.isfinite(y).all())
    assert float((y.double() - ref).norm() / ref.norm()) < 4e-3


@pytest.mark.parametrize("kwargs,message", [
    (dict(N=8, K=12), "multiple of 8"), (dict(N=0, K=8), "N >= 1"), (dict(N=8, K=8, rows=9), "rows must be"),
    (dict(N=8, K=8, dtype="float32"), "dtype must be"), (dict(N=8, K=8, threads=48), "threads"),
    (dict(N=8, K=8, unroll=0), "unroll"),
])
def test_template_parameters_are_checked(kwargs, message):
    from kvbuffer.tiles.gemv import check_gemv

    with pytest.raises(ValueError, match=message):
        check_gemv(**kwargs)


def test_key_names_its_template_record_and_command():
    x, w = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    key = launch.gemv_key(w, x.shape[0])
    assert key == KernelKey("gemv", "gemv", GemvDims(32, 64), "bfloat16", T=1)
    assert specs.tune_template(key) == "gemv" and specs.layouts(key) == [(None, 0)] and spec_for(key).kind == "gemv"
    assert specs.record_shapes(key) == [{"family": "gemv", "N": 32, "K": 64, "dtype": "bfloat16"}]
    assert specs.tune_command(key) == "kvbuffer tune --gpu <gpu> --model <model>"
    assert spec_for(key).launch_params(key, {"threads": 128}) == dict(threads=128, N=32, K=64, rows=1, dtype="bfloat16")
    assert specs.tune_template(launch.gemv_key(w, 2)) is None  # tune builds one row


def test_custom_op_is_linear_on_cpu_and_its_fake_has_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kvbuffer.errors import DTypeError, ShapeError

    x, w = torch.randn(2, 24).bfloat16(), torch.randn(40, 24).bfloat16()
    assert torch.equal(torch.ops.kvbuffer.gemv(x, w), torch.nn.functional.linear(x, w))
    with FakeTensorMode():
        assert torch.ops.kvbuffer.gemv(torch.empty(1, 24), torch.empty(40, 24)).shape == (1, 40)
    with pytest.raises(ShapeError, match="weight must have shape"):
        torch.ops.kvbuffer.gemv(x, w[:, :8])
    with pytest.raises(DTypeError, match="weight must have dtype"):
        torch.ops.kvbuffer.gemv(x, w.float())


def test_project_takes_the_op_for_one_token_only(monkeypatch):
    """`one_row` routes a one-token forward without bias through torch.ops.kvbuffer.gemv (here its CPU
    implementation, F.linear); more tokens, a bias or another dtype keep F.linear."""
    from kvbuffer.models import layers

    calls = []
    real = launch.engine_rows
    monkeypatch.setattr(launch, "engine_rows", lambda name, *a: calls.append(name) or real(name, *a))
    w = torch.randn(12, 16).bfloat16()
    one = torch.randn(1, 1, 16).bfloat16()
    assert torch.equal(layers.project(one, w, None, True), torch.nn.functional.linear(one, w))
    assert calls == ["gemv"]
    for x, bias in ((torch.randn(2, 1, 16).bfloat16(), None), (one, torch.randn(12).bfloat16())):
        layers.project(x, w, bias, True)
    with pytest.raises(RuntimeError):  # another dtype than the weight's: F.linear's own error, as without the switch
        layers.project(one.float(), w, None, True)
    layers.project(one, w, None, False)
    assert calls == ["gemv"]


def test_one_row_linears_and_the_engine_switch_off_cuda():
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM
    from kvbuffer.engine.one_row import use_one_row_kernel
    from kvbuffer.models.layers import Linear, PackedLinear, one_row_linears

    model = tiny_model("qwen3_5")
    mods = one_row_linears(model)
    assert mods and all(isinstance(m, (Linear, PackedLinear)) and m.bias is None for m in mods)
    assert any(isinstance(m, PackedLinear) for m in mods) and model.lm_head in mods
    assert LLM(model, max_batch=1).gemv == "the linear layers run on the reference ops"
    assert not any(m.one_row for m in mods)
    with pytest.raises(ValueError, match="gemv=True needs the compiled kernels"):
        use_one_row_kernel(model, True, kernels=False)
    with pytest.raises(ValueError, match="gemv must be True, False or 'auto'"):
        use_one_row_kernel(model, "yes", kernels=False)
    assert use_one_row_kernel(model, False, kernels=True) == "gemv=False"


def test_tune_shapes_of_a_model_are_its_projection_weights():
    from kvbuffer.autotune import models
    from kvbuffer.cli.tune import _resolve_shapes

    got = {(s["N"], s["K"]) for s in models.preset_gemv_shapes("qwen3.5-9b")}
    assert got == {(12352, 4096), (4096, 4096), (10240, 4096), (24576, 4096), (4096, 12288), (248320, 4096)}
    shapes = _resolve_shapes("qwen3.5-9b", None, "gdn", None, False, False, True)
    assert [s["family"] for s in shapes] == ["gdn"] + ["gemv"] * 6
    assert [s["family"] for s in _resolve_shapes(None, "16,32,128,128", "gdn", None, False, True, True)] == ["gdn"]
    assert models.config_gemv_shapes({**models.presets.get("qwen3.5-9b").hf_config(), "torch_dtype": "float32"}) == []


def test_tune_fp8_adds_the_presets_fp8_projections():
    """`kvbuffer tune --model qwen3.5-9b --fp8`: the one-row kernels of the FP8 checkpoint's projections
    (128 x 128 blocks) beside the bf16 ones of the modules such a checkpoint keeps unquantized (in_proj's
    b and a, the LM head); --fp8 with a checkpoint directory is refused (its own config decides)."""
    from click.testing import CliRunner

    from kvbuffer import demo_checkpoint
    from kvbuffer.cli.tune import _resolve_shapes, tune

    families = [s["family"] for s in _resolve_shapes("qwen3.5-9b", None, "gdn", None, False, False, True, True)]
    assert families.count("fp8_gemv") == 5 and families.count("gemv") == 2
    assert "fp8_gemv" not in [s["family"] for s in _resolve_shapes("qwen3.5-9b", None, "gdn", None, False, False, True)]
    result = CliRunner().invoke(tune, ["--model", str(demo_checkpoint()), "--fp8", "--gpu", "h100", "--build-only"])
    assert result.exit_code == 2 and "--fp8" in result.output, result.output
