"""Nemotron-H: greedy generation is token-identical to transformers', with logits within 1e-4 at every step.

The tiny model has every mixer kind (Mamba-2, attention, relu^2 MLP, routed MoE with group-limited
routing and a score-correction bias). Its prefill applies no dt clamp (time_step_min = 0, see
hf_models._make_nemotron_h): kvbuffer applies no dt floor anywhere, and transformers' decode none either.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.hf_models import hf_greedy, make_hf_model, saved_hf_model
from kvbuffer import LLM
from kvbuffer.models.loader import CheckpointError, build_model, load_checkpoint, read_config

C = 6  # buffer chunk: prompt lengths straddle it
PROMPT_LENGTHS = [1, C - 1, C, C + 1, 3 * C + 5]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf, path = saved_hf_model("nemotron_h", tmp_path_factory)
    return hf, path, {}  # memo: transformers' reference per prompt, shared by both modes and all batches


def _prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(n)]
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lengths]


def _worst_diff(hf, memo, prompts, outs, label):
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        key = tuple(prompt)
        if key not in memo:
            memo[key] = hf_greedy(hf, prompt, NEW_TOKENS)
        ref_tokens, ref_logits = memo[key]
        worst = max(worst, float((torch.stack(out.logits) - ref_logits).abs().max()))
        assert out.token_ids == ref_tokens, f"{label}: prompt of {len(prompt)} diverged"
    return worst


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_greedy_matches_transformers(checkpoint, mode, batch):
    hf, path, memo = checkpoint
    llm = LLM(str(path), device="cpu", mode=mode, chunk_size=C, max_batch=batch)
    # batch 1 runs every prompt length one request at a time; larger batches mix them
    prompts = _prompts(len(PROMPT_LENGTHS) if batch == 1 else batch, hf.config.vocab_size, seed=batch % 2)
    outs = llm.generate(prompts, max_new_tokens=NEW_TOKENS, return_logits=True, stop_token_ids=[])
    worst = _worst_diff(hf, memo, prompts, outs, f"nemotron_h {mode} batch={batch}")
    print(f"nemotron_h {mode} batch={batch}: max |logit diff| = {worst:.2e}")
    assert worst < 1e-4


def test_latent_moe_matches_transformers(tmp_path):
    """Nemotron-3 Super's latent MoE (experts between fc1/fc2_latent_proj), one request per mode."""
    hf = make_hf_model("nemotron_h", moe_latent_size=24)
    hf.save_pretrained(tmp_path)
    prompts = _prompts(len(PROMPT_LENGTHS), hf.config.vocab_size, seed=3)[-1:]  # 3C+5 tokens: flushes in prefill
    memo = {tuple(prompts[0]): hf_greedy(hf, prompts[0], 16)}
    for mode in ("kvbuffer", "recurrent"):
        llm = LLM(str(tmp_path), device="cpu", mode=mode, chunk_size=C, max_batch=1)
        outs = llm.generate(prompts, max_new_tokens=16, return_logits=True, stop_token_ids=[])
        assert _worst_diff(hf, memo, prompts, outs, f"latent moe {mode}") < 1e-4


# ----------------------------------------------------------------------------------------------
# checkpoints that cannot be loaded name the tensor; MTP tensors are skipped


def _drop(name):
    return lambda t: t.pop(name)


def _reshape(name, shape):
    return lambda t: t.__setitem__(name, torch.zeros(shape))


BAD_CHECKPOINTS = [
    pytest.param(_drop("backbone.layers.0.mixer.D"), "model.layers.0.mixer.D", id="missing-mamba-D"),
    pytest.param(_drop("backbone.layers.1.mixer.gate.e_score_correction_bias"),
                 "model.layers.1.mixer.gate.e_score_correction_bias", id="missing-router-bias"),
    pytest.param(_drop("backbone.layers.5.mixer.experts.3.down_proj.weight"), "down_proj", id="missing-expert"),
    pytest.param(_reshape("backbone.layers.4.mixer.in_proj.weight", (199, 64)),
                 "model.layers.4.mixer.in_proj.weight", id="misshaped-in-proj"),
    pytest.param(_reshape("backbone.layers.2.mixer.k_proj.weight", (64, 64)),
                 "model.layers.2.mixer.k_proj.weight", id="misshaped-attention"),
    pytest.param(_reshape("backbone.layers.1.mixer.experts.2.up_proj.weight", (31, 64)),
                 "backbone.layers.1.mixer.experts.2.up_proj.weight", id="misshaped-one-expert"),
    pytest.param(lambda t: t.__setitem__("backbone.layers.9.mixer.D", torch.zeros(8)),
                 "model.layers.9.mixer.D", id="unexpected"),
]


@pytest.mark.parametrize("corrupt, named", BAD_CHECKPOINTS)
def test_bad_checkpoint_names_the_tensor(checkpoint, tmp_path, corrupt, named):
    _, path, _ = checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    corrupt(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")):
        load_checkpoint(tmp_path)


def test_mtp_head_loads_and_a_partial_one_is_named(checkpoint, tmp_path):
    """A checkpoint with Nemotron-3 Super's MTP head (mtp.*, here also under published prefixes)
    gets the head attached; the decoder's weights are untouched; a partial head names what lacks."""
    from tests.support.hf_models import add_mtp_head

    _, path, _ = checkpoint
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(load_file(str(path / "model.safetensors")), str(tmp_path / "model.safetensors"))
    add_mtp_head(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    renamed = {("backbone." + k if k.startswith("mtp.layers.1") else k): v for k, v in tensors.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    model, ref = load_checkpoint(tmp_path), load_checkpoint(path)
    assert model.mtp is not None and ref.mtp is None
    for n, p in ref.named_parameters():
        assert torch.equal(p, model.get_parameter(n)), n
    torch.testing.assert_close(model.mtp.layers[0].eh_proj.weight, tensors["mtp.layers.0.eh_proj.weight"])
    tensors.pop("mtp.layers.0.eh_proj.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="mtp.layers.0.eh_proj.weight"):
        load_checkpoint(tmp_path)


def test_config_pattern_and_unsupported_fields(checkpoint):
    _, path, _ = checkpoint
    d = read_config(path)
    geo = build_model(d).cache_geometry()
    assert (geo["num_linear_layers"], geo["num_attention_layers"]) == (2, 2)
    assert geo["conv_dim"] == 8 * 8 + 2 * 2 * 16
    legacy = {k: v for k, v in d.items() if k != "layers_block_type"}
    legacy["hybrid_override_pattern"] = "ME*-ME*"  # older config.json files spell the layers this way
    assert build_model(legacy).config.layer_types == build_model(d).config.layer_types
    with pytest.raises(CheckpointError, match="mamba_hidden_act"):
        build_model({**d, "mamba_hidden_act": "gelu"})
    with pytest.raises(CheckpointError, match="hybrid_override_pattern"):
        build_model({**legacy, "hybrid_override_pattern": "MX*"})
    with pytest.raises(CheckpointError, match="mamba_num_heads"):
        build_model({k: v for k, v in d.items() if k != "mamba_num_heads"})
