"""README.md keeps working as written: its Python examples run, every `kvbuffer` command in it parses
with the options it shows, the commands that run on a CPU run (the demo, the capacity plan, whose
printed output must match), and every repository path it names exists."""

import pathlib
import re
import shlex

import click
import pytest
from click.testing import CliRunner

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def blocks(lang: str) -> list[str]:
    """The README's fenced blocks of one language ("" for those without one), in order."""
    return [body for tag, body in re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(), re.M | re.S) if tag == lang]


def kvbuffer_commands() -> list[list[str]]:
    """Every `kvbuffer ...` line of the README's bash blocks, continuations joined, comments dropped."""
    commands = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["kvbuffer"]:
                commands.append(words[1:])
    return commands


def resolve(args: list[str]) -> tuple[click.Command, list[str], str]:
    """The click command an argument list names, the arguments left for it, and its path."""
    from kvbuffer.cli.main import main

    command, path = main, "kvbuffer"
    while isinstance(command, click.Group) and args and args[0] in command.commands:
        path += " " + args[0]
        command, args = command.commands[args[0]], args[1:]
    return command, args, path


def test_readme_python_examples_run(capsys):
    found = blocks("python")
    assert found, "README has no python example"
    for block in found:
        exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "same tokens with kvbuffer: True" in out


def test_readme_commands_parse(tmp_path, monkeypatch):
    """Each command names a real subcommand and only options it has, with values of the right type."""
    commands = kvbuffer_commands()
    assert {c[0] for c in commands} >= {"generate", "serve", "plan", "tune", "cache", "env"}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("The \n")  # the file `--prompts-file prompts.txt` names
    for args in commands:
        command, rest, path = resolve(args)
        assert not isinstance(command, click.Group), f"README: `kvbuffer {shlex.join(args)}`: no subcommand"
        try:
            command.make_context(path, list(rest))
        except click.exceptions.Exit:
            pass  # an eager option such as --list-gpus did its work while parsing
        except click.ClickException as e:
            pytest.fail(f"README: `kvbuffer {shlex.join(args)}` does not parse: {e.format_message()}")


def test_readme_demo_and_plan_commands_run(tmp_path, monkeypatch):
    from kvbuffer.cli.main import main

    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    plan_args = next(c for c in kvbuffer_commands() if c[0] == "plan")
    result = CliRunner().invoke(main, plan_args)
    assert result.exit_code == 0, result.output
    shown = next(b for b in blocks("") if b.startswith(plan_args[plan_args.index("--model") + 1] + ":"))
    assert result.output.strip() == shown.strip(), "README's plan output differs from what the command prints"

    demo = next(c for c in kvbuffer_commands() if c[0] == "generate" and "--model" not in c)
    result = CliRunner().invoke(main, [*demo, "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert demo[demo.index("--prompt") + 1] in result.output


def test_readme_paths_exist():
    named = set(re.findall(r"`((?:docs|tests|scripts|benchmarks|kvbuffer|tiles|autotune|cli)/[\w./-]*)`",
                           README.read_text()))
    assert named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"README names paths that do not exist: {missing}"
