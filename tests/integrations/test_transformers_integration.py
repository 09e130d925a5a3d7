"""kvbuffer.integrations.transformers: `generate` gives the same tokens with and without `enable`.

Tiny random models of the four supported types (hf_models blocks the fused fast paths on CPU), with
odd head counts, dk != dv, grouped key heads and different layer orders; batch 1 and batch 3 with
left padding; prompts shorter than C, equal to C and longer than 3C; fp32 and fp64. Decoding runs
past several fused flushes (C = 4), so the buffered step, its fold and the stock prefill all meet.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.hf_models import COMMON, MOE, QWEN_LINEAR, _randomize, make_hf_model

import kvbuffer.integrations.transformers as kvb

C = 4
NEW = 2 * C + 3  # past two fused flushes
PROMPTS = [3, C, 3 * C + 1]  # shorter than C, equal to C, longer than 3C

# per type: odd value heads, dk != dv, key heads grouped under value heads, and a layer order
QWEN_SHAPES = {
    "qwen3_5_text": dict(linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=8,
                         linear_value_head_dim=12,
                         layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "qwen3_5_moe_text": dict(linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=12,
                             linear_value_head_dim=8,
                             layer_types=["full_attention", "linear_attention", "linear_attention"]),
    "qwen3_next": dict(linear_num_key_heads=1, linear_num_value_heads=5, linear_key_head_dim=8,
                       linear_value_head_dim=4,
                       layer_types=["linear_attention", "linear_attention", "full_attention"]),
}
NEMOTRON_SHAPE = dict(layers_block_type=["full_attention", "linear_attention", "mlp", "linear_attention"],
                      mamba_num_heads=5, mamba_head_dim=4, ssm_state_size=12, n_groups=1)


def qwen_model(model_type: str, shape: dict):
    """A tiny random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next CausalLM with these linear-attention shapes."""
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM

    config_cls, model_cls, extra = {
        "qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, {}),
        "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, MOE),
        "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, MOE),
    }[model_type]
    torch.manual_seed(0)
    linear = {**QWEN_LINEAR, **shape, "num_hidden_layers": len(shape["layer_types"])}
    model = model_cls(config_cls(**COMMON, **linear, **extra))
    _randomize(model)
    return model.eval()


_MODELS: dict = {}


def tiny_model(model_type: str, dtype: torch.dtype):
    """One model per (type, dtype) for the whole file (building them is most of the cost)."""
    key = (model_type, dtype)
    if key not in _MODELS:
        if model_type == "nemotron_h":
            model = make_hf_model("nemotron_h", **NEMOTRON_SHAPE)
        else:
            model = qwen_model(model_type, QWEN_SHAPES[model_type])
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("eager")  # grouped_mm has no float64
        _MODELS[key] = model.to(dtype)
    return _MODELS[key]


def left_padded(lengths: list[int], seed: int = 0):
    """A batch of random prompts of these lengths, left-padded with token 0, and its attention mask."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, T - n:] = torch.randint(1, COMMON["vocab_size"], (n,), generator=g)
        mask[row, T - n:] = 1
    return ids, mask


def generate(model, ids, mask, new_tokens=NEW, **kw):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kw)
    buffered = getattr(out.past_key_values, "kvbuffer_buffers", {})
    assert len(buffered) == len(kvb.enabled_layers(model)), "every enabled layer decodes through kvbuffer"
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def with_and_without(model, fn, chunk_size=C):
    """fn() on the stock model, then with kvbuffer enabled (disabled again afterwards)."""
    stock = fn()
    kvb.enable(model, chunk_size=chunk_size)
    try:
        return stock, fn()
    finally:
        kvb.disable(model)


TYPES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h"]
# transformers' recurrences compute in fp32 even in an fp64 model (`.float()` in their GDN and Mamba-2
# fallbacks), so fp64 logits agree to fp32 rounding, not to fp64's
TOL = {torch.float32: 2e-4, torch.float64: 2e-5}


def _cases():
    """Every type: the padded batch (all three prompt lengths) in fp32 and fp64, and batch 1 with a
    prompt of C; one type per family also runs batch 1 with the short and the long prompt."""
    for model_type in TYPES:
        for dtype, name in ((torch.float32, "fp32"), (torch.float64, "fp64")):
            yield pytest.param(model_type, dtype, PROMPTS, id=f"{model_type}-{name}-b3-left-pad")
        yield pytest.param(model_type, torch.float32, [C], id=f"{model_type}-fp32-b1-C")
        if model_type in ("qwen3_5_text", "nemotron_h"):
            yield pytest.param(model_type, torch.float32, [3], id=f"{model_type}-fp32-b1-short")
            yield pytest.param(model_type, torch.float32, [3 * C + 1], id=f"{model_type}-fp32-b1-long")


@pytest.mark.parametrize("model_type, dtype, lengths", list(_cases()))
def test_greedy_generate_is_token_identical(model_type, dtype, lengths):
    model = tiny_model(model_type, dtype)
    ids, mask = left_padded(lengths)
    (tok0, lg0), (tok1, lg1) = with_and_without(model, lambda: generate(model, ids, mask))
    assert torch.equal(tok0, tok1)
    torch.testing.assert_close(lg1, lg0, atol=TOL[dtype], rtol=0)


def test_default_chunk_size_over_several_flushes():
    model = tiny_model("qwen3_5_text", torch.float32)
    ids, mask = left_padded([5, 16, 50], seed=3)
    (tok0, _), (tok1, _) = with_and_without(model, lambda: generate(model, ids, mask, new_tokens=20), chunk_size=16)
    assert torch.equal(tok0, tok1)


@pytest.mark.parametrize("model_type", ["qwen3_next", "nemotron_h"])
def test_sampling_is_unchanged(model_type):
    model = tiny_model(model_type, torch.float32)
    ids, mask = left_padded(PROMPTS, seed=1)

    def sample():
        torch.manual_seed(7)
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=0, top_p=1.0,
                              temperature=1.0, pad_token_id=0)

    stock, buffered = with_and_without(model, sample)
    assert torch.equal(stock, buffered)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_past_key_values_reuse(model_type):
    """A second generate continues the first one's cache (a multi-token continuation: the buffers are
    folded into the cache before transformers' own prefill reads it)."""
    model = tiny_model(model_type, torch.float32)
    ids, mask = left_padded(PROMPTS, seed=2)

    def two_turns():
        first = model.generate(ids, attention_mask=mask, max_new_tokens=C + 2, do_sample=False, pad_token_id=0,
                               return_dict_in_generate=True)
        more = torch.randint(1, COMMON["vocab_size"], (ids.shape[0], 3), generator=torch.Generator().manual_seed(5))
        seq = torch.cat([first.sequences, more], 1)
        seq_mask = torch.cat([mask, torch.ones_like(seq[:, mask.shape[1]:])], 1)
        return model.generate(seq, attention_mask=seq_mask, past_key_values=first.past_key_values,
                              max_new_tokens=NEW, do_sample=False, pad_token_id=0)

    stock, buffered = with_and_without(model, two_turns)
    assert torch.equal(stock, buffered)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_fold_gives_back_the_stock_cache(model_type):
    """After `fold`, the cache's recurrent states are what transformers alone computed (GDN: folded
    in the cache's own tensor; Mamba-2: the transposed copy written back)."""
    model = tiny_model(model_type, torch.float64)
    ids, mask = left_padded(PROMPTS, seed=4)

    def cache_after():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=C + 2, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
        kvb.fold(out.past_key_values)
        return out.past_key_values

    stock, buffered = with_and_without(model, cache_after)
    layers = [i for i, layer in enumerate(stock.layers) if hasattr(layer, "recurrent_states")]
    assert layers
    for i in layers:
        torch.testing.assert_close(buffered.layers[i].recurrent_states[0], stock.layers[i].recurrent_states[0],
                                   atol=1e-7, rtol=0)  # fp32 inside transformers' recurrences
    assert not getattr(buffered, "kvbuffer_buffers")


def test_a_bf16_cache_state_is_worked_on_in_fp32_and_written_back():
    """A cache state that is not fp32 (a bf16 model's) gets an fp32 kvbuffer-layout copy; fold writes
    the folded state back into the cache's tensor in its dtype and layout."""
    from kvbuffer.integrations.transformers_layers import _new_buffers

    g = torch.Generator().manual_seed(0)
    source = torch.randn(2, 3, 4, 8, generator=g).bfloat16()  # Mamba-2 (B, H, P, N)
    rec = _new_buffers(source, 1, 8, 3, 4, torch.float32, C, transposed=True)
    assert rec.owned and rec.state.dtype == torch.float32 and rec.state.shape == (2, 3, 8, 4)
    assert torch.equal(rec.state, source.float().transpose(-1, -2))
    rec.buf_k[:, 0].normal_(generator=g)
    rec.buf_v[:, 0].normal_(generator=g)
    rec.buf_g[:, 0] = -0.5
    rec.lengths.fill_(1)
    expected = rec.state.clone()
    pools = (rec.buf_k, rec.buf_v, rec.buf_g)
    torch.ops.kvbuffer.mamba2_flush(expected, rec.slots, *pools, rec.slots, rec.lengths.clone())
    rec.fold()
    assert not rec.pending
    assert torch.equal(source, expected.transpose(-1, -2).bfloat16())


def test_enable_disable_swap_forwards_on_the_instance():
    model = tiny_model("qwen3_5_text", torch.float32)
    assert kvb.enable(model, chunk_size=8) is model
    layers = kvb.enabled_layers(model)
    assert len(layers) == QWEN_SHAPES["qwen3_5_text"]["layer_types"].count("linear_attention")
    assert all("forward" in vars(m) for m in layers)
    kvb.disable(model)
    assert not kvb.enabled_layers(model) and all("forward" not in vars(m) for m in model.modules())


def test_conditional_generation_model_is_found():
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = {**COMMON, **QWEN_LINEAR}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=COMMON["hidden_size"])
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    ids, mask = left_padded(PROMPTS, seed=6)
    (tok0, _), (tok1, _) = with_and_without(model, lambda: generate(model, ids, mask))
    assert torch.equal(tok0, tok1)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True], ids=["zero", "negative", "float", "bool"])
def test_bad_chunk_size_names_the_argument(bad):
    with pytest.raises(ValueError, match="chunk_size"):
        kvb.enable(tiny_model("qwen3_5_text", torch.float32), chunk_size=bad)


def test_model_without_linear_layers_is_refused():
    with pytest.raises(TypeError, match="no Gated DeltaNet or Mamba-2 layer"):
        kvb.enable(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model must be"):
        kvb.enable("qwen3.5")


@pytest.mark.parametrize("bad", [None, 3, "model", [torch.nn.Linear(2, 2)], make_hf_model],
                         ids=["None", "int", "str", "list", "function"])
def test_enabled_layers_takes_a_module(bad):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        kvb.enabled_layers(bad)


@pytest.mark.parametrize("bad", [None, 3, "cache", [], torch.nn.Linear(2, 2), make_hf_model],
                         ids=["None", "int", "str", "list", "module", "function"])
def test_fold_takes_a_transformers_cache_and_sets_nothing_on_anything_else(bad):
    before = dict(vars(bad)) if hasattr(bad, "__dict__") else None
    with pytest.raises(TypeError, match="cache must be a transformers Cache"):
        kvb.fold(bad)
    assert (dict(vars(bad)) if hasattr(bad, "__dict__") else None) == before


def test_beam_search_is_refused():
    model = tiny_model("qwen3_5_text", torch.float32)
    ids, mask = left_padded([C], seed=8)
    kvb.enable(model, chunk_size=C)
    try:
        with pytest.raises(ValueError, match="beam search"):
            model.generate(ids, attention_mask=mask, max_new_tokens=NEW, num_beams=2, do_sample=False,
                           pad_token_id=0)
    finally:
        kvb.disable(model)


def test_readme_example_gives_the_same_tokens(capsys):
    """README's "Use kvbuffer in your stack" example (test_readme runs every example; this one also
    checks what it prints)."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Use kvbuffer in your stack", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
    assert "same tokens with kvbuffer: True" in capsys.readouterr().out


def test_transformers_without_the_linear_attention_cache_api_is_refused(monkeypatch):
    """A Cache with neither spelling of the linear-attention states (5.24's accessor methods, 5.17's
    has_previous_state and layer attributes) is refused before any layer is touched."""
    from transformers.cache_utils import Cache

    monkeypatch.delattr(Cache, "get_conv_state", raising=False)  # absent in 5.17
    monkeypatch.delattr(Cache, "has_previous_state")
    with pytest.raises(ImportError, match="get_conv_state.*has_previous_state"):
        kvb.enable(tiny_model("qwen3_5_text", torch.float32))


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_both_cache_access_families_read_the_same_states(model_type):
    """On a stock cache after decoding, the layer attributes (5.17's way) give the very tensors the
    accessor methods (5.24's) give, wherever the installed release has them; the installed cache
    is served by one of the two."""
    from kvbuffer.integrations.transformers_cache import ACCESSOR_METHODS, LAYER_ATTRIBUTES, access_for

    model = tiny_model(model_type, torch.float32)
    ids, mask = left_padded([C], seed=10)
    cache = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True).past_key_values
    assert access_for(cache) in (ACCESSOR_METHODS, LAYER_ATTRIBUTES)
    families = [a for a in (ACCESSOR_METHODS, LAYER_ATTRIBUTES) if a.fits(cache)]
    for m in model.modules():
        if type(m).__name__.endswith(("GatedDeltaNet", "Mamba2Mixer")):
            i = m.layer_idx
            for access in families:
                assert access.conv_state(cache, i) is cache.layers[i].conv_states[0]
                assert access.recurrent_state(cache, i) is cache.layers[i].recurrent_states[0]
                assert access.is_recording_past(cache, i) is False


def test_benchmark_config_is_the_preset_with_fewer_layers():
    """The transformers benchmark's model is kvbuffer.presets' Qwen3.5-9B (no second copy of its
    shapes), cut to the first layers, and transformers builds it (on the meta device: no memory)."""
    from kvbuffer import presets
    from kvbuffer.integrations.benchmark import build_model, model_config

    preset = presets.get("qwen3.5-9b").hf_config()
    full = model_config()
    assert {k: v for k, v in full.items() if k not in ("num_hidden_layers", "pad_token_id")} == \
        {k: v for k, v in preset.items() if k != "model_type"}
    assert full["num_hidden_layers"] == 32
    model = build_model(6, device="meta")
    assert model.config.layer_types == preset["layer_types"][:6] and model.config.num_hidden_layers == 6
    gdn = model.model.layers[0].linear_attn
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim) == (16, 32, 128, 128)
    for bad in (0, 33, 2.0):
        with pytest.raises(ValueError, match="layers"):
            model_config(bad)


def test_a_new_chunk_size_between_generations_of_one_cache():
    """A cache decoded with C = 4 continues one token at a time under C = 8: its buffers (too small
    for 8) are folded and rebuilt, and the tokens stay the stock ones."""
    model = tiny_model("qwen3_5_text", torch.float64)
    ids, mask = left_padded(PROMPTS, seed=9)

    def two_sizes(resize):
        first = model.generate(ids, attention_mask=mask, max_new_tokens=C + 2, do_sample=False, pad_token_id=0,
                               return_dict_in_generate=True)
        resize()
        seq_mask = torch.cat([mask, torch.ones_like(first.sequences[:, mask.shape[1]:])], 1)
        return model.generate(first.sequences, attention_mask=seq_mask, past_key_values=first.past_key_values,
                              max_new_tokens=NEW, do_sample=False, pad_token_id=0)

    stock = two_sizes(lambda: None)
    kvb.enable(model, chunk_size=C)
    try:
        buffered = two_sizes(lambda: kvb.enable(model, chunk_size=2 * C))
    finally:
        kvb.disable(model)
    assert torch.equal(stock, buffered)
