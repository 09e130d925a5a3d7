"""`kvbuffer tune` and `kvbuffer cache`: option handling, the tuner's selection logic (fake kernels,
CPU), and a real build for an absent GPU whose artifacts load in a process without TileLang."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from kvbuffer.autotune import tuner
from kvbuffer.autotune.cache import ArtifactCache
from kvbuffer.gpus import get_gpu, match_device
from kvbuffer.autotune.models import checkpoint_shape, preset_shape
from kvbuffer.tuning import ChunkPolicy, select
from kvbuffer.autotune.template import Template
from kvbuffer.cli.main import main

HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None and shutil.which("nvcc") is not None
needs_tilelang = pytest.mark.skipif(not HAVE_TILELANG, reason="needs TileLang and nvcc to compile")


def run(*args):
    return CliRunner().invoke(main, list(args))


# ----------------------------------------------------------------------------------------------
# options


def test_list_gpus():
    result = run("tune", "--list-gpus")
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line.split() for line in result.output.splitlines()}
    assert lines["h200"][-5] == "sm_90a" and lines["b200"][-5] == "sm_100a" and lines["a100"][-5] == "sm_80"


@pytest.mark.parametrize("args, message", [
    (["--gpu", "h300", "--model", "qwen3.5-9b"], "unknown GPU 'h300'"),
    (["--gpu", "h200", "--model", "qwen3.5-9b", "--heads", "16,32,128,128"], "not both"),
    (["--gpu", "h200", "--model", "qwen9"], "unknown model preset"),
    (["--gpu", "h200", "--heads", "16,32,128"], "four integers"),
    (["--gpu", "h200", "--heads", "16,30,128,128"], "multiple of Hk"),
    (["--gpu", "h200", "--model", "qwen3.5-9b", "--chunk-sizes", "8,x"], "comma-separated integers"),
    (["--gpu", "h200", "--model", "qwen3.5-9b", "--kernels", "gdn_nope"], "unknown kernel"),
    (["--gpu", "h200", "--model", "nemotron-3-nano", "--kernels", "gdn_flush"], "mamba2"),
    (["--gpu", "h200", "--model", "qwen3.5-9b", "--draft-tokens", "4,17"], "[1, 16]"),
    (["--gpu", "h200", "--model", "qwen3.5-9b", "--draft-tokens", "0"], "positive integers"),
], ids=["unknown-gpu", "model-and-heads", "preset", "heads-format", "heads-ratio", "chunks", "kernel", "mamba2",
        "too-many-drafts", "zero-drafts"])
def test_bad_options_are_named(args, message, tmp_path):
    result = run("tune", *args, "--cache-dir", str(tmp_path))
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_no_gpu_here_asks_for_one(tmp_path):
    result = run("tune", "--model", "qwen3.5-9b", "--cache-dir", str(tmp_path))
    assert result.exit_code != 0 and "no CUDA GPU here" in result.output and "--gpu" in result.output


def test_presets_and_checkpoints_give_head_shapes(tmp_path):
    assert preset_shape("qwen3.5-27b") == {"family": "gdn", "Hk": 16, "Hv": 48, "K": 128, "V": 128,
                                           "dtype": "bfloat16"}
    assert preset_shape("nemotron-3-super")["Hv"] == 128
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "dtype": "bfloat16"}}))
    assert checkpoint_shape(qwen) == preset_shape("qwen3.5-9b")
    nemo = tmp_path / "nemo.json"
    nemo.write_text(json.dumps({"model_type": "nemotron_h", "mamba_num_heads": 64, "mamba_head_dim": 64,
                                "ssm_state_size": 128, "n_groups": 8, "torch_dtype": "bfloat16"}))
    assert checkpoint_shape(nemo) == preset_shape("nemotron-3-nano")


def test_gpu_detection_matches_names_and_capability():
    assert match_device("NVIDIA H200", (9, 0)).name == "h200"
    assert match_device("NVIDIA H100 PCIe", (9, 0)).name == "h100-pcie"
    assert match_device("NVIDIA H100 80GB HBM3", (9, 0)).name == "h100"
    assert match_device("NVIDIA L40S", (8, 9)).name == "l40s"
    assert match_device("NVIDIA L4", (8, 9)).name == "l4"
    assert match_device("NVIDIA H200", (8, 0)) is None
    assert get_gpu("H200").target == {"kind": "cuda", "arch": "sm_90a"}


# ----------------------------------------------------------------------------------------------
# the measuring path's selection logic, with fake kernels on the CPU


class FakeKernel:
    """y = scale * x; writes its simulated cost (seconds) so the fake timer can read it."""

    prim_func = SimpleNamespace(attrs={"global_symbol": "fake_kernel"})

    def __init__(self, scale, cost):
        self.scale, self.cost = scale, cost

    def export_library(self, path):
        Path(path).write_bytes(b"fake library " + repr(self.cost).encode())

    def __call__(self, x, y, cost):
        y.copy_(self.scale * x)
        cost.fill_(self.cost(x.shape[0]))


def fake_template(name, factor=lambda b: 1.0):
    """factor(batch): scales every config's simulated cost (another kernel's speed)."""
    base = {"slow": lambda b: 1.0, "fast": lambda b: 0.5 + 0.01 * b, "wrong": lambda b: 0.01}

    def build(shape, chunk, *, target, v):
        by_c = lambda b: (chunk / 16) if b < 10 else (16 / chunk)  # noqa: E731  small batch: small C
        return FakeKernel(3.0 if v == "wrong" else 2.0, lambda b: base[v](b) * by_c(b) * factor(b))

    def make_inputs(shape, batch, chunk, device, gen):
        return {"x": torch.randn(batch, 4, generator=gen), "y": torch.empty(batch, 4), "cost": torch.zeros(())}

    return Template(name, "gdn", build, lambda: [{"v": "slow"}, {"v": "wrong"}, {"v": "fast"}],
                    lambda shape, drafts, arch=None: {"v": "slow"}, make_inputs,
                    lambda shape, chunk, args: {"y": 2.0 * args["x"]},
                    ("x", "y", "cost"), "src")


def fake_timer(fn, arg_sets):
    fn(arg_sets[0])
    return float(arg_sets[0][2])


def test_measure_keeps_checked_winners_and_derives_the_chunk_policy(tmp_path):
    cache = ArtifactCache(tmp_path)
    req = tuner.TuneRequest(get_gpu("h200"), preset_shape("qwen3.5-9b"), (8, 16, 32), (1, 256))
    results, record_name = tuner.measure(cache, req, [fake_template(tuner.POLICY_KERNELS[0])], device="cpu",
                                         timer=fake_timer)
    record = cache.tuning(record_name)
    assert record["status"] == "tuned"
    policy = ChunkPolicy.from_json(record["chunk_policy"])
    assert (policy.chunk_for(1), policy.chunk_for(256)) == (8, 32)
    winners = {(w["batch_bucket"], w["chunk_size"]): w["tunables"]["v"] for w in record["winners"]}
    assert winners[(1, 8)] == "fast" and winners[(256, 32)] == "slow"
    assert all(v != "wrong" for v in winners.values())
    assert all(any("mismatch" in why for _, why in r.rejected) for r in results)
    assert {e["status"] for e in cache.manifest()["artifacts"].values()} == {"tuned"}
    name, c = select(record, tuner.POLICY_KERNELS[0], 200)
    assert c == 32 and cache.verify(name)["key"]["tunables"] == {"v": "slow"}


def test_measure_records_up_to_which_batch_the_recurrent_step_wins(tmp_path):
    """The recurrent step is timed in the same buckets as the buffered one; the policy says where it
    won (from the smallest bucket on); a later measured run that does not time it says nothing (its
    chunk sizes may differ, so the old verdict would be stale)."""
    from kvbuffer.autotune.policy import RECURRENT_KERNELS

    cache = ArtifactCache(tmp_path)
    req = tuner.TuneRequest(get_gpu("h200"), preset_shape("qwen3.5-9b"), (16,), (1, 16, 256))
    recurrent = fake_template(RECURRENT_KERNELS[0], factor=lambda b: 0.5 if b == 1 else 3.0)
    _, name = tuner.measure(cache, req, [fake_template(tuner.POLICY_KERNELS[0]), recurrent], device="cpu",
                            timer=fake_timer)
    assert ChunkPolicy.from_json(cache.tuning(name)["chunk_policy"]).unbuffered_rows == 1
    _, name = tuner.measure(cache, req, [fake_template(tuner.POLICY_KERNELS[0])], device="cpu", timer=fake_timer)
    assert ChunkPolicy.from_json(cache.tuning(name)["chunk_policy"]).unbuffered_rows is None


def test_untuned_build_records_defaults_for_every_bucket(tmp_path):
    cache = ArtifactCache(tmp_path)
    req = tuner.TuneRequest(get_gpu("a100"), preset_shape("qwen3.5-9b"), (8, 32), (1, 64))
    results, record_name = tuner.build_untuned(cache, req, [fake_template("toy")])
    assert [(r.chunk_size, r.status, r.reused) for r in results] == [(8, "untuned", False), (32, "untuned", False)]
    record = cache.tuning(record_name)
    assert record["status"] == "untuned" and len(record["winners"]) == 4
    assert ChunkPolicy.from_json(record["chunk_policy"]).chunk_sizes == (8, 8)
    again, _ = tuner.build_untuned(cache, req, [fake_template("toy")])
    assert all(r.reused for r in again)


# ----------------------------------------------------------------------------------------------
# a real build for a GPU that is not here

LOAD_BLOCKED = '''
import sys
sys.modules["tilelang"] = None
from kvbuffer.gpus import get_gpu
from kvbuffer.tuning import TuningStore, make_shape, select
store, gpu = TuningStore(sys.argv[1]), get_gpu("h100")
record = store.find_tuning(gpu.name, gpu.arch, make_shape("gdn", 16, 32, 128, 128))
name, c = select(record, "gdn_flush", 3)
art = store.load(name, arch=gpu.arch, gpu=gpu.name)
print(art.meta["function"], c, art.meta["key"]["arch"])
'''


@pytest.mark.tilelang
@pytest.mark.slow
@needs_tilelang
def test_build_for_absent_gpu_then_load_without_tilelang(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this test builds for a GPU that is not present")
    import logging

    args = ["tune", "--gpu", "h100", "--model", "qwen3.5-9b", "--kernels", "gdn_flush", "--chunk-sizes", "8",
            "--batch-buckets", "1,64", "--cache-dir", str(tmp_path)]
    tilelang_log = logging.getLogger("tilelang")
    level = tilelang_log.level
    tilelang_log.setLevel(logging.INFO)  # what a user with TileLang's INFO lines on sees: none of them
    try:
        result = run(*args)
    finally:
        tilelang_log.setLevel(level)
    assert result.exit_code == 0, result.output
    assert "INFO" not in result.output and "[1/1] gdn_flush C=8: built" in result.output
    assert "building (untuned) 1 kernel(s) for h100 (sm_90a)" in result.output
    assert "untuned" in result.output and "B<=64: C=8" in result.output

    manifest = json.loads((tmp_path / "manifest.json").read_text())
    (name, entry), = manifest["artifacts"].items()
    assert entry["status"] == "untuned" and entry["arch"] == "sm_90a"
    listing = run("cache", "ls", "--json", "--cache-dir", str(tmp_path))
    assert all(json.loads(line)["ok"] for line in listing.output.splitlines())

    again = run(*args)
    assert again.exit_code == 0 and "cached" in again.output

    out = subprocess.run([sys.executable, "-c", LOAD_BLOCKED, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    function = json.loads((tmp_path / "artifacts" / name / "meta.json").read_text())["function"]
    assert out.stdout.split() == [function, "8", "sm_90a"]

    assert run("cache", "path", "--cache-dir", str(tmp_path)).output.strip() == str(tmp_path)
    cleared = run("cache", "clear", "--yes", "--cache-dir", str(tmp_path))
    assert "removed 2 entries" in cleared.output
    assert "empty" in run("cache", "ls", "--cache-dir", str(tmp_path)).output


# ----------------------------------------------------------------------------------------------
# what a user sees: every preset, progress, one row per artifact, a missing nvcc


def test_tune_without_a_model_builds_every_preset_shape_once(monkeypatch, tmp_path):
    from kvbuffer.autotune import models, registry

    monkeypatch.setattr(registry, "templates", lambda family=None: [fake_template(f"{family}_toy")])
    result = run("tune", "--gpu", "h100", "--chunk-sizes", "8", "--cache-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    linear = {tuple(sorted(preset_shape(name).items())) for name in models.HEAD_SHAPES}
    convs = {tuple(sorted(models.conv_shape(dict(s)).items())) for s in linear}
    softmax = {tuple(sorted(models.preset_attention_shape(name).items())) for name in models.HEAD_SHAPES}
    projections = {tuple(sorted(p.items())) for name in models.HEAD_SHAPES for p in models.preset_gemv_shapes(name)}
    headers = [line for line in result.output.splitlines() if "building (untuned)" in line]
    n = len(linear) + len(convs) + len(softmax) + len(projections)
    assert len(headers) == n and len(linear) + len(convs) == 10  # three presets share one linear head shape
    assert sum("attention H=" in h for h in headers) == len(softmax) >= 2
    experts = sum(dict(p)["family"] == "experts" for p in projections)
    grouped = sum(dict(p)["family"] == "grouped" for p in projections)
    assert sum("gemv N=" in h for h in headers) == len(projections) - experts - grouped >= 12
    assert sum("experts N=" in h for h in headers) == experts >= 4  # the MoE presets' routed experts
    assert sum("grouped N=" in h for h in headers) == grouped == experts  # both experts kernels, every shape
    assert [h.split("]")[0] for h in headers] == [f"[{i}/{n}" for i in range(1, n + 1)]
    assert sum("1/1] gdn_toy C=8: built" in line for line in result.output.splitlines()) == 3
    rows = [line.split()[-1] for line in result.output.splitlines() if line.startswith(("gdn_toy", "mamba2_toy",
                                                                                         "conv1d_toy", "attention_toy",
                                                                                         "gemv_toy", "experts_toy",
                                                                                         "grouped_toy"))]
    assert len(rows) == len(set(rows)) == n
    assert len(ArtifactCache(tmp_path).manifest()["tunings"]) == n
    assert "INFO" not in result.output


def test_measured_results_list_each_artifact_once():
    from kvbuffer.cli.tune import results_table

    shape = preset_shape("qwen3.5-9b")
    won = [tuner.BuildResult("gdn_buffered_step", 16, {"BV": 32}, "art_a", "tuned", 2.0, False, {b: 10.0 * b})
           for b in (1, 16)] + [tuner.BuildResult("gdn_buffered_step", 16, {"BV": 64}, "art_b", "tuned", 2.0, False,
                                                  {64: 300.0})]
    header, *rows = results_table(won, shape, 4800, measured=True)
    assert [r[-1] for r in rows] == ["art_a", "art_b"]
    assert rows[0][header.index("won at B")] == "1/16" and rows[0][header.index("median us")] == "10.0/160.0"
    assert rows[1][header.index("GB/s")] != "-"


def test_cli_bucket_default_is_the_tuners():
    from kvbuffer.cli.tune import DEFAULT_BUCKETS

    assert tuple(int(b) for b in DEFAULT_BUCKETS.split(",")) == tuner.BATCH_BUCKETS


def test_without_nvcc_tune_and_env_say_how_to_point_at_it(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # no bin/nvcc there
    result = run("tune", "--gpu", "h100", "--model", "qwen3.5-9b", "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "CUDA_HOME" in result.output and "nvcc" in result.output
    assert not (tmp_path / "cache").exists()
    env = run("env")
    assert env.exit_code == 0 and any(line.startswith("nvcc") and "not found" in line and "CUDA_HOME" in line
                                      for line in env.output.splitlines())


def test_quiet_tilelang_hides_info_and_restores():
    import logging
    import os

    from kvbuffer.autotune.progress import PRINT_ON_COMPILATION, quiet_tilelang

    logger = logging.getLogger("tilelang")
    before = logger.level, os.environ.get(PRINT_ON_COMPILATION)
    with quiet_tilelang():
        assert not logger.isEnabledFor(logging.INFO) and logger.isEnabledFor(logging.WARNING)
        assert os.environ[PRINT_ON_COMPILATION] == "0"
    assert (logger.level, os.environ.get(PRINT_ON_COMPILATION)) == before


def test_live_progress_bar_names_the_kernel_and_count():
    import io

    from kvbuffer.autotune.progress import KernelProgress

    out = io.StringIO()
    with KernelProgress(2, out, live=True) as bar:
        bar.start("gdn_flush C=8")
        bar.done()
    text = out.getvalue()
    assert "gdn_flush C=8" in text and "1/2" in text


def test_attention_shapes_follow_the_model_and_the_switch(tmp_path):
    """A model's attention layers get their decode kernels (--no-attention leaves them out); --heads
    names no attention layers."""
    from kvbuffer.cli.tune import _resolve_shapes

    families = [s["family"] for s in _resolve_shapes("qwen3.5-9b", None, "gdn", None, True, True)]
    assert families == ["gdn", "conv1d", "attention"]
    assert [s["family"] for s in _resolve_shapes("qwen3.5-9b", None, "gdn", None, False, False)] == ["gdn"]
    assert [s["family"] for s in _resolve_shapes(None, "16,32,128,128", "gdn", None, False, True)] == ["gdn"]
    from tests.support.hf_models import make_hf_model

    ckpt = tmp_path / "ckpt"
    make_hf_model("nemotron_h").save_pretrained(ckpt)
    shapes = _resolve_shapes(str(ckpt), None, "gdn", None, False, True)
    assert [s["family"] for s in shapes] == ["mamba2", "attention"] and shapes[1]["dtype"] == "float32"
