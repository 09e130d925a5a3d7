"""The benchmarks' CPU-checkable parts: rotation sizes, pools, the alpha drafter, the preset table."""

import pytest
import torch

from kvbuffer import LLM, presets
from kvbuffer.autotune import models
from kvbuffer.bench import e2e, kernels, timing
from kvbuffer.bench.drafter import ReferenceDrafter, expected_accepted
from kvbuffer.plan import GEOMETRIES


@pytest.mark.parametrize("per_set, cache, multiple, want", [
    (10, 25, 1, 3), (10, 30, 1, 4), (100, 30, 1, 2), (10, 25, 4, 4), (7, 0, 1, 2)])
def test_sets_exceed_the_cache(per_set, cache, multiple, want):
    n = timing.sets_to_exceed(per_set, cache, multiple_of=multiple)
    assert n == want and n * per_set > cache and n % multiple == 0


def test_sets_reject_bad_sizes():
    with pytest.raises(ValueError, match="bytes_per_set"):
        timing.sets_to_exceed(0, 10)


def test_timing_line():
    t = timing.Timing(1e-5, 64, 20, 123e6)
    assert t.method == "cuda-graph, 64 launches, median of 20 replays, inputs rotated over 123 MB"
    assert t.us == pytest.approx(10.0)


@pytest.mark.parametrize("preset", ["qwen3.5-9b", "nemotron-3-nano"])
def test_pools_rotate_windows_and_fills(preset):
    heads = dict(kernels.heads_of(preset), Hv=8)  # fewer heads: small CPU tensors
    C = 4
    pools = kernels.Pools(heads, 3, cap=6, C=C, device="cpu", cache_bytes=1e6)
    assert pools.rotated_bytes > 1e6 and pools.sets % C == 0 and pools.sets % pools.windows == 0
    seen = {(int(pools.state_slots(s)[0]), int(pools.lengths(s)[0])) for s in range(pools.sets)}
    assert len(seen) == pools.sets  # every (window, fill) pairing once
    assert all(not torch.equal(pools.state_slots(s), pools.buffer_slots(s)) for s in range(pools.sets))
    assert pools.state_window(1).data_ptr() == pools.state[pools.state_slots(1)[0]].data_ptr()
    assert pools.step_bytes("recurrent") == 2 * pools.step_bytes("read")
    with pytest.raises(ValueError, match="kind"):
        pools.step_bytes("nope")


@pytest.fixture(scope="module")
def tiny():
    model = e2e.random_model("tiny-qwen", "cpu", torch.float32)
    prompts = e2e.random_prompts(3, 12, model.config.vocab_size, seed=1)
    refs = e2e.greedy_references(model, prompts, tokens=12, device="cpu", chunk_size=6, kernels=False,
                                 cuda_graphs=False)
    return model, prompts, refs


@pytest.mark.parametrize("alpha, rate", [(1.0, 1.0), (0.0, 0.0), (0.6, None)])
def test_alpha_drafter_acceptance_and_exact_output(tiny, alpha, rate):
    model, prompts, refs = tiny
    T = 3
    llm = LLM(model, device="cpu", chunk_size=6, max_batch=3, max_len=40, kernels=False,
              speculative={"method": "ngram", "num_draft_tokens": T})
    llm.drafter = ReferenceDrafter(refs, alpha, model.config.vocab_size, seed=3)
    outs = llm.generate(prompts, max_new_tokens=8, stop_token_ids=[])
    for p, o in zip(prompts, outs):
        assert o.token_ids == refs[tuple(p)][:8]  # the engine verified every draft: output = plain greedy
    acc = llm.acceptance["acceptance_rate"]
    assert acc == rate if rate is not None else 0.0 < acc < 1.0
    assert not llm.drafter.diverged


@pytest.mark.parametrize("preset", ["qwen3.5-9b", "nemotron-3-nano"])
def test_untuned_kernels_get_the_runtimes_tunables(preset):
    """Without --configs the kernel benchmarks time what the JIT would build, not the template's signature
    defaults (for GDN those were BV 64 without a register cap: 1.5x slower at B = 1024)."""
    import importlib

    from kvbuffer.kernels.lookup import untuned_tunables

    heads = kernels.heads_of(preset)
    tiles = importlib.import_module(f"kvbuffer.tiles.{heads['family']}")
    cfg = kernels.kernel_configs(heads)
    assert cfg["buffered"] == cfg["verify"] == tiles.BUFFERED_BEST
    assert cfg["recurrent"] == untuned_tunables(heads["family"], "recurrent", heads["K"], heads["V"])
    # --configs: a verify follows the given step unless named itself
    step = {"BV": 32, "threads": 64}
    assert kernels.kernel_configs(heads, {"buffered": step})["verify"] == step
    assert kernels.kernel_configs(heads, {"buffered": step, "verify": {"BV": 64}})["verify"] == {"BV": 64}


def test_tuned_kernels_follow_the_record_per_bucket():
    """--tuned: each batch gets the winners of its bucket (the smallest bucket that holds it, the largest
    beyond), the decode step of the benchmark's chunk size in the plain layout; untuned winners are skipped."""
    rec = {"chunk_policy": {"status": "tuned", "buckets": {"1": 16, "16": 16, "64": 16}}, "winners": [
        {"kernel": "gdn_recurrent", "batch_bucket": 1, "chunk_size": 0, "tunables": {"BV": 8, "threads": 32},
         "median_us": 4.7},
        {"kernel": "gdn_recurrent", "batch_bucket": 16, "chunk_size": 0, "tunables": {"BV": 32, "threads": 32},
         "median_us": 22.9},
        {"kernel": "gdn_recurrent", "batch_bucket": 64, "chunk_size": 0, "tunables": {"BV": 64, "threads": 64},
         "median_us": 72.2},
        {"kernel": "gdn_buffered_step", "batch_bucket": 64, "chunk_size": 16, "drafts": 4,
         "tunables": {"BV": 64, "threads": 64}, "median_us": 50.0},
        {"kernel": "gdn_buffered_step", "batch_bucket": 64, "chunk_size": 8, "tunables": {"BV": 32, "threads": 64},
         "median_us": 50.0},
        {"kernel": "gdn_buffered_step", "batch_bucket": 64, "chunk_size": 16, "tunables": {"BV": 128, "threads": 128},
         "median_us": 48.0},
        {"kernel": "gdn_buffered_step", "batch_bucket": 16, "chunk_size": 16, "tunables": {"BV": 16, "threads": 64},
         "median_us": None},
    ]}
    assert kernels.tuned_tunables(rec, "gdn", 1, 16) == {"recurrent": {"BV": 8, "threads": 32}}
    assert kernels.tuned_tunables(rec, "gdn", 4, 16) == {"recurrent": {"BV": 32, "threads": 32}}
    assert kernels.tuned_tunables(rec, "gdn", 1024, 16) == {"recurrent": {"BV": 64, "threads": 64},
                                                             "buffered": {"BV": 128, "threads": 128}}
    assert kernels.tuned_tunables(rec, "mamba2", 1, 16) == {}
    # the picks feed kernel_configs: a verify follows the tuned step; the rest stays the runtime's untuned default
    cfg = kernels.kernel_configs(kernels.heads_of("qwen3.5-9b"), kernels.tuned_tunables(rec, "gdn", 100, 16))
    assert cfg["verify"] == cfg["buffered"] == {"BV": 128, "threads": 128}


def test_alpha_drafter_rejects_bad_arguments():
    with pytest.raises(ValueError, match="alpha"):
        ReferenceDrafter({}, 1.5, 10)
    with pytest.raises(ValueError, match="vocab_size"):
        ReferenceDrafter({}, 0.5, 1)
    assert expected_accepted(0.5, 3) == pytest.approx(0.875)


def test_one_preset_table_feeds_planner_and_tuner():
    assert set(GEOMETRIES) == set(models.HEAD_SHAPES) == set(presets.MODELS)
    assert not {"tiny-qwen", "tiny-nemotron"} & set(GEOMETRIES)
    for name in presets.MODELS:
        geo, heads = GEOMETRIES[name], models.HEAD_SHAPES[name]
        s = geo.linear_shape
        assert (heads["Hk"], heads["Hv"], heads["K"], heads["V"]) == (s.num_k_heads, s.num_v_heads, s.head_k_dim,
                                                                      s.head_v_dim)
        assert geo.weight_bytes == int(presets.get(name).params_billions * 1e9 * 2)
    nano = GEOMETRIES["nemotron-3-nano"]
    assert (nano.num_linear_layers, nano.num_attention_layers, nano.conv_dim) == (23, 6, 64 * 64 + 2 * 8 * 128)
    pattern = presets.get("nemotron-3-nano").config["hybrid_override_pattern"]
    assert (len(pattern), pattern.count("M"), pattern.count("E"), pattern.count("*")) == (52, 23, 23, 6)
    with pytest.raises(ValueError, match="unknown model preset"):
        presets.get("qwen9")


def test_preset_configs_are_copies():
    a = presets.get("qwen3.5-9b").hf_config()
    a["layer_types"].append("x")
    assert len(presets.get("qwen3.5-9b").hf_config()["layer_types"]) == 32


class _ReferenceKernel:
    """Stands in for a compiled kernel on the CPU: the kernel's argument order, the reference's arithmetic."""

    def __init__(self, ref, single: bool, reorder=None, **kw):
        self.ref, self.single, self.reorder, self.kw = ref, single, reorder, kw

    def fn(self, *args):
        *args, out = args
        tokens = 5 if self.reorder is None else 8  # leading per-token / per-layer arguments
        lead = [t[:, 0] if self.single and t.dim() >= 3 else t for t in args[:tokens]]
        lead, kw = (lead, {}) if self.reorder is None else self.reorder(lead)
        o = self.ref(*lead, *args[tokens:], **kw, **self.kw)
        out.copy_(o.unsqueeze(1) if self.single else o)


def _mamba_order(lead):  # kernel: x, dt, A_log, dt_bias, B, C, D, z -> reference: ..., D, then z by keyword
    return lead[:7], {"z": lead[7]}


@pytest.mark.parametrize("name", ["gdn", "mamba2"])
def test_gate_and_ops_plumbing_with_reference_kernels(name):
    from kvbuffer.bench import gdn, mamba2
    from kvbuffer.reference import gdn as gdn_ref, mamba2 as mamba2_ref

    family, ref, reorder = {"gdn": (gdn, gdn_ref, None), "mamba2": (mamba2, mamba2_ref, _mamba_order)}[name]
    heads = dict(kernels.heads_of(family.SHAPES[0]), Hk=2, Hv=4, K=32, V=16)  # small: the CPU does the math
    C, cap = 4, 13
    fakes = {"recurrent": _ReferenceKernel(ref.recurrent_step, True, reorder),
             "buffered": _ReferenceKernel(ref.buffered_step, True, reorder, flush_at=C)}
    fakes.update({f"verify{T}": _ReferenceKernel(ref.verify, False, reorder) for T in kernels.VERIFY_TOKENS})
    errors = kernels.gate(family, fakes, heads, [], C=C, cap=cap, device="cpu")
    assert set(errors) == set(fakes) and max(errors.values()) < kernels.GATE_TOLERANCE, errors
    pools = kernels.Pools(heads, 3, cap=cap, C=C, device="cpu", cache_bytes=0)
    inputs = kernels.Inputs(family, heads, 3, device="cpu")
    ops = kernels.our_ops(fakes, pools, inputs, lambda T: family.act_bytes(heads, T))
    for op in ops:
        for s in range(pools.sets):
            op.run(s)
    assert all(bool(torch.isfinite(o).all()) for o in inputs.out.values())
    assert [op.name for op in ops] == ["recurrent", "buffered", "verify2", "verify4", "verify5", "verify8"]


def test_indexed_fla_peer_meets_the_gate_on_a_standin():
    """The "fla_indexed" peer's plumbing (GDN's gate broadcast per key channel, the indexed in-place
    call, the gate's copy of the pool) on a CPU stand-in with the kernel's signature: within the
    gate's tolerance of fp64, as the contiguous "fla" peer is; the timed op writes the rows' slots only."""
    from kvbuffer.bench import gdn
    from tests.bench.test_peers import fla_indexed_standin, fla_standin

    heads = dict(kernels.heads_of(gdn.SHAPES[0]), Hk=2, Hv=4, K=32, V=16)
    C, cap = 4, 13
    peer = gdn.indexed_peer(fla_indexed_standin)
    pools = kernels.Pools(heads, 3, cap=cap, C=C, device="cpu", cache_bytes=0)
    inputs = kernels.Inputs(gdn, heads, 3, device="cpu")
    want = gdn.reference("recurrent", inputs.tokens[1][0], inputs.params, pools, 0)
    before = pools.state.clone()
    assert kernels.rel_err(peer.output(pools, inputs, 0), want) < kernels.GATE_TOLERANCE
    assert torch.equal(pools.state, before)  # the gate's run worked on a copy
    assert kernels.rel_err(gdn.contiguous_peer(fla_standin).output(pools, inputs, 0), want) < kernels.GATE_TOLERANCE
    peer.op(pools, inputs)(1)
    touched = pools.state_slots(1).long()
    others = torch.ones(pools.state.shape[0], dtype=torch.bool)
    others[touched] = False
    assert torch.equal(pools.state[others], before[others]) and not torch.equal(pools.state[touched], before[touched])


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-nemotron"])
def test_random_models_greedy_continuation_survives_rounding(preset):
    """The alpha drafter's references hold only if greedy decoding does not turn at near ties that
    rounding breaks: the same prompts give the same continuation in fp32 and in bf16."""
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        model = e2e.random_model(preset, "cpu", dtype)
        prompts = e2e.random_prompts(4, 10, model.config.vocab_size, seed=1)
        llm = LLM(model, device="cpu", chunk_size=4, max_batch=4, max_len=40, kernels=False)
        outs.append([o.token_ids for o in llm.generate(prompts, max_new_tokens=8, stop_token_ids=[])])
    assert outs[0] == outs[1]


def test_tuned_without_a_record_names_the_tune_command(tmp_path, monkeypatch):
    """--tuned on a GPU with no tuning record for the shape: an ArtifactError that says how to make one."""
    from kvbuffer import gpus
    from kvbuffer.errors import ArtifactError
    from kvbuffer.tuning import local_tuning, make_shape

    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gpus, "detect_local_gpu", lambda device=0: gpus.get_gpu("h200"))
    with pytest.raises(ArtifactError, match="kvbuffer tune --gpu h200"):
        local_tuning(make_shape(**kernels.heads_of("qwen3.5-9b")))
    assert not any(tmp_path.iterdir())  # looking wrote nothing


def test_decode_prompts_spread_the_fills_over_a_chunk():
    """Equal prompt lengths would flush every row in the same step (once every C steps), and the
    median step would leave the flushes out; staggered lengths flush 1/C of the rows each step."""
    C = 16
    prompts = e2e.random_prompts(2 * C + 3, 128, 1000, seed=0, spread=C)
    fills = [len(p) % C for p in prompts]
    assert sorted(set(fills)) == list(range(C))
    assert max(fills.count(f) for f in range(C)) - min(fills.count(f) for f in range(C)) <= 1
    assert [len(p) for p in e2e.random_prompts(3, 12, 1000, seed=0)] == [12, 12, 12]
    with pytest.raises(ValueError, match="spread"):
        e2e.random_prompts(3, 12, 1000, seed=0, spread=0)


def test_decode_bench_runs_staggered_prompts():
    model = e2e.random_model("tiny-qwen", "cpu", torch.float32)
    rows = e2e.bench_decode(model, batches=(5,), modes=("kvbuffer",), prompt_len=6, new_tokens=5, chunk_size=4,
                            device="cpu", kernels=False, cuda_graphs=False, compile=False)
    assert [r["batch"] for r in rows] == [5] and rows[0]["step_ms"] > 0
