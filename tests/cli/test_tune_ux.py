"""`kvbuffer tune` as a user lives it: every bad input refused before anything compiles, one overall
progress line with a time estimate on stderr, and a Ctrl-C that stops in one line (exit 130) keeping
what finished. Fake templates on the CPU; a real template's head-size check where TileLang is here."""

import dataclasses
import io
import os
import signal
import uuid

import pytest
from click.testing import CliRunner

from kvbuffer.autotune import progress as progress_mod
from kvbuffer.autotune import registry
from kvbuffer.autotune.cache import TUNE_MARK, ArtifactCache
from kvbuffer.autotune.progress import TuneProgress, duration
from kvbuffer.cli.main import main

from tests.kernels.test_tune_cli import HAVE_TILELANG, FakeKernel, fake_template


def run(*args):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def builds(monkeypatch):
    """Fake templates for every family whose builds are recorded (label list); nvcc taken as present."""
    from kvbuffer.kernels import autobuild

    calls = []

    def templates(family=None):
        tpl = fake_template(f"{family}_toy")

        def build(shape, chunk, *, target, v):
            calls.append((family, chunk))
            return FakeKernel(2.0, lambda b: 1.0)
        return [dataclasses.replace(tpl, build=build)]

    monkeypatch.setattr(registry, "templates", templates)
    monkeypatch.setattr(autobuild, "nvcc_problem", lambda: None)
    return calls


QWEN = ["--gpu", "h100", "--model", "qwen3.5-9b", "--no-gemv"]  # linear, conv, attention: three groups


# ----------------------------------------------------------------------------------------------
# every check before the first build


@pytest.mark.parametrize("args, code, message", [
    (["--gpu", "h300", "--model", "qwen3.5-9b"], 2, "unknown GPU 'h300'"),
    (["--gpu", "h100", "--model", "qwen9"], 2, "unknown model preset"),
    (["--gpu", "h100", "--model", "qwen3.5-9b", "--heads", "16,32,128,128"], 2, "not both"),
    (["--gpu", "h100", "--heads", "16,32,128"], 2, "four integers"),
    (["--gpu", "h100", "--heads", "16,32,128,128", "--family", "rwkv"], 2, "'rwkv' is not one of"),
    (["--gpu", "h100", "--model", "qwen3.5-9b", "--dtype", "float32"], 2, "'float32' is not one of"),
    (["--gpu", "h100", "--model", "qwen3.5-9b", "--chunk-sizes", "8,0"], 2, "positive integers"),
    (["--gpu", "h100", "--model", "qwen3.5-9b", "--batch-buckets", "1,x"], 2, "--batch-buckets"),
    (["--gpu", "h100", "--model", "qwen3.5-9b", "--draft-tokens", "4,17"], 2, "[1, 16]"),
    (["--gpu", "h100", "--model", "qwen3.5-9b", "--max-configs", "0"], 2, "--max-configs"),
    (["--gpu", "h100", "--model", "qwen3.5-9b", "--kernels", "nope"], 2, "unknown kernel"),
], ids=["unknown-card", "preset", "model-and-heads", "heads", "family", "dtype", "chunks", "buckets", "drafts",
        "max-configs", "kernels"])
def test_each_bad_input_fails_before_anything_is_built(builds, tmp_path, args, code, message):
    result = run("tune", *args, "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output
    assert builds == [] and not (tmp_path / "cache").exists()


def test_a_head_size_a_later_group_does_not_take_fails_before_the_first_build(builds, monkeypatch, tmp_path):
    plain = registry.templates

    def refuse(shape, chunk, **tunables):
        raise ValueError(f"head dim D must be 32, 64, 128 or 256, got {shape['D'] + 1}")

    def templates(family=None):  # the attention group comes last, after minutes of the others
        return [dataclasses.replace(t, trace=refuse) if family == "attention" else t for t in plain(family)]

    monkeypatch.setattr(registry, "templates", templates)
    result = run("tune", *QWEN, "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if "Error" in line]
    assert len(errors) == 1 and "attention_toy C=8 cannot be built for attention H=" in errors[0]
    assert "head dim D must be" in errors[0]
    assert builds == [] and not (tmp_path / "cache").exists()


@pytest.mark.skipif(not HAVE_TILELANG, reason="needs TileLang and nvcc (the real templates)")
def test_a_real_template_refuses_a_head_size_before_compiling(monkeypatch, tmp_path):
    from kvbuffer.autotune.template import Template

    compiled = []
    monkeypatch.setattr(Template, "compile", lambda self, *a, **k: compiled.append(self.name))
    result = run("tune", "--gpu", "h100", "--heads", "16,32,128,72", "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == 1 and result.stdout == "", result.output
    assert result.stderr.count("\n") == 2 and result.stderr.startswith("checking ")
    assert "cannot be built for gdn Hk=16 Hv=32 K=128 V=72" in result.output
    assert compiled == [] and not (tmp_path / "cache").exists()


# ----------------------------------------------------------------------------------------------
# overall progress


def test_overall_progress_goes_to_stderr_and_keeps_the_group_lines(builds, tmp_path):
    result = run("tune", *QWEN, "--chunk-sizes", "8", "--cache-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    overall = [line for line in result.stderr.splitlines() if line.startswith("overall:")]
    n = len(builds)
    assert n == 3 and len(overall) == n
    assert overall[0].startswith(f"overall: 1/{n} kernels, group 1/3, ")
    assert overall[-1].startswith(f"overall: {n}/{n} kernels, group 3/3, ") and "about 0s left" in overall[-1]
    assert all("elapsed" in line for line in overall)
    out = result.stdout.splitlines()
    assert [line.split("]")[0] for line in out if "building (untuned)" in line] == ["[1/3", "[2/3", "[3/3"]
    assert sum(": built (" in line for line in out) == n and "overall:" not in result.stdout


def test_the_estimate_counts_compiled_kernels_only(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: now[0])
    bar = TuneProgress(groups=2, kernels=10, stream=io.StringIO(), live=False)
    bar.start("a")
    bar.done(type("R", (), {"reused": True})())  # a cached kernel: no time, no rate
    assert bar.left_s() is None and "unknown" in bar.times()
    for _ in range(2):
        bar.start("b")
        now[0] += 30.0
        bar.done()
    assert bar.left_s() == pytest.approx(30.0 * 7)
    assert bar.times() == "1m00s elapsed, about 3m30s left"
    assert [duration(s) for s in (5, 312, 3720)] == ["5s", "5m12s", "1h02m"]


def test_the_live_bar_counts_kernels_and_states_the_time_left():
    out = io.StringIO()
    with TuneProgress(groups=3, kernels=12, stream=out, live=True) as bar:
        bar.start_group(1)
        bar.start("gdn_flush C=8")
        bar.done()
        bar.write("a table row\n", io.StringIO())
    text = out.getvalue()
    assert "[2/3] gdn_flush C=8" in text and "1/12 kernels" in text and "left" in text


# ----------------------------------------------------------------------------------------------
# Ctrl-C


def _interrupting(monkeypatch, root, after: int, raise_as):
    """Fake templates whose build number `after` (from 0) leaves a staging dir and raises via `raise_as`."""
    from kvbuffer.kernels import autobuild

    count = [0]

    def templates(family=None):
        tpl = fake_template(f"{family}_toy")

        def build(shape, chunk, *, target, v):
            if count[0] == after:
                (root / "staging" / f"half.{os.getpid()}.{uuid.uuid4().hex[:8]}").mkdir(parents=True)
                raise_as()
            count[0] += 1
            return FakeKernel(2.0, lambda b: 1.0)
        return [tpl if family == "gdn" else dataclasses.replace(tpl, build=build)]

    monkeypatch.setattr(registry, "templates", templates)
    monkeypatch.setattr(autobuild, "nvcc_problem", lambda: None)


def _keyboard_interrupt():
    raise KeyboardInterrupt


def _sigint_seen_as_runtime_error():
    """What TileLang's FFI does with a Ctrl-C that lands in a compile: another exception, no message."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**6):  # the handler runs between bytecodes
            pass
    except KeyboardInterrupt:
        raise RuntimeError("RuntimeError") from None
    raise AssertionError("SIGINT did not arrive")


@pytest.mark.parametrize("raise_as", [_keyboard_interrupt, _sigint_seen_as_runtime_error],
                         ids=["keyboard-interrupt", "sigint-as-runtime-error"])
def test_ctrl_c_stops_cleanly_and_keeps_what_finished(monkeypatch, tmp_path, raise_as):
    # three groups of two kernels (C=8, 16): gdn's, conv's, then attention's, whose first build is interrupted
    _interrupting(monkeypatch, tmp_path, after=2, raise_as=raise_as)
    handler = signal.getsignal(signal.SIGINT)
    result = run("tune", *QWEN, "--chunk-sizes", "8,16", "--cache-dir", str(tmp_path))
    assert result.exit_code == 130, result.output
    lines = result.output.splitlines()
    assert not any(line.startswith("Error") for line in lines)
    said = [line for line in result.stderr.splitlines() if line.startswith("Interrupted:")]
    assert said == ["Interrupted: 4 of 6 kernels built and kept, 2 of 3 tuning records written; the interrupted "
                    "build's staging removed (`kvbuffer cache prune` removes kernels no record names)"]
    cache = ArtifactCache(tmp_path)
    assert list((tmp_path / "staging").iterdir()) == []  # the half build and the tune's mark
    manifest = cache.manifest()
    assert len(manifest["tunings"]) == 2 and len(manifest["artifacts"]) == 4
    for name in manifest["tunings"]:
        for w in cache.tuning(name)["winners"]:
            cache.verify(w["artifact"])  # finished groups: records and their kernels usable
    assert signal.getsignal(signal.SIGINT) is handler


def test_an_error_without_ctrl_c_is_still_an_error(monkeypatch, tmp_path):
    def fail():
        raise RuntimeError("the compiler failed")

    _interrupting(monkeypatch, tmp_path, after=0, raise_as=fail)
    result = run("tune", *QWEN, "--chunk-sizes", "8", "--cache-dir", str(tmp_path))
    assert result.exit_code == 1 and "the compiler failed" in result.output and "Interrupted" not in result.output
    assert not list((tmp_path / "staging").glob(f"{TUNE_MARK}.*"))


def test_ctrl_c_while_checking_builds_nothing(builds, monkeypatch, tmp_path):
    plain = registry.templates

    def interrupted(shape, chunk, **tunables):
        raise KeyboardInterrupt

    monkeypatch.setattr(registry, "templates",
                        lambda family=None: [dataclasses.replace(t, trace=interrupted) for t in plain(family)])
    result = run("tune", "--gpu", "h100", "--heads", "16,32,128,128", "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines()[-1] == "Interrupted while checking the kernels to build: nothing was built"
    assert builds == [] and not (tmp_path / "cache").exists()
