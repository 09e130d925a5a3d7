"""Verify and prefill forwards as CUDA graphs replay them, checked eagerly on CPU
(ModelRunner.use_graphs(True, capture=False)): inputs packed in one transfer, rows padded to a
bucket, the attention window bucketed. Greedy tokens and logits equal the plain engine's, with
speculative decoding in both modes. tests/gpu/test_engine_perf.py captures them for real."""

import pytest
import torch

from kvbuffer import LLM
from kvbuffer.engine.graphs import StepInputs, split_view, step_columns
from tests.support.scripted_drafter import ScriptedDrafter
from tests.engine.test_decode_graphs import ckpts  # noqa: F401  (the tiny checkpoints fixture)

C, NEW = 4, 14
PROMPTS = [[(7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((1, 3, 6, 5, 17))]


def test_step_columns_pack_rows_of_tokens():
    """T id columns, then positions, slots, state slots, fills, cached; padding rows read nothing."""
    cols = step_columns([[5, 6, 7], [8, 9, 10]], [4, 11], [0, 2], [-1, 1], [3, 0], [4, 11])
    inputs = StepInputs(4, torch.device("cpu"), tokens=3)
    view = inputs.upload(cols, 3)
    ids, positions, slots, state_slots, lengths, cached = split_view(view, 3)
    assert ids.tolist() == [[5, 6, 7], [8, 9, 10], [0, 0, 0]]
    assert positions.tolist() == [[4, 5, 6], [11, 12, 13], [0, 1, 2]]
    assert slots.tolist() == [0, 2, -1] and state_slots.tolist() == [-1, 1, -1]
    assert lengths.tolist() == [3, 0, 0] and cached.tolist() == [4, 11, 0]


def test_a_long_prompts_columns_upload_with_their_padding_rows():
    """Thousands of token columns: the rows given come back as they were, each padding row reads token 0
    at positions 0 .. T-1, slot -1 (one padding copy for all the columns, as for a decode step's few)."""
    T = 1000
    ids = [[(7 * t + r) % 97 for t in range(T)] for r in range(2)]
    inputs = StepInputs(4, torch.device("cpu"), tokens=T)
    got = split_view(inputs.upload(step_columns(ids, [5, 0], [1, 3], [0, 2], [2, 0], [5, 0]), 4), T)
    assert got[0].tolist() == ids + [[0] * T] * 2
    assert got[1][2:].tolist() == [list(range(T))] * 2 and got[2].tolist() == [1, 3, -1, -1]
    assert got[3].tolist() == [0, 2, -1, -1] and got[4].tolist() == [2, 0, 0, 0] and got[5].tolist() == [5, 0, 0, 0]


@pytest.mark.parametrize("bad, match", [(dict(columns=2), "expected 8 lists"), (dict(rows=5), "do not fit 4"),
                                        (dict(rows=1), "padded to 1")])
def test_step_inputs_reject_bad_columns(bad, match):
    inputs = StepInputs(4, torch.device("cpu"), tokens=3)
    cols = step_columns([[5, 6, 7], [8, 9, 10]], [4, 11], [0, 2], [-1, 1], [3, 0], [4, 11])
    with pytest.raises(ValueError, match=match):
        inputs.upload(cols[:bad["columns"]] if "columns" in bad else cols, bad.get("rows", 3))
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        StepInputs(4, torch.device("cpu"), tokens=0)


def _generate(path, mode, graphs, refs=None, T=0):
    spec = {"method": "ngram", "num_draft_tokens": T} if T else None
    llm = LLM(str(path), device="cpu", mode=mode, chunk_size=C, max_batch=6, max_len=80, speculative=spec,
              max_prefill_tokens=16)
    if graphs:
        llm.runner.use_graphs(True, capture=False)
    if refs is not None:
        llm.drafter = ScriptedDrafter(refs, "some", llm.vocab_size)
    return llm, llm.generate(PROMPTS, max_new_tokens=NEW, return_logits=True, stop_token_ids=[])


@pytest.mark.parametrize("kind", ["qwen3_5_text", "nemotron_h"])
@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
def test_graphed_prefill_and_verify_equal_plain(ckpts, kind, mode):
    """5 ragged requests padded to 8 rows: prefill chunks, verify steps (3 drafts, some accepted)
    and decode through the graph path give the plain engine's tokens and logits."""
    _, plain = _generate(ckpts[kind], mode, graphs=False)
    refs = [(p, o.token_ids) for p, o in zip(PROMPTS, plain)]
    llm, spec = _generate(ckpts[kind], mode, graphs=True, refs=refs, T=3)
    assert [o.token_ids for o in spec] == [c for _, c in refs]
    assert llm.acceptance["acceptance_rate"] > 0
    assert {p for p, _ in llm.runner._multi} == {"prefill", "verify"}
    _, graphed = _generate(ckpts[kind], mode, graphs=True)
    for a, b in zip(plain, graphed):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits):
            torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    assert llm.runner.caches.requests.num_free == llm.runner.spec.max_requests


@pytest.mark.slow  # torch.compile from a cold Inductor cache: minutes on a 2-core CPU
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_compiled_decode_equals_eager(kind):
    """The decode forward under torch.compile (Inductor, the state ops as custom-op graph nodes as on
    CUDA: KernelBackend, whose ops run the reference on CPU) vs eager: tokens equal, logits within
    fp32 rounding. One Inductor compilation per family (about a minute on two cores)."""
    from tests.support.tiny_models import tiny_model

    from kvbuffer.runtime.backend import KernelBackend

    def run(compile):
        llm = LLM(tiny_model(kind), device="cpu", chunk_size=4, max_batch=4, compile=compile)
        llm.runner.backend = KernelBackend()
        return llm, llm.generate(PROMPTS[:3], max_new_tokens=6, return_logits=True, stop_token_ids=[])

    _, eager = run(False)
    llm, got = run(True)
    assert llm.compiled and llm.runner.compiled is not None
    for a, b in zip(eager, got):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits):
            torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)


def test_compile_option_is_checked(ckpts):
    with pytest.raises(ValueError, match="compile must be True, False or 'auto'"):
        LLM(str(ckpts["qwen3_5_text"]), device="cpu", compile="yes")
    assert LLM(str(ckpts["qwen3_5_text"]), device="cpu").compiled is False  # "auto": on CUDA with CUDA graphs only


@pytest.mark.parametrize("unbuffered_rows", [0, 1])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_warm_up_writes_nothing_and_changes_no_output(kind, graphs, unbuffered_rows, monkeypatch):
    """LLM.warm_up runs decode forwards of padding rows only (two row counts of buffered steps, and
    one row unbuffered where those are on; two context buckets), and where prompts fuse (forced here;
    on CUDA with compile) a prompt forward of one padding row too long to graph, through every fused
    region: every cache tensor is bit for bit what it was, and the outputs that follow are the ones
    without it."""
    from tests.support.tiny_models import tiny_model

    from kvbuffer.engine.graphs import row_bucket
    from kvbuffer.models import fused

    regions = []  # the regions run eagerly here (their compiled form has its own tests)
    monkeypatch.setattr(fused, "_region", lambda fn, *args: regions.append(fn.__name__) or fn(*args))

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]

    def llm():
        engine = LLM(tiny_model(kind), device="cpu", chunk_size=4, max_batch=4, max_len=300,
                     unbuffered_rows=unbuffered_rows)
        if graphs:
            engine.runner.use_graphs(True, capture=False)  # the padded, bucketed forwards a replay computes
        return engine

    want = [o.token_ids for o in llm().generate(prompts, max_new_tokens=8, stop_token_ids=[])]
    warmed = llm()
    before = {k: v.clone() for k, v in warmed.runner.caches.tensors().items()}
    calls = []
    forward = warmed.runner._decode_forward
    warmed.runner._decode_forward = lambda view, window, *mode: (calls.append((view.shape[1], window, *mode))
                                                                 or forward(view, window, *mode))
    if graphs:
        warmed.runner.graphs.forward = warmed.runner._decode_forward
    warmed.runner.fuse_prompts = True
    warmed.warm_up()
    fusing = {"qwen3_5": {"_rms_norm", "_add_rms_norm", "_silu_mul", "_gated_norm", "_norm_rope", "_sigmoid_mul"},
              "nemotron_h": {"_grouped_gated_norm"}}[kind]
    assert set(regions) == fusing
    warmed.runner.fuse_prompts = False
    rows = [(1, "recurrent")] if unbuffered_rows else []
    rows += [(n,) for n in (unbuffered_rows + 1, unbuffered_rows + 2)]
    shown = lambda n: row_bucket(n, 4) if graphs else n  # noqa: E731
    assert set(calls) == {(shown(n), w, *m) for n, *m in rows for w in (256, 300)}
    for name, t in warmed.runner.caches.tensors().items():
        same = (t == before[name]) | (t.isnan() & before[name].isnan())
        assert bool(same.all()), name
    assert [o.token_ids for o in warmed.generate(prompts, max_new_tokens=8, stop_token_ids=[])] == want


def test_collection_is_paused_during_a_capture_and_restored_after():
    """The cycle collector is off inside collection_paused (a capture must not destroy other graphs),
    back on after it, also when the capture raises, and left off when it was off."""
    import gc

    from kvbuffer.engine.graphs import collection_paused

    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collection_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
