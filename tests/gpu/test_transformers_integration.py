"""kvbuffer.integrations.transformers on CUDA: bf16 models decode through the compiled buffered step.

The same tiny random models as the CPU test, with head dims the kernels take (multiples of 16), in
bf16 on the GPU; kernels are JIT-compiled (kvbuffer.ops.allow_jit()). Buffer entries are bf16 while
stock transformers keeps each step's state in fp32, so greedy tokens may part at a near tie: the
test requires identical tokens up to the first step whose stock top-1 / top-2 logit gap is small,
and the kvbuffer choice there must be one of the near-tied tokens. Written for any supported
transformers release (5.17 and 5.24: kvbuffer.integrations.transformers_cache reads either cache).
"""

from __future__ import annotations

import pytest
import torch
from tests.support.hf_models import make_hf_model
from tests.integrations.test_transformers_integration import C, NEW, PROMPTS, left_padded, qwen_model

import kvbuffer.integrations.transformers as kvb
from kvbuffer import ops

pytestmark = pytest.mark.gpu

NEAR_TIE = 0.05  # logit gap, with logits of std ~1
QWEN_SHAPES = {
    "qwen3_5_text": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                         linear_value_head_dim=32,
                         layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "qwen3_5_moe_text": dict(linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=32,
                             linear_value_head_dim=32, layer_types=["full_attention", "linear_attention"]),
    "qwen3_next": dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
                       linear_value_head_dim=32, layer_types=["linear_attention", "full_attention"]),
}
NEMOTRON_SHAPE = dict(layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
                      mamba_num_heads=4, mamba_head_dim=64, ssm_state_size=128, n_groups=2)


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


def cuda_model(model_type: str):
    if model_type == "nemotron_h":
        model = make_hf_model("nemotron_h", **NEMOTRON_SHAPE)
    else:
        model = qwen_model(model_type, QWEN_SHAPES[model_type])
    return model.to("cuda", torch.bfloat16)


def greedy(model, ids, mask):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float()


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h"])
@pytest.mark.parametrize("lengths", [[C], PROMPTS], ids=["b1", "b3-left-pad"])
def test_bf16_greedy_matches_up_to_near_ties(model_type, lengths):
    model = cuda_model(model_type)
    ids, mask = (t.cuda() for t in left_padded(lengths))
    tok0, logits0 = greedy(model, ids, mask)
    kvb.enable(model, chunk_size=C)
    try:
        tok1, _ = greedy(model, ids, mask)
    finally:
        kvb.disable(model)
    for row in range(len(lengths)):
        differ = (tok0[row] != tok1[row]).nonzero()
        if not len(differ):
            continue
        step = int(differ[0])
        top = logits0[row, step]
        gap = float(top.max() - top[tok1[row, step]])
        assert gap < NEAR_TIE, f"row {row} parts at step {step} where the stock margin is {gap:.3f}, not a near tie"


def test_benchmark_runs_on_the_preset_model():
    """`kvbuffer bench transformers` builds presets' Qwen3.5-9B (its first 4 layers here, to keep the
    test short) and times stock and enabled `generate` on the installed transformers release."""
    from kvbuffer.integrations.benchmark import run

    rows = run([1, 2], new_tokens=C + 2, prompt_len=C, repeats=1, chunk_size=C, layers=4)
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["stock"]["decode_tok_s"] > 0 and r["kvbuffer"]["decode_tok_s"] > 0
