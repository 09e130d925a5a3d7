"""FP8 checkpoints (kvbuffer.models.quant): tiny random models of both families written in Qwen's block
format and in NVIDIA ModelOpt's, loaded back; on the CPU their logits and greedy tokens equal the
dequantized model's bit for bit. The refusals are tests/models/test_fp8_refusals.py."""

import json

import pytest
import torch

from kvbuffer import LLM
from kvbuffer.models.layers import Linear, PackedLinear, one_row_linears
from kvbuffer.models.loader import load_checkpoint
from kvbuffer.models.quant.config import BLOCK, MODELOPT, QuantConfig, read_quant_config
from kvbuffer.models.quant.fp8 import FP8, dequantize, gemm_path, has_nan_bytes, quantize
from kvbuffer.models.quant.linear import FP8Linear, FP8PackedLinear
from kvbuffer.models.quant.write import dequantize_checkpoint, quantize_model, write_checkpoint
from tests.support.tiny_models import CONFIGS, tiny_model

MOE = {
    "qwen3_5_moe": ("qwen3_5", dict(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    "nemotron_h_moe": ("nemotron_h", dict(layers_block_type=["mamba", "moe", "attention", "mamba", "mlp"])),
}
MODELS = {"qwen3_5": ("qwen3_5", {}), "nemotron_h": ("nemotron_h", {}), **MOE}
# block (16, 16) on the tiny models: several blocks per weight, partial ones at the edges (N = 4, 96, ...)
CASES = [(m, f, b) for m in MODELS for f, b in ((BLOCK, (16, 16)), (BLOCK, (128, 128)), (MODELOPT, None))]


def _written(tmp_path, model_key, fmt, block, seed=0):
    kind, overrides = MODELS[model_key]
    model = tiny_model(kind, seed=seed, **overrides)
    config = dict(CONFIGS[kind], **overrides)
    path = write_checkpoint(model, config, tmp_path / "fp8", fmt, **({"block": block} if block else {}))
    return path, config


def _greedy(path, dtype, prompts):
    llm = LLM(path, device="cpu", dtype=dtype)
    return llm.generate(prompts, max_new_tokens=6, return_logits=True), llm


@pytest.mark.parametrize("model_key, fmt, block", CASES, ids=[f"{m}-{f}-{b[0] if b else 'tensor'}" for m, f, b in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_model_is_the_dequantized_model(tmp_path, model_key, fmt, block, dtype):
    """Greedy tokens and every logit equal, bit for bit, to the model holding the dequantized weights."""
    path, _ = _written(tmp_path, model_key, fmt, block)
    reference = dequantize_checkpoint(path, tmp_path / "dequantized")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 1, 12)]
    got, llm = _greedy(path, dtype, prompts)
    want, _ = _greedy(reference, dtype, prompts)
    assert any(isinstance(m, (FP8Linear, FP8PackedLinear)) for m in llm.model.modules())
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_weights_stay_fp8_and_scales_fp32_through_casts(tmp_path, kind):
    path, _ = _written(tmp_path, kind, BLOCK, (16, 16))
    model = load_checkpoint(path, dtype=torch.bfloat16)
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert fp8
    model.to(torch.float16).float().to("cpu", torch.bfloat16)
    for m in fp8:
        assert m.weight.dtype == FP8 and m.weight_scale.dtype == torch.float32 and not m.weight.requires_grad
    assert model.lm_head.weight.dtype == torch.bfloat16  # kept unquantized, cast as the model is


def test_qwen_packed_projection_keeps_its_bf16_parts_apart(tmp_path):
    """in_proj: in_proj_qkv and in_proj_z in FP8 (one group, scales stacked), in_proj_b and in_proj_a in
    the model's dtype, outputs in the parts' order; the one-row kernel claims no FP8 projection."""
    path, _ = _written(tmp_path, "qwen3_5", BLOCK, (16, 16))
    model = load_checkpoint(path)
    packed = model.model.layers[0].linear_attn.in_proj
    assert isinstance(packed, FP8PackedLinear) and packed.parts == ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    fp8, plain = packed.groups
    assert isinstance(fp8, FP8Linear) and fp8.out_features == packed.sizes[0] + packed.sizes[1]
    assert type(plain) is Linear and plain.weight.dtype == torch.float32
    assert [g for g, _ in packed.layout] == [0, 0, 1, 1]
    claimed = one_row_linears(model)
    assert not any(isinstance(m, (FP8Linear, FP8PackedLinear)) for m in claimed)
    assert model.lm_head in claimed and plain in claimed


def test_a_part_whose_rows_do_not_fill_blocks_is_its_own_group():
    """Block scales stack only for parts whose N is a multiple of the block's: the others run alone."""
    torch.manual_seed(0)
    from kvbuffer.models.quant.load import install_fp8

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = PackedLinear(32, {"q_proj": 16, "k_proj": 8, "v_proj": 16})

    holder = Holder()
    quant = QuantConfig(BLOCK, block=(16, 16))
    tensors, ref = {}, []
    for part, n in zip(holder.qkv_proj.parts, holder.qkv_proj.sizes):
        q, s = quantize(torch.randn(n, 32), (16, 16))
        tensors[f"{part}.weight"], tensors[f"{part}.weight_scale_inv"] = q, s
        ref.append(dequantize(q, s, (16, 16)))
    install_fp8(holder, tensors, quant, {})
    packed = holder.qkv_proj
    assert [g for g, _ in packed.layout] == [0, 1, 0] and len(packed.groups) == 2
    x = torch.randn(3, 32)
    for got, w in zip(packed(x), ref):
        torch.testing.assert_close(got, x @ w.t(), rtol=0, atol=1e-5)


def test_modelopt_kv_cache_scales_are_recorded_not_applied(tmp_path):
    path, _ = _written(tmp_path, "nemotron_h", MODELOPT, None)
    assert read_quant_config(json.loads((path / "config.json").read_text()), path).fp8_kv_cache
    model = load_checkpoint(path)
    attention = model.model.layers[2].mixer
    assert attention.kv_cache_scales == {"k": 1.0, "v": 1.0}


def test_hf_quant_config_alone_declares_modelopt(tmp_path):
    """ModelOpt releases carry hf_quant_config.json; config.json's quantization_config may be absent."""
    path, _ = _written(tmp_path, "nemotron_h", MODELOPT, None)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    quant = read_quant_config(config, path)
    assert quant.kind == MODELOPT and "lm_head" in quant.excluded
    assert any(isinstance(m, FP8Linear) for m in load_checkpoint(path).modules())


def test_fp8_experts_are_dequantized_at_load(tmp_path):
    path, _ = _written(tmp_path, "qwen3_5_moe", BLOCK, (16, 16))
    experts = load_checkpoint(path).model.layers[0].mlp.experts
    for w in experts.expert_weights():  # fp32 parameters holding EXPERT_DTYPE (bf16) values
        assert w.dtype == torch.float32 and torch.equal(w, w.bfloat16().float())


@pytest.mark.parametrize("fmt", [BLOCK, MODELOPT])
def test_quantize_model_is_the_written_checkpoint_loaded(tmp_path, fmt):
    """The benchmarks' in-place conversion gives the model that writing and loading give (dense: no experts)."""
    path, config = _written(tmp_path, "qwen3_5", fmt, None if fmt == MODELOPT else (128, 128))
    loaded = load_checkpoint(path)
    converted = quantize_model(tiny_model("qwen3_5"), fmt)
    a, b = dict(loaded.named_parameters()), dict(converted.named_parameters())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n].view(torch.uint8) if a[n].dtype == FP8 else a[n],
                           b[n].view(torch.uint8) if b[n].dtype == FP8 else b[n]) for n in a)


def test_quantize_model_leaves_experts_and_keeps_dtypes():
    """In place on a bf16 MoE model: projections FP8, experts untouched, the bf16 parts in bf16."""
    kind, overrides = MOE["qwen3_5_moe"]
    model = tiny_model(kind, **overrides).to(torch.bfloat16)
    experts = [w.detach().clone() for w in model.model.layers[0].mlp.experts.expert_weights()]
    quantize_model(model, BLOCK)
    assert all(torch.equal(a, b) for a, b in zip(experts, model.model.layers[0].mlp.experts.expert_weights()))
    packed = model.model.layers[0].linear_attn.in_proj
    assert isinstance(packed, FP8PackedLinear) and packed.groups[1].weight.dtype == torch.bfloat16


def test_qwen_block_config_is_written_as_qwen_publishes_it(tmp_path):
    path, _ = _written(tmp_path, "qwen3_5", BLOCK, (128, 128))
    q = json.loads((path / "config.json").read_text())["quantization_config"]
    assert {k: q[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == \
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert "lm_head" in q["modules_to_not_convert"]
    assert "model.layers.0.linear_attn.in_proj_a" in q["modules_to_not_convert"]
    assert "model.layers.0.linear_attn.in_proj_qkv" not in q["modules_to_not_convert"]


EXCLUDED = [  # (format, list, module name, excluded?)
    (BLOCK, ["model.layers.0.linear_attn.in_proj_a"], "model.layers.0.linear_attn.in_proj_a", True),
    (BLOCK, ["in_proj_a"], "model.layers.0.linear_attn.in_proj_a", False),  # block FP8: full names only
    (BLOCK, ["lm_head"], "lm_head", True),
    (MODELOPT, ["lm_head"], "lm_head", True),
    (MODELOPT, ["mixer.in_proj"], "model.layers.3.mixer.in_proj", True),  # ModelOpt: a substring
    (MODELOPT, ["model.layers.*.mixer.out_proj"], "model.layers.12.mixer.out_proj", True),  # a wildcard
    (MODELOPT, ["model.layers.*.mixer.out_proj"], "model.layers.12.mixer.in_proj", False),
    (MODELOPT, ["layers.0.mlp"], "language_model.layers.0.mlp.down_proj", True),
    (MODELOPT, ["model.layers.1.mixer.in_proj"], "model.layers.10.mixer.in_proj", False),
]


@pytest.mark.parametrize("fmt, names, module, excluded", EXCLUDED, ids=[f"{c[0]}-{c[1][0]}-{c[2]}" for c in EXCLUDED])
def test_excluded_modules_match_as_vllm_matches_them(fmt, names, module, excluded):
    assert QuantConfig(fmt, block=(128, 128) if fmt == BLOCK else None, excluded=tuple(names)).is_excluded(module) is excluded


@pytest.mark.parametrize("n, k, block", [(1, 1, (128, 128)), (33, 70, (16, 32)), (130, 257, (128, 128)), (7, 5, (1, 5))],
                         ids=["one", "awkward", "partial-128", "per-row"])
def test_quantize_round_trip(n, k, block):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k), dtype=torch.float64).float()
    q, s = quantize(w, block)
    assert q.dtype == FP8 and s.shape == (-(-n // block[0]), -(-k // block[1])) and not has_nan_bytes(q)
    err = (dequantize(q, s, block).double() - w.double()).abs()
    assert float((err / w.abs().clamp(min=1e-3)).max()) <= 2 ** -4 + 1e-6  # e4m3: 3 mantissa bits


def test_the_cpu_takes_the_dequantize_path():
    q, s = quantize(torch.randn(128, 128), (128, 128))
    assert gemm_path(torch.randn(2, 128, dtype=torch.bfloat16), q, (128, 128), None) == "dequantize"
    assert gemm_path(torch.randn(2, 128, dtype=torch.bfloat16), q, (128, 128), None, (True, True)) == "dequantize"
