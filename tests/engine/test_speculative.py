"""Speculative decoding: greedy output equals plain decoding for every acceptance pattern, in both
modes; the rejection-sampling rule leaves the target distribution unchanged; n-gram drafting."""

import pytest
import torch

from tests.support.hf_models import make_hf_model
from kvbuffer import LLM
from kvbuffer.engine.sampling import SamplingParams
from kvbuffer.engine.drafters import NgramDrafter
from tests.support.scripted_drafter import ScriptedDrafter
from kvbuffer.engine.speculative import SpeculativeConfig, accept_drafts

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
