"""Property suite of the checkpoint loader's config: mutations of the tiny test configs (a field set
to a value of another type or range, removed, or nested; several at once) either load and run one
generate step, or are a CheckpointError at load. Never a raw error, never an error at the first
forward. Bounded: a fixed number of derandomized examples."""

import json
import math

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbuffer import LLM
from kvbuffer.errors import CheckpointError
from kvbuffer.models.loader import build_model, read_config
from tests.support.tiny_models import CONFIGS

BOUNDED = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

OPTIONAL = ("rms_norm_eps", "layer_norm_epsilon", "rope_theta", "partial_rotary_factor", "rope_parameters",
            "tie_word_embeddings", "linear_conv_kernel_dim", "conv_kernel", "ssm_state_size", "n_groups",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers", "decoder_sparse_step",
            "text_config", "hybrid_override_pattern", "n_group", "topk_group", "routed_scaling_factor",
            "num_nextn_predict_layers", "use_conv_bias", "mlp_hidden_act", "moe_latent_size", "norm_topk_prob")
INTS = st.sampled_from([-1, 0, 1, 2, 3, 4, 5, 8, 12, 16, 33, 2 ** 31 - 1, 2 ** 31, 10 ** 12, 2 ** 64])
SCALARS = st.one_of(
    INTS, st.sampled_from([0.0, -1.0, 0.5, 1.0, 2.0, 1e-6, 1e9, math.nan, math.inf, 16.0]),
    st.sampled_from(["x", "", "16", "silu", "no", "linear_attention", "M*-E"]), st.booleans(), st.none())


def values():
    """Values of every JSON kind, some nested a few levels."""
    return st.recursive(SCALARS, lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["rope_theta", "partial_rotary_factor", "rope_type", "x"]), inner,
                        max_size=3)), max_leaves=6)


@st.composite
def configs(draw):
    kind = draw(st.sampled_from(sorted(CONFIGS)))
    cfg = json.loads(json.dumps(CONFIGS[kind]))
    if kind == "qwen3_5" and draw(st.booleans()):
        cfg.update(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   shared_expert_intermediate_size=16)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(cfg) + list(OPTIONAL)))
        how = draw(st.sampled_from(["set", "set", "drop", "nest"]))
        if how == "drop":
            cfg.pop(key, None)
        elif how == "nest":
            cfg[key] = [cfg.get(key)] * draw(st.integers(1, 2))
        else:
            cfg[key] = draw(values())
    return cfg


def _runs_one_step(model) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # build_model leaves routed experts uninitialised (they are loaded next)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    llm = LLM(model, device="cpu", dtype=torch.float32, kernels=False, max_batch=2, max_len=16, chunk_size=4)
    vocab = model.config.vocab_size
    out = llm.generate([[0, vocab - 1, 0], [vocab - 1]], max_new_tokens=2, stop_token_ids=())
    assert all(len(o.token_ids) == 2 and all(0 <= t < vocab for t in o.token_ids) for o in out)


@BOUNDED
@given(cfg=configs())
def test_a_drawn_config_loads_and_runs_or_is_refused_at_load(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    try:
        model = build_model(read_config(tmp_path))
    except CheckpointError as e:
        event("refused: " + str(e).split(" must ")[0].split(":")[-1].strip()[:40])
        return
    event("loaded")
    _runs_one_step(model)
