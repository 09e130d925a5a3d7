"""Speculative decoding: greedy output equals plain decoding for every acceptance pattern, in both
modes; the rejection-sampling rule leaves the target distribution unchanged; n-gram drafting."""

import pytest
import torch

from tests.support.hf_models import make_hf_model
from kvbuffer import LLM
from kvbuffer.engine.sampling import SamplingParams
from kvbuffer.engine.drafters import NgramDrafter
from tests.support.scripted_drafter import ScriptedDrafter
from kvbuffer.engine.acceptance import accept_drafts
from kvbuffer.engine.config import SpeculativeConfig

C, NEW = 5, 24
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [1, 2, 3, 4, 5, 6]]


TYPES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h"]
_CHECKPOINTS = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model type -> (checkpoint dir, plain greedy continuations), built on first use."""
    def get(model_type):
        if model_type not in _CHECKPOINTS:
            path = tmp_path_factory.mktemp(model_type)
            make_hf_model(model_type).save_pretrained(path)
            plain = LLM(str(path), device="cpu", chunk_size=C, max_batch=4).generate(
                PROMPTS, max_new_tokens=NEW, stop_token_ids=[])
            _CHECKPOINTS[model_type] = path, [(p, o.token_ids) for p, o in zip(PROMPTS, plain)]
        return _CHECKPOINTS[model_type]
    return get


PATTERNS = ("all", "some", "none")
# every draft count on one Gated DeltaNet model; the drafts' extremes on every model type
CASES = [("qwen3_5_text", "kvbuffer", T, pat) for T in range(1, 9) for pat in PATTERNS] + \
        [(t, "kvbuffer", T, pat) for t in TYPES[1:] for T in (1, 8) for pat in PATTERNS] + \
        [(t, "recurrent", T, pat) for t in TYPES for T in (1, 4) for pat in PATTERNS]


@pytest.mark.parametrize("model_type, mode, T, pattern", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_speculative_greedy_equals_plain(checkpoints, model_type, mode, T, pattern):
    path, refs = checkpoints(model_type)
    llm = LLM(str(path), device="cpu", mode=mode, chunk_size=C, max_batch=4,
              speculative={"method": "ngram", "num_draft_tokens": T})
    llm.drafter = ScriptedDrafter(refs, pattern, llm.vocab_size)
    outs = llm.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[])
    assert [o.token_ids for o in outs] == [c for _, c in refs]
    rate = llm.acceptance["acceptance_rate"]
    if pattern == "all":
        assert rate == 1.0 and llm.acceptance["tokens_per_step"] > 1.0
    if pattern == "none":
        assert rate == 0.0
    assert llm.runner.caches.requests.num_free == 4  # every slot released


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-shaped"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
def test_speculation_off_above_a_batch_keeps_greedy_output(checkpoints, mode, overlap, graphs):
    """disable_above_batch 3 with 4 slots and 6 prompts: the first four decode plainly (overlapped or not;
    eagerly, or as padded and bucketed graph replays compute them), the last two speculate; every output
    is plain decoding's and only the last two's tokens were verified."""
    path, refs = checkpoints("qwen3_5_text")
    llm = LLM(str(path), device="cpu", mode=mode, chunk_size=C, max_batch=4, overlap=overlap,
              speculative={"method": "ngram", "num_draft_tokens": 3, "disable_above_batch": 3})
    if graphs:
        llm.runner.use_graphs(True, capture=False)
    llm.drafter = ScriptedDrafter(refs, "all", llm.vocab_size)
    prompts = PROMPTS + PROMPTS[:2]
    outs = llm.generate(prompts, max_new_tokens=NEW, stop_token_ids=[])
    assert [o.token_ids for o in outs] == [c for _, c in refs] + [c for _, c in refs[:2]]
    assert 0 < llm.stats.drafts.emitted <= 2 * (NEW - 1 + 3), "only the two requests that ran alone speculated"
    assert llm.acceptance["acceptance_rate"] == 1.0 and llm.acceptance["tokens_per_step"] > 1.0
    assert llm.runner.caches.requests.num_free == 4


@pytest.mark.parametrize("model_type", TYPES)
def test_ngram_drafter_end_to_end(checkpoints, model_type):
    """The real drafter on a repetitive prompt: same tokens as plain decoding."""
    path, refs = checkpoints(model_type)
    llm = LLM(str(path), device="cpu", chunk_size=C, max_batch=4, speculative={"method": "ngram", "num_draft_tokens": 4})
    outs = llm.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[])
    assert [o.token_ids for o in outs] == [c for _, c in refs]


def test_ngram_drafter_proposals():
    d = NgramDrafter(ngram_max=3)
    assert d.lookup([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert d.lookup([5, 6, 7], 3) == []
    assert d.lookup([4, 4, 4], 2) == [4]


def test_speculative_config_validation():
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_draft_tokens": 2})
    with pytest.raises(ValueError, match="unknown speculative options"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_draft_tokens": 2, "depth": 3})
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_draft_tokens": 0})


def test_rejection_sampling_preserves_the_target_distribution():
    """First emitted token after one deterministic draft is distributed as the target p."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0], [0.3, 0.1, 0.0, -1.0, 2.0]])
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(logits[0], 0)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    for draft in (0, 2):
        counts = torch.zeros(5)
        for _ in range(n):
            m, nxt = accept_drafts(logits, [draft], params, gen)
            counts[draft if m == 1 else nxt] += 1
        freq = counts / n
        # 4.5 standard errors per category
        assert torch.all((freq - p).abs() < 4.5 * torch.sqrt(p * (1 - p) / n)), (draft, freq, p)


def test_greedy_acceptance_rule():
    logits = torch.tensor([[0.0, 5.0, 0.0], [4.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    greedy = SamplingParams()
    assert accept_drafts(logits, [1, 0], greedy, None) == (2, 2)
    assert accept_drafts(logits, [1, 2], greedy, None) == (1, 0)
    assert accept_drafts(logits, [None, 0], greedy, None) == (0, 1)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "nemotron_h"])
@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
def test_mtp_drafter_keeps_greedy_output(tmp_path, model_type, mode):
    """The checkpoint's MTP head drafts; output equals plain decoding whatever it proposes."""
    from tests.support.hf_models import add_mtp_head

    make_hf_model(model_type).save_pretrained(tmp_path)
    add_mtp_head(tmp_path)
    plain = LLM(str(tmp_path), device="cpu", chunk_size=C, max_batch=4).generate(PROMPTS, max_new_tokens=NEW,
                                                                                stop_token_ids=[])
    llm = LLM(str(tmp_path), device="cpu", mode=mode, chunk_size=C, max_batch=4,
              speculative={"method": "mtp", "num_draft_tokens": 3})
    assert llm.model.mtp is not None
    outs = llm.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.acceptance["tokens_per_step"] >= 1.0


def test_mtp_without_a_head_is_a_clear_error(tmp_path):
    make_hf_model("qwen3_5_text").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="needs a checkpoint with an MTP head"):
        LLM(str(tmp_path), device="cpu", speculative={"method": "mtp", "num_draft_tokens": 2})


def test_batched_acceptance_keeps_the_target_distribution_over_two_drafts():
    """accept_sampled on 20,000 copies of one row: the first token emitted is distributed as p_0 and,
    when it was the kept draft, the second as p_1 (drafts are point masses, acceptance p(d))."""
    from kvbuffer.engine.acceptance import accept_sampled

    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0], [0.3, 0.1, 0.0, -1.0, 2.0], [0.0, 1.0, 0.0, 0.0, 0.5]])
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(logits, -1)
    n = 20000
    torch.manual_seed(3)
    kept, nxt = accept_sampled(logits.expand(n, -1, -1), [[0, 4]] * n, [params] * n, [None] * n)
    kept, nxt = torch.tensor(kept), torch.tensor(nxt)
    first = torch.where(kept >= 1, 0, nxt)
    freq = torch.bincount(first, minlength=5) / n
    assert torch.all((freq - p[0]).abs() < 4.5 * torch.sqrt(p[0] * (1 - p[0]) / n)), freq
    on = kept >= 1
    second = torch.where(kept >= 2, 4, nxt)[on]
    freq = torch.bincount(second, minlength=5) / on.sum()
    assert torch.all((freq - p[1]).abs() < 4.5 * torch.sqrt(p[1] * (1 - p[1]) / on.sum())), freq


def test_batched_acceptance_per_row():
    """Padding drafts are never kept, a certain draft always is, and a seeded row's outcome does not
    depend on the rows beside it; accept_drafts of one sampled row is the batched rule."""
    from kvbuffer.engine.sampling import seeded_generator
    from kvbuffer.engine.acceptance import accept_sampled

    sure = torch.full((3, 6), -30.0)
    sure[0, 2], sure[1, 5], sure[2, 1] = 30.0, 30.0, 30.0
    hot = SamplingParams(temperature=1.0)
    assert accept_sampled(sure[None], [[2, 5]], [hot], [None]) == ([2], [1])
    assert accept_sampled(sure[None], [[None, 5]], [hot], [None]) == ([0], [2])
    assert accept_sampled(sure[None], [[2, 3]], [hot], [None]) == ([1], [5])
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 3, 50, generator=gen)
    drafts = [[3, 7], [1, None], [8, 8], [0, 2]]
    params = [SamplingParams(temperature=0.9, top_k=20, seed=1), hot, SamplingParams(temperature=1.2, top_p=0.8),
              SamplingParams(temperature=1.0, seed=2)]

    def run(rows):
        gens = [seeded_generator(params[i].seed, "cpu") for i in rows]
        return accept_sampled(logits[rows], [drafts[i] for i in rows], [params[i] for i in rows], gens)

    alone = run([3])
    both = run([0, 1, 2, 3])
    assert (both[0][3], both[1][3]) == (alone[0][0], alone[1][0])
    assert accept_drafts(logits[3], drafts[3], params[3], seeded_generator(2, "cpu")) == (alone[0][0], alone[1][0])
    with pytest.raises(ValueError, match="T = 2 drafts"):
        accept_sampled(logits[:1], [[1]], [hot], [None])
