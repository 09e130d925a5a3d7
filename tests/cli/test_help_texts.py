"""Every option of every command says what it does in `--help`: a bare `--seed INTEGER` leaves the user
guessing what the number seeds and what the default is."""

import click

from kvbuffer.cli.main import main


def _commands(group: click.Group, prefix: tuple[str, ...] = ()):
    """(path, command) of every command under `group`, the group's own included."""
    yield prefix, group
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, prefix + (name,))
        else:
            yield prefix + (name,), command


# Options of kvbuffer/serve/benchmark.py still without help text; nothing may join them.


def test_every_option_has_help_text():
    bare = [f"kvbuffer {' '.join(path)} {param.opts[0]}".replace("  ", " ")
            for path, command in _commands(main) for param in command.params
            if isinstance(param, click.Option) and not param.hidden and not (param.help or "").strip()]
    assert not bare, f"options without help text: {sorted(bare)}"


def test_the_walk_sees_the_nested_commands():
    paths = {" ".join(path) for path, _ in _commands(main)}
    assert {"generate", "serve", "bench decode", "cache ls"} <= paths
