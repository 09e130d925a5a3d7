"""Presence, frequency and repetition penalties: the rule against a plain loop over the vocabulary,
the engine's greedy tokens against that rule step by step, every decode path (plain, overlapped,
speculative) giving the same penalized tokens, and neutral values changing nothing."""

import math

import pytest
import torch

from kvbuffer import LLM
from kvbuffer.engine.request import Request
from kvbuffer.engine.sampling import SamplingParams, penalize
from tests.support.scripted_drafter import ScriptedDrafter
from tests.support.tiny_models import tiny_model

PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9], [3, 3, 3], [11, 12, 13, 14, 15, 16, 17]]


def reference(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """vLLM's rule, one logit at a time in Python floats."""
    out = []
    for token, x in enumerate(row):
        if token in prompt or token in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = output.count(token)
        x -= p.frequency_penalty * count
        x -= p.presence_penalty * (count > 0)
        out.append(x)
    return out


@pytest.mark.parametrize("V", [1, 37, 1001])
def test_penalize_follows_the_rule_on_each_row(V):
    g = torch.Generator().manual_seed(V)
    settings = [SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3, repetition_penalty=1.7),
                SamplingParams(),  # neutral: untouched
                SamplingParams(repetition_penalty=0.6),
                SamplingParams(frequency_penalty=2.0),
                SamplingParams(presence_penalty=-2.0, repetition_penalty=1.1)]
    n = len(settings)
    logits = torch.randn((n, V), generator=g, dtype=torch.float64) * 3
    prompts = [torch.randint(V, (int(k),), generator=g).tolist() for k in torch.randint(0, 9, (n,), generator=g)]
    outputs = [torch.randint(V, (int(k),), generator=g).tolist() for k in torch.randint(0, 15, (n,), generator=g)]
    got = penalize(logits, settings, prompts, outputs)
    for i, p in enumerate(settings):
        want = reference(logits[i].tolist(), p, prompts[i], outputs[i])
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert torch.equal(got[1], logits[1].float())


def test_neutral_rows_return_the_logits_themselves_and_low_precision_rows_widen_exactly():
    logits = torch.randn((3, 50)).to(torch.bfloat16)
    neutral = [SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)] * 3
    assert penalize(logits, neutral, [[1]] * 3, [[2]] * 3) is logits
    mixed = penalize(logits, [neutral[0], SamplingParams(frequency_penalty=1.0), neutral[0]], [[1]] * 3, [[2]] * 3)
    assert mixed.dtype == torch.float32 and torch.equal(mixed[[0, 2]], logits[[0, 2]].float())
    assert mixed[1, 2] == logits[1, 2].float() - 1.0
    assert logits.dtype == torch.bfloat16  # the caller's logits are not written


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("presence_penalty", math.nan),
                                          ("frequency_penalty", -2.01), ("repetition_penalty", 0.0),
                                          ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
                                          ("repetition_penalty", math.nan)])
def test_out_of_range_penalties_are_errors_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_penalize_checks_its_lengths():
    with pytest.raises(ValueError, match="penalize"):
        penalize(torch.zeros((2, 5)), [SamplingParams()], [[]], [[]])


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_5")


def _llm(model, **kw):
    return LLM(model, device="cpu", dtype=torch.float32, max_batch=4, max_len=96, chunk_size=4, kernels=False, **kw)


PENALTIES = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.8), dict(presence_penalty=1.0),
             dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=2.0)]


@pytest.mark.parametrize("kw", PENALTIES, ids=lambda kw: ",".join(kw))
def test_greedy_tokens_follow_the_rule_step_by_step(model, kw):
    """Each greedy token is the argmax of the raw logits penalized by the reference over the tokens before it."""
    llm = _llm(model)
    outs = llm.generate(PROMPTS, max_new_tokens=20, stop_token_ids=[], return_logits=True, **kw)
    params = SamplingParams(**kw)
    for prompt, out in zip(PROMPTS, outs):
        for i, (token, row) in enumerate(zip(out.token_ids, out.logits)):
            want = reference(row.double().tolist(), params, prompt, out.token_ids[:i])
            assert token == max(range(len(want)), key=want.__getitem__)


def test_penalties_break_greedy_repetition(model):
    llm = _llm(model)
    plain = llm.generate(PROMPTS, max_new_tokens=40, stop_token_ids=[])
    for kw in (dict(repetition_penalty=3.0), dict(presence_penalty=2.0), dict(frequency_penalty=2.0)):
        outs = llm.generate(PROMPTS, max_new_tokens=40, stop_token_ids=[], **kw)
        repeats = [len(o.token_ids) - len(set(o.token_ids)) for o in outs]
        assert sum(repeats) < sum(len(o.token_ids) - len(set(o.token_ids)) for o in plain), kw
    strong = llm.generate(PROMPTS, max_new_tokens=40, stop_token_ids=[], repetition_penalty=1e6)
    for prompt, out in zip(PROMPTS, strong):  # every seen token pushed below every unseen one
        assert len(set(out.token_ids)) == 40 and not set(out.token_ids) & set(prompt)


def test_neutral_penalties_change_nothing(model):
    llm = _llm(model)
    plain = [o.token_ids for o in llm.generate(PROMPTS, max_new_tokens=16, stop_token_ids=[])]
    neutral = llm.generate(PROMPTS, max_new_tokens=16, stop_token_ids=[], presence_penalty=0.0,
                           frequency_penalty=0, repetition_penalty=1.0)
    assert [o.token_ids for o in neutral] == plain
    assert Request(0, [1], SamplingParams(presence_penalty=0.0, repetition_penalty=1.0)).picked_on_device


def test_generate_checks_penalties_before_admitting(model):
    llm = _llm(model)
    with pytest.raises(ValueError, match="repetition_penalty"):
        llm.generate(PROMPTS, repetition_penalty=0)
    assert not llm.has_work()


def _mixed(llm, steps_kw):
    """Requests with and without penalties side by side, through add_request and step()."""
    rids = [llm.add_request(p, SamplingParams(18, stop_token_ids=(), **kw)) for p, kw in zip(PROMPTS, steps_kw)]
    got = {rid: [] for rid in rids}
    while llm.has_work():
        for out in llm.step():
            got[out.rid] += out.token_ids
    return [got[r] for r in rids]


MIXED = [{}, dict(repetition_penalty=1.5), dict(frequency_penalty=1.0, presence_penalty=0.5), {}]


def test_overlapped_and_speculative_steps_give_the_plain_penalized_tokens(model):
    """A penalized row leaves the overlapped pipeline and the in-graph greedy acceptance for the host path;
    the rows beside it keep their tokens, and every path gives the same greedy tokens."""
    plain = _mixed(_llm(model, overlap=False), MIXED)
    assert _mixed(_llm(model, overlap=True), MIXED) == plain
    for pattern in ("all", "some"):  # drafts of the penalized continuations: kept only if the rule is applied
        spec = _llm(model, speculative={"method": "ngram", "num_draft_tokens": 3})
        spec.drafter = ScriptedDrafter(list(zip(PROMPTS, plain)), pattern, model.config.vocab_size)
        assert _mixed(spec, MIXED) == plain
        stats = spec.core.speculative.stats
        assert stats.accepted > 0 and (stats.accepted == stats.proposed) == (pattern == "all")
    alone = _mixed(_llm(model), [{}] * 4)
    assert [plain[0], plain[3]] == [alone[0], alone[3]]
