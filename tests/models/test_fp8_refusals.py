"""What an FP8 or otherwise quantized checkpoint may not hold: every other quantization method, every
integer, bool or undeclared float8 tensor, a NaN encoding, a missing or mis-shaped scale, a module stored
in FP8 that its config keeps unquantized, a transposed conv weight: a CheckpointError naming it."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvbuffer.errors import CheckpointError
from kvbuffer.models.loader import load_checkpoint
from kvbuffer.models.quant.config import BLOCK, MODELOPT
from kvbuffer.models.quant.fp8 import FP8
from kvbuffer.models.quant.write import write_checkpoint
from tests.support.tiny_models import CONFIGS, tiny_model

QKV = "model.layers.0.linear_attn.in_proj_qkv"


def _checkpoint(tmp_path, fmt=BLOCK, kind="qwen3_5", block=(16, 16)):
    model = tiny_model(kind)
    return write_checkpoint(model, CONFIGS[kind], tmp_path / "ckpt", fmt, block=block)


def _edit_tensors(path, edit):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))


def _edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


METHODS = {
    "gptq": dict(quant_method="gptq", bits=4, group_size=128),
    "awq": dict(quant_method="awq", bits=4),
    "bitsandbytes": dict(quant_method="bitsandbytes", load_in_4bit=True),
    "compressed-tensors": dict(quant_method="compressed-tensors"),
    "fp8 e5m2": dict(quant_method="fp8", fmt="e5m2", weight_block_size=[128, 128]),
    "fp8 static": dict(quant_method="fp8", activation_scheme="static", weight_block_size=[128, 128]),
    "fp8 per tensor": dict(quant_method="fp8", activation_scheme="dynamic"),
    "fp8 bad block": dict(quant_method="fp8", weight_block_size=[128]),
    "modelopt nvfp4": dict(quant_method="modelopt", quant_algo="NVFP4"),
    "modelopt int8 kv": dict(quant_method="modelopt", quant_algo="FP8", kv_cache_quant_algo="INT8"),
    "no method": dict(bits=8),
}
NAMED = {"gptq": "'gptq'", "awq": "'awq'", "bitsandbytes": "'bitsandbytes'", "compressed-tensors": "'compressed-tensors'",
         "fp8 e5m2": "fmt 'e5m2'", "fp8 static": "activation_scheme 'static'", "fp8 per tensor": "weight_block_size",
         "fp8 bad block": "weight_block_size", "modelopt nvfp4": "quant_algo 'NVFP4'",
         "modelopt int8 kv": "kv_cache_quant_algo 'INT8'", "no method": "method None"}


@pytest.mark.parametrize("case", METHODS, ids=list(METHODS))
def test_other_quantization_methods_are_named(tmp_path, case):
    path = _checkpoint(tmp_path)
    _edit_config(path, lambda c: c.__setitem__("quantization_config", METHODS[case]))
    with pytest.raises(CheckpointError, match=NAMED[case]):
        load_checkpoint(path)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.bool, torch.int64, torch.int32, torch.float8_e5m2],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_tensors_of_other_kinds_are_named(tmp_path, dtype):
    """In a plain checkpoint and in an FP8 one alike: never cast to float and run."""
    for fmt in (None, BLOCK):
        path = write_checkpoint(tiny_model("qwen3_5"), CONFIGS["qwen3_5"], tmp_path / str(fmt), fmt, block=(16, 16))
        _edit_tensors(path, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(dtype)))
        with pytest.raises(CheckpointError, match=f"tensor model.norm.weight in .* is {str(dtype).removeprefix('torch.')}"):
            load_checkpoint(path)


def test_float8_without_a_declared_format_is_named(tmp_path):
    path = _checkpoint(tmp_path)
    _edit_config(path, lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match="float8_e4m3fn, but config.json declares no quantization_config"):
        load_checkpoint(path)


@pytest.mark.parametrize("byte", [0x7F, 0xFF], ids=["+nan", "-nan"])
def test_fp8_nan_encodings_are_caught(tmp_path, byte):
    path = _checkpoint(tmp_path)

    def poison(t):
        raw = t[f"{QKV}.weight"].view(torch.uint8).clone()
        raw[3, 5] = byte
        t[f"{QKV}.weight"] = raw.view(FP8)
    _edit_tensors(path, poison)
    with pytest.raises(CheckpointError, match=f"tensor {QKV}.weight in .*non-finite"):
        load_checkpoint(path)


def test_non_finite_scales_are_caught(tmp_path):
    path = _checkpoint(tmp_path)
    _edit_tensors(path, lambda t: t[f"{QKV}.weight_scale_inv"].__setitem__((0, 0), float("inf")))
    with pytest.raises(CheckpointError, match=f"tensor {QKV}.weight_scale_inv in .*non-finite"):
        load_checkpoint(path)


def test_a_missing_scale_is_named(tmp_path):
    path = _checkpoint(tmp_path)
    _edit_tensors(path, lambda t: t.pop(f"{QKV}.weight_scale_inv"))
    with pytest.raises(CheckpointError, match=f"lacks its scale {QKV}.weight_scale_inv"):
        load_checkpoint(path)


@pytest.mark.parametrize("shape", [(1, 4), (16, 5), (16,), (16, 4, 1)], ids=["rows", "columns", "1-d", "3-d"])
def test_block_scales_of_the_wrong_shape_are_named(tmp_path, shape):
    """in_proj_qkv is (256, 64): in 16 x 16 blocks its grid is (16, 4)."""
    path = _checkpoint(tmp_path)
    _edit_tensors(path, lambda t: t.__setitem__(f"{QKV}.weight_scale_inv", torch.ones(shape)))
    with pytest.raises(CheckpointError, match=rf"tensor {QKV}.weight_scale_inv: shape .*expected \(16, 4\)"):
        load_checkpoint(path)


def test_modelopt_scales_must_be_one_value(tmp_path):
    path = _checkpoint(tmp_path, MODELOPT, "nemotron_h")
    name = "model.layers.0.mixer.out_proj"
    _edit_tensors(path, lambda t: t.__setitem__(f"{name}.weight_scale", torch.ones(2)))
    with pytest.raises(CheckpointError, match=f"tensor {name}.weight_scale: shape"):
        load_checkpoint(path)
    _edit_tensors(path, lambda t: (t.__setitem__(f"{name}.weight_scale", torch.tensor(1.0)), t.pop(f"{name}.input_scale")))
    with pytest.raises(CheckpointError, match=f"lacks {name}.input_scale"):
        load_checkpoint(path)


def test_an_excluded_module_stored_in_fp8_is_named(tmp_path):
    path = _checkpoint(tmp_path)
    _edit_config(path, lambda c: c["quantization_config"]["modules_to_not_convert"].append(QKV))
    with pytest.raises(CheckpointError, match=f"keeps {QKV} unquantized"):
        load_checkpoint(path)


def test_a_scale_beside_an_unquantized_weight_is_named(tmp_path):
    path = _checkpoint(tmp_path)
    _edit_tensors(path, lambda t: t.__setitem__("lm_head.weight_scale_inv", torch.ones(7, 4)))
    with pytest.raises(CheckpointError, match="tensor lm_head.weight_scale_inv scales a weight"):
        load_checkpoint(path)


def test_fp8_where_kvbuffer_runs_no_fp8_is_named(tmp_path):
    path = _checkpoint(tmp_path)
    _edit_tensors(path, lambda t: t.__setitem__("model.embed_tokens.weight", t["model.embed_tokens.weight"].to(FP8)))
    with pytest.raises(CheckpointError, match="tensor model.embed_tokens.weight is float8_e4m3fn, but kvbuffer runs"):
        load_checkpoint(path)


def test_an_fp8_weight_of_the_wrong_shape_is_named(tmp_path):
    path = _checkpoint(tmp_path)
    name = "model.layers.0.linear_attn.out_proj"
    _edit_tensors(path, lambda t: t.__setitem__(f"{name}.weight", t[f"{name}.weight"][:-1].contiguous()))
    with pytest.raises(CheckpointError, match=f"tensor {name}.weight: checkpoint shape"):
        load_checkpoint(path)


def test_a_transposed_conv_weight_is_refused(tmp_path):
    """(D, W) loads as transformers' (D, 1, W); a (W, D) of the same size is a transposed weight."""
    name = "model.layers.0.linear_attn.conv1d.weight"
    for fmt in (None, BLOCK):
        path = write_checkpoint(tiny_model("qwen3_5"), CONFIGS["qwen3_5"], tmp_path / str(fmt), fmt, block=(16, 16))
        _edit_tensors(path, lambda t: t.__setitem__(name, t[name][:, 0].contiguous()))
        load_checkpoint(path)
        _edit_tensors(path, lambda t: t.__setitem__(name, t[name].t().contiguous()))
        with pytest.raises(CheckpointError, match=f"tensor {name}: checkpoint shape \\(4, 256\\)"):
            load_checkpoint(path)
