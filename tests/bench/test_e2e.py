"""The end-to-end benchmark's code path on the CPU (tiny presets); its real numbers come from a GPU run."""

import json

import pytest

from kvbuffer.bench import e2e

SMALL = dict(prompt_len=20, new_tokens=4, chunk_size=6)


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-nemotron"])
def test_decode_benchmark_runs(tmp_path, preset):
    result = e2e.run("decode", preset=preset, device="cpu", out_dir=tmp_path, batches=(1, 3), profile_batch=3,
                     **SMALL)
    rows = result["rows"]
    assert {(r["batch"], r["mode"]) for r in rows} == {(b, m) for b in (1, 3) for m in e2e.MODES}
    assert all(r["decode_tokens_per_s"] > 0 and r["peak_batch"] == r["batch"] for r in rows)
    profiled = [r["profile"] for r in rows if "profile" in r]
    assert len(profiled) == 2 and all(set(p["device_us_per_step_by_class"]) == {"gemm", "state", "attention", "other"}
                                      for p in profiled)
    saved = json.loads(next(tmp_path.glob("e2e_decode_*.json")).read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["benchmark"] == "decode"


def test_decode_benchmark_samples_when_asked(tmp_path):
    result = e2e.run("decode", preset="tiny-qwen", device="cpu", out_dir=tmp_path, batches=(2,), modes=("kvbuffer",),
                     temperature=0.8, top_p=0.9, **SMALL)
    assert [(r["temperature"], r["top_p"]) for r in result["rows"]] == [(0.8, 0.9)]
    assert result["rows"][0]["decode_tokens_per_s"] > 0
    assert len(list(tmp_path.glob("e2e_decode_sampled_tiny-qwen_*.json"))) == 1


@pytest.mark.parametrize("preset, alphas", [("tiny-qwen", (0.0, 1.0)), ("tiny-nemotron", (1.0,))])
def test_spec_benchmark_equal_batch_and_capacity(tmp_path, preset, alphas):
    result = e2e.run("spec", preset=preset, device="cpu", out_dir=tmp_path, batches=(2,), alphas=alphas,
                     drafts=2, budget_bytes=int(0.002 * 2**30), max_requests=5, profile_batch=2,
                     **dict(SMALL, new_tokens=8))  # alpha 1 emits 3 tokens a step: 8 tokens give a warm verify
    spec = [r for r in result["rows"] if r.get("alpha") is not None]
    plain = [r for r in result["rows"] if r.get("alpha") is None]
    assert {(r["setting"], r["mode"], r["alpha"]) for r in spec} == {
        (s, m, a) for s in ("equal", "capacity") for m in e2e.MODES for a in alphas}
    assert len(plain) == 4 and all(r["draft_tokens"] == 0 for r in plain)
    profiled = [r["profile"]["step"] for r in result["rows"] if r["batch"] == 2 and "profile" in r]
    assert sorted(profiled) == ["decode", "decode", "verify_greedy", "verify_greedy"]  # both modes: alpha 1's verify, plain
    for r in spec:
        assert r["acceptance"] == (1.0 if r["alpha"] == 1.0 else 0.0), r
        assert r["tokens_per_step"] == pytest.approx(3.0 if r["alpha"] == 1.0 else 1.0, abs=0.7)
        assert r["compiled"] is False  # on the CPU nothing is compiled; the row says so
    cap = {r["mode"]: r for r in spec if r["setting"] == "capacity"}
    assert cap["kvbuffer"]["planned_requests"] > cap["recurrent"]["planned_requests"]
    for r in cap.values():
        assert r["admitted"] == r["peak_batch"] == min(r["planned_requests"], 5)


def test_kernel_classes():
    assert e2e.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert e2e.kernel_class("nvjet_tst_128x64_64x8") == "gemm"
    assert e2e.kernel_class("grouped_experts_kernel_kernel") == "gemm"  # kvbuffer's routed experts' matmul
    assert e2e.kernel_class("triton_poi_fused_grouped_experts_pow_relu_14") == "other"  # its activation
    assert e2e.kernel_class("_selective_scan_update_kernel") == "state"
    assert e2e.kernel_class("pytorch_flash::flash_fwd_kernel") == "attention"
    assert e2e.kernel_class("gdn_buffered_kernel") == "state"
    assert e2e.kernel_class("triton_red_fused_add_rms_norm_0") == "other"


def test_device_time_sums_by_kernel_class():
    from types import SimpleNamespace as K

    kernels = [K(key="nvjet_tst_128x64", self_device_time_total=300.0), K(key="gdn_prefill_states_kernel",
               self_device_time_total=60.0), K(key="sm90_xmma_gemm_bf16", self_device_time_total=100.0)]
    assert e2e.device_by_class(kernels, 2) == {"gemm": 200.0, "state": 30.0, "attention": 0.0, "other": 0.0}
    assert e2e.device_by_class([]) == {"gemm": 0.0, "state": 0.0, "attention": 0.0, "other": 0.0}


def test_steady_rate_counts_the_full_batch_steps_only():
    """A run's last speculative steps feed fewer requests (they end at different steps): the steady
    rate leaves them out, as it leaves out the first (capturing) step; all_steps_rate keeps them."""
    from kvbuffer.engine.outputs import GenerationStats

    st = GenerationStats(peak_batch=4, step_seconds=[9.0, 1.0, 1.0, 1.0, 1.0], step_tokens=[4, 12, 8, 2, 1],
                         step_rows=[4, 4, 4, 2, 1])
    assert e2e.steady_rate(st) == 10.0 and e2e.all_steps_rate(st) == 23 / 4


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-nemotron"])
def test_fp8_random_model_is_the_presets_fp8_format(preset):
    """`bench ... --fp8`: the preset's random model with its projections in its family's FP8 format, the
    way loading such a checkpoint builds it; it generates like any model."""
    import torch

    from kvbuffer import LLM
    from kvbuffer.models.quant.linear import FP8Linear, FP8PackedLinear

    model = e2e.random_model(preset, "cpu", torch.float32, fp8=True)
    fp8 = [m for m in model.modules() if isinstance(m, (FP8Linear, FP8PackedLinear))]
    assert fp8
    out = LLM(model, max_batch=1, max_len=32).generate([[1, 2, 3]], max_new_tokens=4)
    assert len(out[0].token_ids) == 4
