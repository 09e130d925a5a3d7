"""The CLI turns every mistake into one line `Error: ...` (exit 1, or 2 for a usage error); the
traceback appears only with --debug or KVBUFFER_DEBUG=1."""

import pytest
import torch
from click.testing import CliRunner

from kvbuffer.cli.main import main
from kvbuffer.errors import CheckpointError

GEN = ["generate", "--device", "cpu", "--max-new-tokens", "2"]


def _one_error_line(result, code: int, text: str):
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and text in errors[0], result.output


@pytest.fixture
def bad_ckpt(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    return tmp_path


def test_a_checkpoint_error_is_one_line(bad_ckpt):
    r = CliRunner().invoke(main, GEN + ["--model", str(bad_ckpt), "--prompt", "x"])
    _one_error_line(r, 1, "config.json must hold a JSON object, got a list")


def test_debug_flag_and_variable_show_the_exception(bad_ckpt, monkeypatch):
    r = CliRunner().invoke(main, ["--debug"] + GEN + ["--model", str(bad_ckpt), "--prompt", "x"])
    assert r.exit_code == 1 and isinstance(r.exception, CheckpointError)
    monkeypatch.setenv("KVBUFFER_DEBUG", "1")
    r = CliRunner().invoke(main, GEN + ["--model", str(bad_ckpt), "--prompt", "x"])
    assert r.exit_code == 1 and isinstance(r.exception, CheckpointError)


def test_an_unexpected_error_names_its_type_and_debug(monkeypatch):
    import kvbuffer

    def broken(*args, **kwargs):
        raise KeyError("surprise")

    monkeypatch.setattr(kvbuffer, "LLM", broken)
    r = CliRunner().invoke(main, GEN + ["--prompt", "x"])
    _one_error_line(r, 1, "KeyError: 'surprise' (run with --debug for the traceback)")


def _binary(tmp_path):
    f = tmp_path / "prompts.bin"
    f.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    return f


def _nul(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"ab\x00cd\n")
    return f


def _empty(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("\n  \n")
    return f


USAGE = {
    "temperature nan": (["--temperature", "nan"], "must be a finite number"),
    "temperature inf": (["--temperature", "inf"], "must be a finite number"),
    "seed 1e23": (["--seed", "1e23"], "is not a valid integer"),
    "seed negative": (["--seed", "-1"], "seed must be in [0, "),
    "seed beyond 64 bits": (["--seed", str(10**23)], "seed must be in [0, "),
    "empty prompt": (["--prompt", ""], "a prompt must not be empty"),
    "draft tokens without speculative": (["--draft-tokens", "3"], "--draft-tokens needs --speculative"),
    "device banana": (["--device", "banana"], "device must be 'cpu', 'cuda' or 'cuda:N'"),
}


@pytest.mark.parametrize("case", USAGE, ids=list(USAGE))
def test_generate_usage_errors(case):
    args, text = USAGE[case]
    r = CliRunner().invoke(main, GEN + ["--prompt", "x"] * (case != "empty prompt") + args)
    _one_error_line(r, 2, text)


def test_serve_speculation_limit_without_speculation_is_a_usage_error():
    r = CliRunner().invoke(main, ["serve", "--preset", "tiny-qwen", "--disable-speculation-above", "4"])
    _one_error_line(r, 2, "--disable-speculation-above needs --speculative ngram")


@pytest.mark.parametrize("make, text", [(_binary, "is not UTF-8 text"), (_nul, "is a binary file"),
                                        (_empty, "has no prompts")], ids=["binary", "nul bytes", "empty"])
def test_bad_prompts_files(tmp_path, make, text):
    r = CliRunner().invoke(main, GEN + ["--prompts-file", str(make(tmp_path))])
    _one_error_line(r, 2, text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_generate_on_cuda_without_cuda():
    r = CliRunner().invoke(main, ["generate", "--device", "cuda", "--prompt", "x"])
    _one_error_line(r, 2, "torch sees no CUDA GPU here")


PLAN = {
    "gpu memory 1e400": (["--gpu-memory", "1e400"], 2, "must be a positive, finite size"),
    "gpu memory negative": (["--gpu-memory", "-3GiB"], 2, "must be a positive, finite size"),
    "gpu memory words": (["--gpu-memory", "lots"], 2, "is not a size such as 80GiB"),
    "context 100000000": (["--context", "100000000"], 1, "not one request of context 100000000 fits"),
}


@pytest.mark.parametrize("case", PLAN, ids=list(PLAN))
def test_plan_errors(case):
    args, code, text = PLAN[case]
    r = CliRunner().invoke(main, ["plan", "--model", "qwen3.5-9b"] + args)
    _one_error_line(r, code, text)
    assert "inf" not in r.output.replace("finite", "")


def test_plan_says_when_recurrent_fits_none():
    from kvbuffer.plan import GEOMETRIES, format_plan, plan

    geo = GEOMETRIES["qwen3.5-9b"]
    plans = plan(geo, gpu_memory=40 * 2**30, context=8, draft_tokens=4)
    plans["recurrent"] = plans["recurrent"].__class__(**{**plans["recurrent"].__dict__, "max_requests": 0})
    assert "(recurrent fits none)" in format_plan(geo, plans, context=8, draft_tokens=4)


def test_tune_with_odd_heads_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    r = CliRunner().invoke(main, ["tune", "--gpu", "h200", "--heads", "16,32,100,128", "--chunk-sizes", "16"])
    _one_error_line(r, 1, "K=100 and V=128 must be multiples of 16")


def test_a_reader_that_stops_early_gets_no_error(tmp_path):
    """`kvbuffer cache ls | head`: the pipe closing is not an error worth a line (or a traceback)."""
    import json
    import subprocess
    import sys

    # ~300 KB of listing, well past a 64 KB pipe buffer (1000 entries printed 59 KB: the command could finish
    # before the reader closed, and the test raced)
    from kvbuffer.artifacts import MARKER, MARKER_TEXT

    entries = {f"a{i:05d}": {"status": "untuned", "files": {}} for i in range(5000)}
    (tmp_path / MARKER).write_text(MARKER_TEXT)  # kvbuffer's cache, though no kvbuffer wrote this manifest
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 1, "artifacts": entries, "tunings": {}}))
    proc = subprocess.Popen([sys.executable, "-c", "from kvbuffer.cli.main import main; main()", "cache", "ls",
                             "--cache-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(100)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Error" not in err and "Traceback" not in err, err
