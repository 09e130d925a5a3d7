"""Acceptance and commit on the device (kvbuffer.engine.commit): the same drafts kept, the same
caches and books as the host's accept_drafts + commit, padding drafts never kept."""

import pytest
import torch

from kvbuffer import LLM
from kvbuffer.engine.commit import PADDING_DRAFT, greedy_accepts
from kvbuffer.engine.acceptance import accept_drafts
from kvbuffer.engine.sampling import SamplingParams
from tests.support.tiny_models import tiny_model


def test_greedy_accepts_the_leading_agreeing_drafts():
    logits = torch.full((4, 4, 6), -1.0)
    picks = [[2, 3, 4, 5], [2, 3, 4, 5], [1, 1, 1, 1], [5, 0, 0, 0]]
    for b, row in enumerate(picks):
        logits[b, torch.arange(4), torch.tensor(row)] = 1.0
    ids = torch.tensor([[9, 2, 3, 4], [9, 2, 0, 4], [9, PADDING_DRAFT, 1, 1], [9, 5, PADDING_DRAFT, PADDING_DRAFT]])
    got_picks, accepted = greedy_accepts(ids, logits)
    assert got_picks.tolist() == picks and accepted.tolist() == [3, 1, 0, 1]
    for b in range(4):  # the host's rule agrees
        drafts = [None if t == PADDING_DRAFT else t for t in ids[b, 1:].tolist()]
        assert accept_drafts(logits[b], drafts, SamplingParams(), None) == (accepted[b], picks[b][accepted[b]])


def _prefilled(kind, mode, prompts, C):
    llm = LLM(tiny_model(kind), device="cpu", dtype=torch.float32, mode=mode, chunk_size=C, max_batch=4,
              max_len=64, kernels=False, speculative={"method": "ngram", "num_draft_tokens": 3})
    rids = [llm.add_request(p, SamplingParams(40, stop_token_ids=())) for p in prompts]
    llm.step()  # admitted and prefilled; this first step drafts nothing the tests rely on
    return llm, [llm.scheduler.running[i] for i in range(len(rids))]


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_device_commit_equals_the_hosts(kind, mode):
    """Steps of 3 drafts (some right, some wrong, some missing) on two engines: verify + host accept +
    commit on one, verify_greedy on the other. Every cache tensor equal bit for bit after each step,
    the books too, with buffers that reach C = 4 and fold inside the step."""
    prompts = [[3, 1, 4, 1, 5], [7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2]]
    host, hreqs = _prefilled(kind, mode, prompts, 4)
    dev, dreqs = _prefilled(kind, mode, prompts, 4)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        truth = [r.context for r in hreqs]
        drafts = []
        for b in range(len(prompts)):  # random drafts: token 0..3 (small vocabulary hits) or none
            d = [int(t) for t in torch.randint(0, 4, (3,), generator=g)]
            drafts.append(d[:(step + b) % 4] + [None] * (3 - (step + b) % 4))
        logits = host.runner.verify(hreqs, drafts)
        kept = [accept_drafts(logits[b], drafts[b], SamplingParams(), None)[0] + 1 for b in range(len(prompts))]
        host.runner.commit(hreqs, kept)
        picks, accepted, _ = dev.runner.verify_greedy(dreqs, drafts)
        assert [m + 1 for m in accepted] == kept
        for hr, dr, m, p in zip(hreqs, dreqs, accepted, picks):
            assert (hr.cached, hr.state_slot) == (dr.cached, dr.state_slot)
            hr.output += drafts[hreqs.index(hr)][:m] + [p[m]]
            dr.output += drafts[dreqs.index(dr)][:m] + [p[m]]
        assert [r.context for r in hreqs] != truth
        for name, t in host.runner.caches.tensors().items():
            assert torch.equal(t, dev.runner.caches.tensors()[name]), f"{name} differs after step {step}"
        if host.runner.caches.buffers is not None:
            assert [host.runner._fill(r) for r in hreqs] == [dev.runner._fill(r) for r in dreqs]


def test_a_step_with_sampled_rows_accepts_on_the_host():
    """Mixed batches take the host path; greedy outputs stay those of plain decoding."""
    model = tiny_model("qwen3_5")
    plain = LLM(model, device="cpu", dtype=torch.float32, chunk_size=4, max_batch=4, kernels=False)
    want = [o.token_ids for o in plain.generate([[1, 2, 3], [4, 5]], max_new_tokens=12, stop_token_ids=[])]
    llm = LLM(model, device="cpu", dtype=torch.float32, chunk_size=4, max_batch=4, kernels=False,
              speculative={"method": "ngram", "num_draft_tokens": 2})
    rids = [llm.add_request(p, SamplingParams(12, stop_token_ids=())) for p in ([1, 2, 3], [4, 5])]
    rids.append(llm.add_request([6, 6], SamplingParams(12, temperature=1.0, seed=3, stop_token_ids=())))
    got = {rid: [] for rid in rids}
    while llm.has_work():
        for out in llm.step():
            got[out.rid] += out.token_ids
    assert [got[r] for r in rids[:2]] == want


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
def test_a_padding_only_verify_with_its_commit_writes_nothing(mode):
    """A CUDA-graph warm-up runs the verify forward, commit included, on padding rows only: every
    cache tensor must stay as it was (the live requests' states above all)."""
    prompts = [[3, 1, 4, 1, 5], [7, 7], [2, 7, 1], [5]]  # every slot live, the last one too
    plain = LLM(tiny_model("qwen3_5"), device="cpu", dtype=torch.float32, chunk_size=4, max_batch=4, max_len=64,
                kernels=False).generate(prompts, max_new_tokens=12, stop_token_ids=[])
    llm, reqs = _prefilled("qwen3_5", mode, prompts, 4)
    for _ in range(2):  # right drafts: each row keeps several, so its state is not its first draft's
        drafts = [(p + o.token_ids)[len(r.context):len(r.context) + 3] for p, o, r in zip(prompts, plain, reqs)]
        picks, accepted, _ = llm.runner.verify_greedy(reqs, drafts)
        assert min(accepted) >= 1
        for r, ds, m, pk in zip(reqs, drafts, accepted, picks):
            r.output += ds[:m] + [pk[m]]
    before = {k: t.clone() for k, t in llm.runner.caches.tensors().items()}
    inputs, _ = llm.runner._inputs_for("verify", 4)
    with torch.inference_mode():  # as the engine runs its forwards
        view = inputs.upload([[] for _ in inputs.padding], 3)  # three padding rows, no real one
        llm.runner._view_forward("verify", 4, view, 16, 0, False, True)
    for name, t in llm.runner.caches.tensors().items():
        assert torch.equal(t, before[name]), f"{name} changed"
