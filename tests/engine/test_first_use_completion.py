"""The first-use build plans every kernel the fast path looks up (kvbuffer.engine.choices.fast_path_kernels),
builds what is missing in one pass (a partial cache left by an interrupted build included) and leaves one
WARNING line per build for what is still missing, naming the kernels and the `kvbuffer tune` run that builds
them (kvbuffer.kernels.autobuild.complete). On a CPU with a faked H200 and a faked artifact cache."""

import logging

import pytest
import torch

import kvbuffer
from kvbuffer import gpus
from kvbuffer.engine.choices import complete_fast_path, fast_path_kernels
from kvbuffer.engine.config import EngineConfig
from kvbuffer.kernels import autobuild, lookup
from kvbuffer.kernels.autobuild import Planned, complete, kernel_name
from tests.support.tiny_models import tiny_model

CUDA = torch.device("cuda")  # only its type is read: nothing runs on it here


def _spec(model, **kw):
    return kvbuffer.LLM(model, device="cpu", max_batch=2, max_len=64, kernels=False, **kw).runner.spec


@pytest.fixture(scope="module")
def qwen():
    """A tiny Qwen3.5 whose attention head dim the attention kernels take, and its caches' spec."""
    model = tiny_model("qwen3_5", head_dim=32)
    return model, _spec(model)


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(gpus, "detect_local_gpu", lambda device=0: gpus.get_gpu("h200"))
    lookup.allow_jit(False)
    yield
    lookup.allow_jit(None)


class FakeCache:
    """An artifact cache of keys: each ensure_* build adds the planned keys of its group, except those in
    `fails`, or raises KeyboardInterrupt after `interrupt_after` kernels (an interrupted first use)."""

    def __init__(self, monkeypatch, planned, built=(), fails=(), interrupt_after=None):
        self.built, self.fails, self.interrupt_after, self.calls = set(built), set(fails), interrupt_after, []
        self.by_group = {}
        for p in planned:
            self.by_group.setdefault(p.group, []).append(p.key)
        monkeypatch.setattr(autobuild, "loads", lambda key: key in self.built)
        monkeypatch.setattr(autobuild, "ensure_kernels", lambda step, conv_dtype: self._build("linear"))
        monkeypatch.setattr(autobuild, "ensure_conv_kernels", lambda keys: self._build("conv"))
        monkeypatch.setattr(autobuild, "ensure_attention_kernels", lambda key: self._build("attention"))

    def _build(self, group):
        self.calls.append(group)
        for key in self.by_group[group]:
            if self.interrupt_after is not None and len(self.built) >= self.interrupt_after:
                raise KeyboardInterrupt
            if key not in self.fails:
                self.built.add(key)
        return None


def test_the_plan_names_every_kernel_of_the_fast_path(qwen):
    model, spec = qwen
    names = {p.group: [] for p in fast_path_kernels(model, spec, torch.bfloat16, "kvbuffer")}
    for p in fast_path_kernels(model, spec, torch.bfloat16, "kvbuffer"):
        names[p.group].append(kernel_name(p.key))
    assert names["conv"] == ["conv1d_step", "conv1d_prefill"]
    assert names["attention"] == ["attention_decode", "attention_combine"]
    assert {"gdn_buffered_step", "gdn_flush", "gdn_recurrent", "gdn_chunk_prefill"} <= set(names["linear"])
    spec5 = spec.__class__(**{**vars(spec), "max_drafts": 5})
    planned = fast_path_kernels(model, spec5, torch.bfloat16, "kvbuffer")
    assert len({p.key for p in planned}) == len(planned)
    names5 = [kernel_name(p.key) for p in planned]
    assert {"conv1d_verify", "conv1d_accept", "attention_decode_verify", "attention_combine_verify"} <= set(names5)


def test_a_model_the_kernels_do_not_take_plans_nothing_of_theirs():
    model = tiny_model("qwen3_5")  # attention head dim 16: no attention kernel takes it
    planned = fast_path_kernels(model, _spec(model), torch.bfloat16, "kvbuffer")
    assert planned and "attention" not in {p.group for p in planned}


@pytest.mark.parametrize("lost", ["conv1d_step", "conv1d_prefill", "attention_combine", "gdn_chunk_prefill"])
def test_a_deleted_artifact_is_rebuilt_by_its_own_build(qwen, h200, monkeypatch, caplog, lost):
    """The partial cache of the report: everything built but one kernel (the conv step there)."""
    model, spec = qwen
    planned = fast_path_kernels(model, spec, torch.bfloat16, "kvbuffer")
    cache = FakeCache(monkeypatch, planned, built=[p.key for p in planned if kernel_name(p.key) != lost])
    with caplog.at_level(logging.WARNING, logger="kvbuffer"):
        still = complete_fast_path(EngineConfig(), CUDA, model, spec, torch.bfloat16)
    group = next(p.group for p in planned if kernel_name(p.key) == lost)
    assert still == [] and cache.calls == [group] and cache.built == {p.key for p in planned}
    assert not caplog.records


@pytest.mark.parametrize("after", [0, 3, 8])
def test_an_interrupted_build_is_completed_by_the_next_engine(qwen, h200, monkeypatch, after):
    model, spec = qwen
    planned = fast_path_kernels(model, spec, torch.bfloat16, "kvbuffer")
    cache = FakeCache(monkeypatch, planned, interrupt_after=after)
    with pytest.raises(KeyboardInterrupt):
        complete_fast_path(EngineConfig(), CUDA, model, spec, torch.bfloat16)
    assert len(cache.built) == after
    cache.interrupt_after = None
    assert complete_fast_path(EngineConfig(), CUDA, model, spec, torch.bfloat16) == []
    assert cache.built == {p.key for p in planned}
    calls = len(cache.calls)
    complete_fast_path(EngineConfig(), CUDA, model, spec, torch.bfloat16)  # a third engine builds nothing
    assert len(cache.calls) == calls


def test_a_kernel_that_does_not_build_is_one_warning_naming_it_and_its_command(qwen, h200, monkeypatch, caplog):
    model, spec = qwen
    planned = fast_path_kernels(model, spec, torch.bfloat16, "kvbuffer")
    step = next(p.key for p in planned if kernel_name(p.key) == "conv1d_step")
    FakeCache(monkeypatch, planned, fails=[step])
    with caplog.at_level(logging.INFO, logger="kvbuffer"):
        still = complete_fast_path(EngineConfig(), CUDA, model, spec, torch.bfloat16, checkpoint="/ckpt/qwen")
    assert [p.key for p in still] == [step]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    line = warnings[0].getMessage()
    assert "\n" not in line and "conv1d_step" in line and "short conv runs on the reference ops" in line
    assert "`kvbuffer tune --gpu h200 --model /ckpt/qwen` builds it" in line


def test_kernels_off_jit_or_cpu_plan_and_build_nothing(qwen, h200, monkeypatch):
    model, spec = qwen
    cache = FakeCache(monkeypatch, fast_path_kernels(model, spec, torch.bfloat16, "kvbuffer"))
    assert complete_fast_path(EngineConfig(kernels=False), CUDA, model, spec, torch.bfloat16) == []
    assert complete_fast_path(EngineConfig(), torch.device("cpu"), model, spec, torch.bfloat16) == []
    lookup.allow_jit(True)
    assert complete_fast_path(EngineConfig(), CUDA, model, spec, torch.bfloat16) == []
    assert cache.calls == [] and not cache.built


def test_complete_builds_each_group_once_then_warns_once_per_group(caplog):
    """autobuild.complete with fake keys: a builder that cannot build says why, in the group's one line."""
    keys = [f"k{i}" for i in range(5)]
    planned = [Planned(k, "a" if i < 3 else "b", f"{'a' if i < 3 else 'b'} runs slowly") for i, k in enumerate(keys)]
    built, calls = {"k0"}, []

    def build_a(missing):
        calls.append(("a", missing))
        built.update(missing[:1])  # builds one of two
        return None

    def build_b(missing):
        calls.append(("b", missing))
        return "no TileLang here"

    names = {"kernel_name": lambda key: f"name_{key}"}
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING, logger="kvbuffer"):
        mp.setattr(autobuild, "kernel_name", names["kernel_name"])
        still = complete(planned, {"a": build_a, "b": build_b}, lambda k: k in built, lambda k: f"tune {k}")
    assert calls == [("a", ["k1", "k2"]), ("b", ["k3", "k4"])]
    assert [p.key for p in still] == ["k2", "k3", "k4"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "name_k2 kernel:" in lines[0] and "a runs slowly" in lines[0] and "`tune k2` builds it" in lines[0]
    assert "name_k3, name_k4 kernels: b runs slowly" in lines[1]
    assert lines[1].endswith("`tune k3` builds them (no TileLang here)")
    with pytest.raises(ValueError, match="groups without a builder: \\['b'\\]"):
        complete(planned, {"a": build_a}, lambda k: True, str)


def test_a_build_that_cannot_run_gives_its_own_line_with_the_checkpoint(qwen, h200, monkeypatch, caplog):
    """Without TileLang the conv's build says why and which command builds it, naming the checkpoint."""
    model, spec = qwen
    planned = fast_path_kernels(model, spec, torch.bfloat16, "kvbuffer")
    FakeCache(monkeypatch, planned, built=[p.key for p in planned if p.group != "conv"])
    monkeypatch.setattr(autobuild, "ensure_conv_kernels", lambda keys: autobuild._local_build(keys[0], "short conv kernels")[1])
    monkeypatch.setattr(autobuild, "build_problem", lambda: "TileLang, which builds them, is not installed")
    with caplog.at_level(logging.WARNING, logger="kvbuffer"):
        still = complete_fast_path(EngineConfig(), CUDA, model, spec, torch.bfloat16, checkpoint="/ckpt/qwen")
    assert [kernel_name(p.key) for p in still] == ["conv1d_step", "conv1d_prefill"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("kvbuffer: no compiled conv1d_step, conv1d_prefill kernels: the short conv runs on the "
                           "reference ops, slower; no compiled short conv kernels on h200; TileLang")
    assert line.endswith("then `kvbuffer tune --gpu h200 --model /ckpt/qwen` builds them")
