"""Input projections packed into one GEMM (kvbuffer.models.layers.PackedLinear): checkpoints keep
them apart, the loader packs them, checkpoint_tensors splits them back."""

import pytest
import torch

from kvbuffer.errors import CheckpointError
from kvbuffer.models.layers import PackedLinear
from kvbuffer.models.loader import build_model, checkpoint_tensors, load_weights
from tests.support.tiny_models import CONFIGS, tiny_model

PACKED = {  # kind -> (a packed module's path, its checkpoint parts)
    "qwen3_5": ("model.layers.0.linear_attn.in_proj", ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]),
    "nemotron_h": ("model.layers.2.mixer.qkv_proj", ["q_proj", "k_proj", "v_proj"]),
}


def test_packed_linear_is_the_separate_projections():
    g = torch.Generator().manual_seed(0)
    parts = [torch.nn.Linear(24, n, bias=True) for n in (8, 3, 5)]
    packed = PackedLinear(24, {"a": 8, "b": 3, "c": 5}, bias=True)
    with torch.no_grad():
        packed.weight.copy_(torch.cat([p.weight for p in parts]))
        packed.bias.copy_(torch.cat([p.bias for p in parts]))
    x = torch.randn(2, 3, 24, generator=g)
    for got, part in zip(packed(x), parts):
        torch.testing.assert_close(got, part(x))


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_checkpoint_names_round_trip(kind):
    """checkpoint_tensors names the parts as checkpoints do; loading them packs them back bit for bit."""
    model = tiny_model(kind)
    tensors = {k: v.clone() for k, v in checkpoint_tensors(model).items()}
    path, parts = PACKED[kind]
    parent = path.rpartition(".")[0]
    assert all(f"{parent}.{p}.weight" in tensors for p in parts)
    assert f"{path}.weight" not in tensors
    fresh = build_model(CONFIGS[kind])
    load_weights(fresh, tensors)
    for name, p in model.named_parameters():
        assert torch.equal(p, fresh.get_parameter(name)), name


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_a_missing_or_misshaped_part_is_named(kind):
    path, parts = PACKED[kind]
    name = f"{path.rpartition('.')[0]}.{parts[-1]}.weight"
    tensors = {k: v.clone() for k, v in checkpoint_tensors(tiny_model(kind)).items()}
    bad = dict(tensors)
    bad.pop(name)
    with pytest.raises(CheckpointError, match=f"lacks 1 tensor.*{name.replace('.', '[.]')}"):
        load_weights(build_model(CONFIGS[kind]), bad)
    bad = dict(tensors, **{name: tensors[name][:-1]})
    with pytest.raises(CheckpointError, match=f"tensor {name.replace('.', '[.]')}: checkpoint shape"):
        load_weights(build_model(CONFIGS[kind]), bad)


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_a_checkpoint_holding_the_packed_tensor(kind):
    """One that already holds the packed tensor loads as it is; one that holds it and a part is refused."""
    model = tiny_model(kind)
    path, parts = PACKED[kind]
    tensors = {k: v.clone() for k, v in checkpoint_tensors(model).items()}
    for part in parts:
        tensors.pop(f"{path.rpartition('.')[0]}.{part}.weight")
    tensors[f"{path}.weight"] = model.get_parameter(f"{path}.weight").detach().clone()
    fresh = build_model(CONFIGS[kind])
    load_weights(fresh, tensors)
    assert torch.equal(fresh.get_parameter(f"{path}.weight"), model.get_parameter(f"{path}.weight"))
    both = dict(checkpoint_tensors(model), **{f"{path}.weight": tensors[f"{path}.weight"]})
    with pytest.raises(CheckpointError, match=f"both {path.replace('.', '[.]')}[.]weight and its part"):
        load_weights(build_model(CONFIGS[kind]), both)
