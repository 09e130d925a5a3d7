"""The decode step as CUDA graphs replay it: padded to a row bucket, attention window fixed to a
context bucket, inputs in one transfer, scatters that ignore padding rows. Checked eagerly on CPU
(StepGraphs(capture=False)); tests/gpu/test_ops_and_engine.py captures it for real."""

import pytest
import torch

from tests.support.hf_models import make_hf_model
from kvbuffer import LLM
from kvbuffer.engine.graphs import StepGraphs, context_bucket, row_bucket
from kvbuffer.rows import put_rows


def test_buckets():
    assert [row_bucket(n, 1024) for n in (1, 2, 3, 5, 8, 9, 17, 64, 65, 257, 300)] == \
        [1, 2, 4, 8, 8, 16, 24, 64, 96, 320, 320]
    assert row_bucket(300, 290) == 290  # never more rows than the pools hold
    assert [context_bucket(n, 2048) for n in (1, 256, 257, 2048)] == [256, 256, 512, 2048]
    assert context_bucket(300, 280) == 280


@pytest.mark.parametrize("slots", [[3, 0, -1, -1], [3, -1, 0, -1], [-1, 3, -1, 0], [-1, -1, -1, -1]])
def test_put_rows_ignores_padding_rows(slots):
    """Padding rows (slot -1, clamped to 0) must not disturb slot 0 or any real row's write,
    wherever they sit in the batch."""
    gen = torch.Generator().manual_seed(0)
    dst = torch.randn(6, 3, 2, generator=gen)
    slots = torch.tensor(slots)
    real = slots >= 0
    values = torch.randn(4, 3, 2, generator=gen)
    expect = dst.clone()
    for b in range(4):
        if real[b]:
            expect[slots[b]] = values[b]
    put_rows(dst, (slots.clamp(min=0).long(),), values, real)
    torch.testing.assert_close(dst, expect, rtol=0, atol=0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for kind in ("qwen3_5_text", "nemotron_h"):
        path = tmp_path_factory.mktemp(kind)
        make_hf_model(kind).save_pretrained(path)
        out[kind] = path
    return out


@pytest.mark.parametrize("kind", ["qwen3_5_text", "nemotron_h"])
@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
def test_padded_bucketed_decode_equals_plain(ckpts, kind, mode):
    """5 ragged requests padded to 8 rows, context bucketed: tokens and logits equal the plain step's."""
    prompts = [[(7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((1, 3, 4, 5, 17))]
    kw = dict(device="cpu", mode=mode, chunk_size=4, max_batch=6, max_len=80)
    plain = LLM(str(ckpts[kind]), **kw).generate(prompts, max_new_tokens=12, return_logits=True)
    llm = LLM(str(ckpts[kind]), **kw)
    r = llm.runner
    r.graphs = StepGraphs(r._decode_forward, r.inputs, r.spec.max_len, capture=False)
    padded = llm.generate(prompts, max_new_tokens=12, return_logits=True)
    for a, b in zip(plain, padded):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits):
            torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    assert r.caches.requests.num_free == r.spec.max_requests


def test_cuda_graphs_option_is_checked(ckpts):
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        LLM(str(ckpts["qwen3_5_text"]), device="cpu", cuda_graphs="yes")
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        LLM(str(ckpts["qwen3_5_text"]), device="cpu", cuda_graphs=True)
    assert LLM(str(ckpts["qwen3_5_text"]), device="cpu").cuda_graphs is False
