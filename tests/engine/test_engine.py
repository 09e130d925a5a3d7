"""Engine behaviour: bad inputs, waiting for slots, sampling rules, slot hygiene."""

import json

import pytest
import torch

from tests.support.hf_models import make_hf_model
from kvbuffer import LLM
from kvbuffer.engine.sampling import SamplingParams, filtered_probs
from kvbuffer.models.loader import CheckpointError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine")
    make_hf_model("qwen3_5_text").save_pretrained(path)
    return path


def test_bad_prompts_are_rejected(ckpt):
    llm = LLM(str(ckpt), device="cpu")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate([[1, 2], []])
    with pytest.raises(ValueError, match="token id 97 outside the vocabulary"):
        llm.generate([[1, 97]])
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="max_new_tokens"):
        llm.generate([[1]], max_new_tokens=0)
    assert llm.runner.caches.requests.num_free == llm.runner.spec.max_requests
    assert llm.generate([[1, 2]], max_new_tokens=3)[0].finish_reason == "length"  # still usable


def test_the_engine_says_why_its_linear_layers_run_where_they_do(ckpt):
    assert LLM(str(ckpt), device="cpu").kernels_reason == "the device is cpu"
    assert LLM(str(ckpt), device="cpu", kernels=False).kernels_reason == "kernels=False"
    with pytest.raises(ValueError, match="kernels=True, but the device is not CUDA"):
        LLM(str(ckpt), device="cpu", kernels=True)


def test_unsupported_or_broken_checkpoints(ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    with pytest.raises(CheckpointError, match="unsupported model_type 'llama'"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLM(str(tmp_path), device="cpu")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors.pop("model.layers.0.linear_attn.A_log")
    tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.0.linear_attn.A_log"):
        LLM(str(tmp_path), device="cpu")
    tensors["model.layers.0.linear_attn.A_log"] = torch.zeros(4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor model.norm.weight: checkpoint shape \\(3,\\)"):
        LLM(str(tmp_path), device="cpu")


def test_more_requests_than_slots_wait_and_match(ckpt):
    """With 2 request slots, 5 prompts run in waves; results equal one-at-a-time generation."""
    prompts = [[i + 1] * (i + 2) for i in range(5)]
    small = LLM(str(ckpt), device="cpu", max_batch=2, chunk_size=4).generate(prompts, max_new_tokens=9)
    single = [LLM(str(ckpt), device="cpu", max_batch=1, chunk_size=4).generate([p], max_new_tokens=9)[0]
              for p in prompts]
    assert [o.token_ids for o in small] == [o.token_ids for o in single]


def test_stop_tokens_and_seeded_sampling(ckpt):
    llm = LLM(str(ckpt), device="cpu")
    greedy = llm.generate([[5, 6, 7]], max_new_tokens=8, stop_token_ids=[])[0].token_ids
    stopped = llm.generate([[5, 6, 7]], max_new_tokens=8, stop_token_ids=[greedy[2]])[0]
    assert stopped.token_ids == greedy[: greedy.index(greedy[2]) + 1] and stopped.finish_reason == "stop"
    a = llm.generate([[5, 6, 7]], max_new_tokens=8, temperature=1.0, top_k=20, seed=7)[0].token_ids
    b = llm.generate([[5, 6, 7]], max_new_tokens=8, temperature=1.0, top_k=20, seed=7)[0].token_ids
    assert a == b


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, 0)
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0] + 0.01)))
    assert (p[:2] > 0).all() and (p[2:] == 0).all()
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert p[0] == 1.0


def test_engine_follows_the_tuned_chunk_policy(ckpt, tmp_path, monkeypatch):
    """chunk_size=None: the tuned policy for this GPU, head shape and batch; the default without one."""
    from kvbuffer.artifacts import runtime_versions
    from kvbuffer import gpus
    from kvbuffer.autotune.cache import ArtifactCache
    from kvbuffer.tuning import ChunkPolicy, tuning_name
    from kvbuffer.defaults import DEFAULT_CHUNK_SIZE

    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    assert LLM(str(ckpt), device="cpu").chunk_size == DEFAULT_CHUNK_SIZE  # no GPU known here (or no record)
    monkeypatch.setattr(gpus, "detect_local_gpu", lambda device=0: gpus.get_gpu("h200"))
    shape = {"family": "gdn", "Hk": 2, "Hv": 4, "K": 8, "V": 8, "dtype": "float32"}
    policy = ChunkPolicy((4, 64), (8, 24), "tuned")
    name = tuning_name("h200", "sm_90a", shape, runtime_versions())
    record = {"status": "tuned", "chunk_policy": policy.to_json(), "winners": []}
    ArtifactCache(tmp_path).put_tuning(name, record, gpu="h200",
                                       shape=shape, versions=runtime_versions())
    assert LLM(str(ckpt), device="cpu", max_batch=3).chunk_size == 8
    assert LLM(str(ckpt), device="cpu", max_batch=50).chunk_size == 24
    assert LLM(str(ckpt), device="cpu", max_batch=50, chunk_size=5).chunk_size == 5  # explicit wins


def test_unbuffered_rows_follow_a_measured_policy(ckpt, tmp_path, monkeypatch):
    """unbuffered_rows="auto" on the kernels: what a measured record says (its recurrent step was faster
    up to that batch), UNBUFFERED_ROWS without one or when the record did not time the recurrent
    step; 0 on the reference ops whatever the record says."""
    from kvbuffer.artifacts import runtime_versions
    from kvbuffer import gpus
    from kvbuffer.autotune.cache import ArtifactCache
    from kvbuffer.plan import geometry_of
    from kvbuffer.tuning import ChunkPolicy, tuning_name
    from kvbuffer.engine.choices import UNBUFFERED_ROWS, tuned_unbuffered_rows

    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    llm = LLM(str(ckpt), device="cpu")
    linear = geometry_of(llm.model).linear_shape
    assert tuned_unbuffered_rows(linear, torch.float32)[0] == UNBUFFERED_ROWS
    monkeypatch.setattr(gpus, "detect_local_gpu", lambda device=0: gpus.get_gpu("h200"))
    shape = {"family": "gdn", "Hk": 2, "Hv": 4, "K": 8, "V": 8, "dtype": "float32"}
    name = tuning_name("h200", "sm_90a", shape, runtime_versions())
    for i, (policy, want) in enumerate([(ChunkPolicy((1, 16, 64), (8, 8, 16), "tuned", 16), 16),
                                        (ChunkPolicy((1, 16), (8, 8), "tuned", 0), 0),
                                        (ChunkPolicy((1, 16), (8, 8), "tuned"), UNBUFFERED_ROWS),
                                        (ChunkPolicy((1, 16), (8, 8), "untuned", 16), UNBUFFERED_ROWS)]):
        monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path / str(i)))  # one record per cache
        record = {"status": policy.status, "chunk_policy": policy.to_json(), "winners": []}
        ArtifactCache(tmp_path / str(i)).put_tuning(name, record, gpu="h200", shape=shape, versions=runtime_versions())
        assert tuned_unbuffered_rows(linear, torch.float32)[0] == want, policy
    assert LLM(str(ckpt), device="cpu").unbuffered_rows == 0  # the reference ops
    assert LLM(str(ckpt), device="cpu", unbuffered_rows=3).runner.unbuffered_rows == 3


def test_equal_length_prompts_prefill_in_one_forward(ckpt):
    """Admitted requests with prompts of one length share each prefill forward; the tokens equal
    one-request-at-a-time generation."""
    llm = LLM(str(ckpt), device="cpu", chunk_size=4, max_batch=8)
    calls, forward = [], llm.runner._forward

    def counting(ids, batch, **kw):
        calls.append((batch.phase, tuple(ids.shape)))
        return forward(ids, batch, **kw)

    llm.runner._forward = counting
    prompts = [[i + 1] * 10 for i in range(6)] + [[7, 8, 9]]
    out = llm.generate(prompts, max_new_tokens=3)
    assert sorted(c for c in calls if c[0] == "prefill") == [("prefill", (1, 3)), ("prefill", (6, 10))]
    one = LLM(str(ckpt), device="cpu", chunk_size=4, max_batch=1)
    assert [o.token_ids for o in out] == [one.generate([p], max_new_tokens=3)[0].token_ids for p in prompts]


def test_prefill_plan_stops_at_every_flush_point():
    from kvbuffer.kernels.keys import prefill_plan

    assert prefill_plan(0, 21, 16, kernels=True) == [8, 8, 4, 1]  # chunk sizes the kernels are built for
    assert prefill_plan(3, 40, 16, kernels=False) == [13, 16, 11]
    assert prefill_plan(5, 2, 16, kernels=False) == [2]
    assert prefill_plan(15, 3, 16, kernels=True) == [1, 2]
