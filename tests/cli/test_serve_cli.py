"""`kvbuffer serve`'s command line: usage mistakes exit 2 with one line, before the model loads (a
taken port, an unknown preset, a bad chat template); every option has help; `~` in --model expands."""

import socket

import pytest
from click.testing import CliRunner

import kvbuffer
from kvbuffer.cli.main import main
from kvbuffer.cli.presets import resolve_model
from kvbuffer.cli.serve import check_port, serve

pytest.importorskip("fastapi")


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model loaded before the mistake was reported")
    monkeypatch.setattr(kvbuffer, "LLM", refuse)


def _one_usage_error(result, text: str):
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and text in errors[0] and "Traceback" not in result.output, result.output
    assert "kvbuffer serve:" not in result.output


def test_a_port_in_use_is_one_line_before_the_model_loads(no_model_load):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = CliRunner().invoke(main, ["serve", "--device", "cpu", "--port", str(port)])
    assert r.output.strip() == f"Error: port {port} on 127.0.0.1 is in use" and r.exit_code == 2
    check_port("127.0.0.1", port)  # free again once the listener closed


def test_a_host_that_cannot_be_bound_is_a_usage_error(no_model_load):
    r = CliRunner().invoke(main, ["serve", "--device", "cpu", "--host", "203.0.113.7", "--port", "0"])
    _one_usage_error(r, "cannot listen on 203.0.113.7:0")


@pytest.mark.parametrize("args, text", [
    (["--preset", "nope"], "unknown model preset 'nope'"),
    (["--chat-template", "no/such/file.jinja"], "is not a file"),
    (["--chat-template", "{% if %}"], "chat template: line 1"),
    (["--memory-budget", "0"], "memory_budget must be >= 1"),
    (["--model", "/no/such/dir"], "is not a checkpoint directory"),
], ids=["preset", "template-file", "template-syntax", "memory-budget", "model"])
def test_usage_mistakes_exit_2_like_generate(no_model_load, args, text):
    _one_usage_error(CliRunner().invoke(main, ["serve", "--device", "cpu", *args]), text)


def test_every_serve_option_has_help():
    missing = [p.opts[0] for p in serve.params if getattr(p, "help", None) in (None, "") and not p.hidden
               and p.name != "help"]
    assert not missing, missing


def test_model_paths_expand_the_home_directory(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/ckpt") == tmp_path / "ckpt"


def test_generate_takes_the_penalties():
    args = ["generate", "--device", "cpu", "--prompt", "the the the ", "--max-new-tokens", "24"]
    plain = CliRunner().invoke(main, args)
    penalized = CliRunner().invoke(main, args + ["--repetition-penalty", "1.8", "--presence-penalty", "0.5"])
    assert plain.exit_code == penalized.exit_code == 0 and plain.output != penalized.output
    bad = CliRunner().invoke(main, args + ["--frequency-penalty", "nan"])
    assert bad.exit_code == 2 and "finite" in bad.output
