"""config.json values of the wrong type, out of range or inconsistent are a CheckpointError at load
naming the field: each used to load and fail at the first forward (or never), read wrongly, or end
in a raw ZeroDivisionError, AttributeError or RecursionError."""

import json
import math

import pytest

from kvbuffer.errors import CheckpointError
from kvbuffer.models.loader import build_model, read_config
from tests.support.tiny_models import CONFIGS

QWEN, NEMOTRON = CONFIGS["qwen3_5"], CONFIGS["nemotron_h"]
QWEN_DERIVED_HEADS = {k: v for k, v in QWEN.items() if k != "head_dim"}  # head_dim = hidden_size // heads

# (config, field, value, the field the message names)
BAD = [
    (QWEN, "hidden_size", 0, "hidden_size"),
    (QWEN_DERIVED_HEADS, "hidden_size", 3, "hidden_size"),  # fewer than the heads, no head_dim: a head of 0 channels
    (QWEN, "rope_parameters", "x", "rope_parameters"),
    (QWEN, "rope_parameters", {"rope_theta": 0}, "rope_parameters.rope_theta"),
    (QWEN, "partial_rotary_factor", 2, "partial_rotary_factor"),
    (QWEN, "partial_rotary_factor", 0.01, "partial_rotary_factor"),  # rotates 0 channels
    (QWEN, "partial_rotary_factor", 0.1875, "partial_rotary_factor"),  # rotates 3 of 16: an odd number
    (QWEN, "rms_norm_eps", "x", "rms_norm_eps"),
    (QWEN, "rms_norm_eps", -1, "rms_norm_eps"),
    (QWEN, "rms_norm_eps", math.nan, "rms_norm_eps"),
    (QWEN, "rms_norm_eps", math.inf, "rms_norm_eps"),
    (QWEN, "rope_theta", 0, "rope_theta"),
    (QWEN, "rope_theta", True, "rope_theta"),
    (QWEN, "eos_token_id", "x", "eos_token_id"),
    (QWEN, "eos_token_id", -1, "eos_token_id"),
    (QWEN, "eos_token_id", 1e9, "eos_token_id"),
    (QWEN, "eos_token_id", 97, "eos_token_id"),  # vocab_size 97: ids 0 .. 96
    (QWEN, "eos_token_id", [1, "2"], "eos_token_id"),
    (QWEN, "tie_word_embeddings", "no", "tie_word_embeddings"),
    (QWEN, "tie_word_embeddings", 0, "tie_word_embeddings"),
    (QWEN, "vocab_size", 2.0, "vocab_size"),
    (QWEN, "num_key_value_heads", 3, "num_key_value_heads"),  # 4 heads in groups of 3
    (QWEN, "linear_num_value_heads", 3, "linear_num_value_heads"),  # not a multiple of the 2 key heads
    (QWEN, "linear_conv_kernel_dim", 0, "linear_conv_kernel_dim"),
    (QWEN, "layer_types", [], "layer_types"),
    (QWEN, "layer_types", ["linear_attention", "mamba"], "layer_types"),
    (QWEN, "intermediate_size", 0, "intermediate_size"),
    (QWEN, "text_config", [], "text_config"),
    (QWEN, "head_dim", 2 ** 31, "head_dim"),
    (QWEN, "vocab_size", 10 ** 12, "vocab_size"),
    (QWEN, "hidden_size", 2 ** 30, "hidden_size"),  # in range alone, but terabytes of weights: refused unbuilt
    (QWEN, "hidden_act", "gelu", "hidden_act"),  # the MLPs compute SiLU: a GELU model would run as another
    (QWEN, "hidden_act", 5, "hidden_act"),
    (QWEN, "num_hidden_layers", 3, "num_hidden_layers"),  # 4 layer_types
    (QWEN, "num_hidden_layers", -1, "num_hidden_layers"),
    (QWEN, "num_hidden_layers", 4.0, "num_hidden_layers"),
    (QWEN, "num_hidden_layers", "4", "num_hidden_layers"),
    (NEMOTRON, "hidden_size", 0, "hidden_size"),
    (NEMOTRON, "mlp_hidden_act", "swiglu", "mlp_hidden_act"),
    (NEMOTRON, "num_hidden_layers", 4, "num_hidden_layers"),  # 5 in layers_block_type
    (NEMOTRON, "num_hidden_layers", True, "num_hidden_layers"),
    (NEMOTRON, "layer_norm_epsilon", 0, "layer_norm_epsilon"),
    (NEMOTRON, "eos_token_id", 1e9, "eos_token_id"),
    (NEMOTRON, "tie_word_embeddings", "no", "tie_word_embeddings"),
    (NEMOTRON, "n_groups", 3, "n_groups"),  # 4 Mamba heads
    (NEMOTRON, "conv_kernel", -1, "conv_kernel"),
    (NEMOTRON, "use_conv_bias", "yes", "use_conv_bias"),
    (NEMOTRON, "layers_block_type", "mamba", "layers_block_type"),
    (NEMOTRON, "routed_scaling_factor", "x", "routed_scaling_factor"),
    (NEMOTRON, "num_nextn_predict_layers", -1, "num_nextn_predict_layers"),
]


def _dropped(cfg, key):
    return {k: v for k, v in cfg.items() if k != key}


@pytest.mark.parametrize("cfg,field,value,named", BAD, ids=[f"{c['model_type']}-{f}={v!r}" for c, f, v, _ in BAD])
def test_a_bad_value_is_refused_at_load_naming_the_field(tmp_path, cfg, field, value, named):
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, **{field: value})))
    with pytest.raises(CheckpointError, match=named):
        build_model(read_config(tmp_path))


@pytest.mark.parametrize("cfg", [QWEN, NEMOTRON], ids=["qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_attention_heads"])
def test_a_missing_required_field_is_named(cfg, field):
    with pytest.raises(CheckpointError, match=field):
        build_model(_dropped(cfg, field))


def test_deep_nesting_is_a_checkpoint_error(tmp_path):
    text = json.dumps(QWEN)[:-1] + ', "rope_parameters": ' + "[" * 10000 + "]" * 10000 + "}"
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json"):
        build_model(read_config(tmp_path))


def test_moderate_nesting_is_named_by_its_kind_not_printed():
    with pytest.raises(CheckpointError, match="hidden_size must be an integer .* got a list$"):
        build_model(dict(QWEN, hidden_size=[[[[1] * 40]]]))


@pytest.mark.parametrize("eos,ids", [(None, ()), (5, (5,)), ([5, 7], (5, 7))])
def test_valid_stop_ids(eos, ids):
    assert build_model(dict(QWEN, eos_token_id=eos)).config.eos_token_ids == ids


def test_a_nested_text_config_is_read_with_its_own_names():
    text = dict(QWEN, rope_parameters={"rope_theta": 5e5, "partial_rotary_factor": 0.25})
    model = build_model({"model_type": "qwen3_5_text", "text_config": text, "tie_word_embeddings": False})
    assert model.config.rope_theta == 5e5 and model.config.partial_rotary_factor == 0.25
    with pytest.raises(CheckpointError, match=r"text_config\.rope_parameters\.partial_rotary_factor"):
        build_model({"model_type": "qwen3_5_text",
                     "text_config": dict(text, rope_parameters={"partial_rotary_factor": "half"})})


def test_moe_fields_are_checked_together():
    moe = dict(QWEN, model_type="qwen3_5_moe_text", num_experts=4, moe_intermediate_size=16,
               shared_expert_intermediate_size=16)
    with pytest.raises(CheckpointError, match="num_experts_per_tok must be an integer in \\[1, 4\\]"):
        build_model(dict(moe, num_experts_per_tok=5))
    with pytest.raises(CheckpointError, match="mlp_only_layers"):
        build_model(dict(moe, num_experts_per_tok=2, mlp_only_layers=[4]))
    routed = dict(NEMOTRON, layers_block_type=["mamba", "moe"], n_group=2)
    with pytest.raises(CheckpointError, match="topk_group must be"):
        build_model(dict(routed, topk_group=3))
    with pytest.raises(CheckpointError, match="num_experts_per_tok must be"):
        build_model(dict(routed, topk_group=1, num_experts_per_tok=3))


def test_num_hidden_layers_must_count_the_layer_list():
    assert len(build_model(dict(QWEN, num_hidden_layers=4, hidden_act="silu")).config.layer_types) == 4
    assert build_model(dict(QWEN, hidden_act="swish")).config.layer_types == tuple(QWEN["layer_types"])
    text = dict(QWEN, num_hidden_layers=5)
    with pytest.raises(CheckpointError, match=r"text_config\.num_hidden_layers must be 4, the length of "
                                              r"text_config\.layer_types, got 5"):
        build_model({"model_type": "qwen3_5_text", "text_config": text})
    pattern = {k: v for k, v in NEMOTRON.items() if k != "layers_block_type"}
    pattern["hybrid_override_pattern"] = "M-*M-"
    assert len(build_model(dict(pattern, num_hidden_layers=5)).config.layer_types) == 5
    with pytest.raises(CheckpointError, match="num_hidden_layers must be 5, the length of hybrid_override_pattern"):
        build_model(dict(pattern, num_hidden_layers=6))
    assert build_model(dict(NEMOTRON, num_hidden_layers=5, mlp_hidden_act="relu2")).config.mlp_hidden_act == "relu2"
