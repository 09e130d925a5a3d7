"""The engine's fast paths on CUDA: verify and prefill forwards captured as CUDA graphs (bit-identical
to the same padded, bucketed forwards run eagerly), speculative greedy output unchanged by them.
CPU counterparts: tests/engine/test_graphs.py."""

import pytest
import torch

from kvbuffer import ops

pytestmark = pytest.mark.gpu

C = 8
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


@pytest.fixture(autouse=True)
def capture_at_first_use(monkeypatch):
    """Every bucket is captured the first time it runs (the engine waits for a bucket's third use), so
    the short runs here replay graphs of every phase."""
    from kvbuffer.engine import runner

    monkeypatch.setattr(runner, "CAPTURE_AFTER", 0)


def _llm(kind, mode, *, graphs, capture=True, T=0, spec_options=None, max_batch=4, **kw):
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM

    spec = {"method": "ngram", "num_draft_tokens": T, **(spec_options or {})} if T else None
    llm = LLM(tiny_model(kind), device="cuda", dtype=torch.bfloat16, mode=mode, chunk_size=C, max_batch=max_batch,
              max_len=96, kernels=True, cuda_graphs=False, speculative=spec, max_prefill_tokens=8, **kw)
    if graphs:
        llm.runner.use_graphs(True, capture=capture)
    return llm


def _run(llm, refs=None):
    from tests.support.scripted_drafter import ScriptedDrafter

    if refs is not None:
        llm.drafter = ScriptedDrafter(refs, "some", llm.vocab_size, strict=False)
    return llm.generate(PROMPTS, max_new_tokens=20, return_logits=True, stop_token_ids=[])


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_graphed_verify_and_prefill_bit_identical_to_eager(kind, mode):
    """Speculative decoding (3 drafts, some accepted; prefill in chunks of 8 tokens) with every
    forward captured vs the same padded, bucketed forwards run eagerly: identical tokens, logits
    bit for bit; verify and prefill graphs were really captured."""
    plain = _run(_llm(kind, mode, graphs=False))
    refs = [(p, o.token_ids) for p, o in zip(PROMPTS, plain)]
    eager = _run(_llm(kind, mode, graphs=True, capture=False, T=3), refs)
    llm = _llm(kind, mode, graphs=True, T=3)
    got = _run(llm, refs)
    phases = {phase for (phase, _), (_, g) in llm.runner._multi.items() if g.enabled and g.graphs}
    assert phases == {"prefill", "verify"}, f"graphs captured only for {phases}"
    for a, b in zip(got, eager):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits):
            torch.testing.assert_close(la, lb, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_graphed_speculative_greedy_equals_plain(kind, mode):
    """Greedy output of graphed speculative decoding equals plain (graphed) decoding's, up to bf16
    near ties (verify runs other GEMM shapes; tolerance as in tests/gpu/test_conv1d_kernels.py)."""
    from tests.gpu.test_ops_and_engine import compare_greedy

    plain = _run(_llm(kind, mode, graphs=True))
    refs = [(p, o.token_ids) for p, o in zip(PROMPTS, plain)]
    llm = _llm(kind, mode, graphs=True, T=4)
    compare_greedy(_run(llm, refs), plain, tol=0.15)
    assert llm.acceptance["acceptance_rate"] > 0


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
def test_speculation_off_above_a_batch_on_graphs(mode):
    """disable_above_batch 1, two slots, three prompts: the first two decode plainly (graphed, overlapped),
    the last one alone speculates (graphed verify); greedy output is plain decoding's up to bf16 near ties."""
    from tests.gpu.test_ops_and_engine import compare_greedy

    plain = _run(_llm("qwen3_5", mode, graphs=True))
    refs = [(p, o.token_ids) for p, o in zip(PROMPTS, plain)]
    llm = _llm("qwen3_5", mode, graphs=True, T=4, spec_options={"disable_above_batch": 1}, max_batch=2)
    compare_greedy(_run(llm, refs), plain, tol=0.15)
    assert 0 < llm.stats.drafts.emitted <= 20 + 4, "only the request that ran alone speculated"
    assert llm.runner.graphs.graphs, "the plain steps replayed captured graphs"


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_compiled_step_matches_uncompiled(kind, mode):
    """The fused step (decode and verify compiled by Inductor, inside kvbuffer's CUDA graphs) vs the
    unfused one (graphs on, no compile): logits within bf16 rounding (Inductor fuses in fp32 what
    eager rounds to bf16 between ops), greedy tokens equal except at near ties, plain and speculative;
    the compiled forward really ran (it was not dropped after a failed capture)."""
    from tests.gpu.test_ops_and_engine import compare_greedy

    torch._dynamo.reset()  # this test's compilations start afresh (Dynamo's per-code cache is bounded)
    unfused = _run(_llm(kind, mode, graphs=True, compile=False))
    refs = [(p, o.token_ids) for p, o in zip(PROMPTS, unfused)]
    llm = _llm(kind, mode, graphs=True, compile=True)
    compare_greedy(_run(llm), unfused, tol=0.15)
    spec = _llm(kind, mode, graphs=True, compile=True, T=3)
    compare_greedy(_run(spec, refs), unfused, tol=0.15)
    assert llm.runner.compiled is not None and spec.runner.compiled is not None, "compile fell back"


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_warm_up_leaves_no_compilation_for_later_decode_steps(kind):
    """After LLM.warm_up a compiled engine decodes batches of 1, 3 and 4 rows, with contexts past the
    first 256-position bucket, without compiling again (Dynamo's graph count stays). That its padding
    rows write nothing and change no output is checked on the CPU (tests/engine/test_graphs.py)."""
    from torch._dynamo.utils import counters

    from kvbuffer import LLM
    from tests.support.tiny_models import tiny_model

    torch._dynamo.reset()
    long_prompts = [p * 24 for p in PROMPTS]  # 24-312 tokens: decode windows in both of the first buckets
    llm = LLM(tiny_model(kind), device="cuda", dtype=torch.bfloat16, chunk_size=C, max_batch=4, max_len=400,
              kernels=True, compile=True)
    llm.warm_up()
    compiled = counters["stats"]["unique_graphs"]
    for batch in (long_prompts[:1], long_prompts, long_prompts + PROMPTS[:1]):
        llm.generate(batch, max_new_tokens=6, stop_token_ids=[])
    assert counters["stats"]["unique_graphs"] == compiled, "a decode step compiled after the warm-up"
    assert llm.runner.compiled is not None, "compile fell back"


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_peers_backend_on_their_kernels_matches_recurrent(kind):
    """kvbuffer.bench.peers on FLA's / mamba_ssm's real kernels (CUDA graphs on, speculative too) vs
    kvbuffer's recurrent mode: logits within bf16 rounding, greedy tokens equal except near ties."""
    from tests.gpu.test_ops_and_engine import compare_greedy
    from kvbuffer.bench.peers import PeersBackend, load_peers, reserve_pad_slot

    found = load_peers()
    if found["gdn" if kind == "qwen3_5" else "mamba2"] is None:
        pytest.skip("the peer package for this family is not installed")
    own = _run(_llm(kind, "recurrent", graphs=True))
    refs = [(p, o.token_ids) for p, o in zip(PROMPTS, own)]
    for T in (0, 3):
        llm = _llm(kind, "recurrent", graphs=True, T=T, max_states=reserve_pad_slot(4))
        llm.backend = llm.runner.backend = PeersBackend(found["gdn"], found["mamba2"])
        compare_greedy(_run(llm, refs if T else None), own, tol=0.15)


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_overlapped_steps_equal_synchronous_ones(kind, mode):
    """Greedy decode steps queued before the last one's tokens are read (kvbuffer.engine.overlap),
    captured graphs replayed with tokens fed on the device: the same tokens as synchronous steps,
    bit for bit (same graphs, same kernels), with more prompts than slots and a stop token."""
    prompts = PROMPTS + [[5, 5, 1], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2], [1, 1]]
    sync = _llm(kind, mode, graphs=True, overlap=False).generate(prompts, max_new_tokens=24, stop_token_ids=[])
    stop = sync[0].token_ids[5]
    for stops in ([], [stop]):
        want = _llm(kind, mode, graphs=True, overlap=False).generate(prompts, max_new_tokens=24, stop_token_ids=stops)
        llm = _llm(kind, mode, graphs=True, overlap=True)
        got = llm.generate(prompts, max_new_tokens=24, stop_token_ids=stops)
        assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
        assert llm.runner.graphs.graphs, "no decode graph was captured"
        assert llm.runner.caches.requests.num_free == llm.runner.spec.max_requests


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_device_side_acceptance_equals_the_hosts(kind, mode):
    """Greedy speculative steps accepted and committed inside the captured verify graph
    (kvbuffer.engine.commit) vs the host's acceptance (return_logits forces it): the same tokens,
    since the verify forwards are the same; the commit graphs were really captured."""
    plain = _run(_llm(kind, mode, graphs=True))
    refs = [(p, o.token_ids) for p, o in zip(PROMPTS, plain)]
    host = _run(_llm(kind, mode, graphs=True, T=3), refs)
    from tests.support.scripted_drafter import ScriptedDrafter

    llm = _llm(kind, mode, graphs=True, T=3)
    llm.drafter = ScriptedDrafter(refs, "some", llm.vocab_size, strict=False)
    got = llm.generate(PROMPTS, max_new_tokens=20, stop_token_ids=[])
    assert [o.token_ids for o in got] == [o.token_ids for o in host]
    keys = [k for (phase, _), (_, g) in llm.runner._multi.items() if phase == "verify" and g.enabled for k in g.graphs]
    assert any(k[-1] is True for k in keys), f"no verify graph with the commit inside was captured: {keys}"
    assert llm.runner.caches.requests.num_free == llm.runner.spec.max_requests
