"""load_checkpoint builds its model with no random initialisation, in the target dtype, on the target
device (loader.parameters_to_load), and checks finiteness in one min/max pass (loader.all_finite): the
loaded model is bit for bit the one a randomly initialised fp32 build, loaded and cast, gives; torch's
initialisers and default dtype are back afterwards, also when loading fails."""

import pytest
import torch

from kvbuffer.errors import CheckpointError
from kvbuffer.models import loader
from kvbuffer.models.quant.write import write_checkpoint
from tests.support.tiny_models import CONFIGS, tiny_model


def _old_way(path, dtype):
    """What load_checkpoint did before: a random fp32 build, the weights copied in, then cast."""
    model = loader.build_model(loader.read_config(path))
    loader.load_weights(model, loader._read_tensors(path), None)
    return model.to(dtype) if dtype is not None else model


@pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", CONFIGS)
def test_loaded_model_is_bit_identical_to_a_random_build_loaded(tmp_path, kind, dtype, saved):
    path = write_checkpoint(tiny_model(kind).to(saved), CONFIGS[kind], tmp_path / "ck")
    got = loader.load_checkpoint(path, dtype=dtype)
    want = _old_way(path, dtype)
    got_params, want_params = dict(got.named_parameters()), dict(want.named_parameters())
    assert sorted(got_params) == sorted(want_params)
    for name, p in want_params.items():
        assert got_params[name].dtype == p.dtype, name
        assert torch.equal(got_params[name], p), name


@pytest.mark.parametrize("kind", CONFIGS)
def test_models_hold_no_buffers(kind):
    """What makes skipping the initialisers safe: every tensor of a model is a parameter, and the loader
    refuses a checkpoint that lacks one (test_bad_checkpoints.py)."""
    assert list(tiny_model(kind).buffers()) == []


def test_initialisers_and_default_dtype_come_back_even_on_a_failed_load(tmp_path):
    inits = {name: getattr(torch.nn.init, name) for name in loader._RANDOM_INITS}
    path = write_checkpoint(tiny_model("qwen3_5"), CONFIGS["qwen3_5"], tmp_path / "ck")
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="safetensors"):
        loader.load_checkpoint(path, dtype=torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32
    assert {name: getattr(torch.nn.init, name) for name in loader._RANDOM_INITS} == inits
    t = torch.empty(64, 64)
    torch.nn.init.normal_(t)
    assert float(t.std()) > 0.5  # the real initialiser again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 64, 4097])
def test_all_finite_finds_every_nan_and_infinity(dtype, n):
    g = torch.Generator().manual_seed(n)
    clean = torch.randn(n, generator=g).to(dtype)
    assert loader.all_finite(clean) and loader.all_finite(clean[:0])
    for pos in {0, n // 3, n // 2, n - 1}:
        for bad in (float("nan"), float("inf"), float("-inf")):
            t = clean.clone()
            t[pos] = bad
            assert not loader.all_finite(t), (pos, bad)
            assert not loader.all_finite(t.reshape(1, n, 1)), (pos, bad)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h"])
def test_every_model_type_saved_by_transformers_loads_bit_identically(tmp_path_factory, model_type, dtype):
    """The same over transformers' own checkpoints of every supported type (stacked experts, packed
    projections, published names); the Qwen3.5 one with a multi-token-prediction head attached at load."""
    from tests.support.hf_models import add_mtp_head, saved_hf_model

    _, path = saved_hf_model(model_type, tmp_path_factory)
    if model_type == "qwen3_5_text":
        add_mtp_head(path)
    got, want = loader.load_checkpoint(path, dtype=dtype), _old_way(path, dtype)
    got_params, want_params = dict(got.named_parameters()), dict(want.named_parameters())
    assert sorted(got_params) == sorted(want_params)
    assert all(torch.equal(got_params[n], p) and got_params[n].dtype == p.dtype for n, p in want_params.items())
    assert list(got.buffers()) == []


def test_a_bad_tensor_is_refused_before_the_model_takes_memory(tmp_path, monkeypatch):
    """The config is checked on the meta device and every tensor's kind and values are read before the
    real build: a NaN weight is a CheckpointError with no model allocated."""
    from safetensors.torch import load_file, save_file

    path = write_checkpoint(tiny_model("qwen3_5"), CONFIGS["qwen3_5"], tmp_path / "ck")
    tensors = load_file(path / "model.safetensors")
    name = next(n for n, t in tensors.items() if t.dim() == 2)
    tensors[name][1, 2] = float("nan")
    save_file(tensors, path / "model.safetensors")

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the tensors were checked")

    monkeypatch.setattr(loader, "parameters_to_load", no_build)
    with pytest.raises(CheckpointError, match=f"tensor {name} .* non-finite"):
        loader.load_checkpoint(path, dtype=torch.bfloat16)
