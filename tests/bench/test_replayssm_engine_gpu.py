"""The `replayssm` mode on a CUDA GPU, small: the servers' ReplaySSM kernels in the engine, graphed and compiled.

Run with the servers' kernels importable (docs/benchmarks.md):
PYTHONPATH=peers pytest -v tests/bench/test_replayssm_engine_gpu.py (compiles kvbuffer's kernels of the tiny shapes).
"""

import pytest
import torch

from kvbuffer import LLM
from kvbuffer.bench import e2e, replayssm_engine
from tests.support.scripted_drafter import ScriptedDrafter
from tests.support.tiny_models import tiny_model

pytestmark = pytest.mark.gpu

C = 8  # the rings' length: a power of two (decode)
C_VERIFY = 16  # >= 2 x (1 + 3 drafts) and replayssm_engine.MIN_VERIFY_RING
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 1], [7, 5, 3, 2, 6, 6, 6, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]
LONG_PROMPTS = [p + p for p in PROMPTS]  # >= C_VERIFY tokens: every request has its state from admission


def _run(llm, prompts, refs=None):
    if refs is not None:
        llm.drafter = ScriptedDrafter(refs, "some", llm.vocab_size, strict=False)
    return llm.generate(prompts, max_new_tokens=20, return_logits=True, stop_token_ids=[])


@pytest.mark.parametrize("kind, drafts", [("qwen3_5", 0), ("qwen3_5", 3), ("nemotron_h", 0)],
                         ids=["gdn-decode", "gdn-verify", "mamba2-decode"])
@pytest.mark.parametrize("ring", ["float32", "bfloat16"])
def test_replayssm_mode_matches_kvbuffer_mode(kind, drafts, ring):
    """CUDA graphs and torch.compile on (the engine's defaults on CUDA): logits within bf16 rounding of
    kvbuffer mode's, greedy tokens equal except near ties; the graphs really captured, the compiled
    forward kept."""
    from tests.gpu.test_ops_and_engine import compare_greedy

    family = "gdn" if kind == "qwen3_5" else "mamba2"
    found, note = replayssm_engine.load_kernels(family, drafts + 1)
    if found is None:
        pytest.skip(note)
    options = dict(device="cuda", dtype=torch.bfloat16, chunk_size=C_VERIFY if drafts else C, max_batch=4, max_len=96,
                   kernels=True)
    prompts = LONG_PROMPTS if drafts else PROMPTS
    own = _run(LLM(tiny_model(kind), **options), prompts)
    refs = [(p, o.token_ids) for p, o in zip(prompts, own)]
    llm = replayssm_engine.replayssm_llm(tiny_model(kind), drafts=drafts, ring_dtype=replayssm_engine.RING_DTYPES[ring],
                                         **options)
    compare_greedy(_run(llm, prompts, refs if drafts else None), own, tol=0.15)
    assert llm.runner.compiled is not None, "compile fell back"
    graphs = [g for _, g in llm.runner._multi.values() if g is not None] + [llm.runner.graphs]
    assert any(g.enabled and g.graphs for g in graphs), "no graph was captured"


def test_bench_rows_on_a_gpu(tmp_path):
    """bench decode and spec with the replayssm mode on a tiny GDN model: rows beside kvbuffer's."""
    found, note = replayssm_engine.load_kernels("gdn", 4)
    if found is None:
        pytest.skip(note)
    model = tiny_model("qwen3_5").to("cuda", torch.bfloat16)
    dec = e2e.bench_decode(model, batches=(2, 5), modes=("kvbuffer", "replayssm"), prompt_len=16, new_tokens=12,
                           chunk_size=16, device="cuda")
    assert [r["mode"] for r in dec] == ["kvbuffer", "replayssm"] * 2
    assert all(r["decode_tokens_per_s"] > 0 and r["cuda_graphs"] for r in dec)
    spec = e2e.bench_spec(model, settings=("equal",), batches=(3,), alphas=(1.0,), drafts=3,
                          modes=("kvbuffer", "replayssm"), prompt_len=16, new_tokens=12, chunk_size=16, device="cuda")
    rows = [r for r in spec if r.get("alpha") == 1.0]
    assert [r["mode"] for r in rows] == ["kvbuffer", "replayssm"]
    assert all(r["acceptance"] > 0.5 for r in rows), rows  # tiny_model's greedy path may turn at a near tie
