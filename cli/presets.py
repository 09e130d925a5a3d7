"""Where `--model` points: a checkpoint directory, or the demo model bundled with kvbuffer."""

from __future__ import annotations

from pathlib import Path

import click


def resolve_model(model: str | None) -> Path:
    """A checkpoint directory for --model (None = the bundled demo model; `~` expanded, which the shell
    does not do in `--model=~/x`)."""
    from kvbuffer import demo_checkpoint

    path = demo_checkpoint() if model is None else Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise click.BadParameter(f"{path} is not a checkpoint directory (no config.json)", param_hint="--model")
    return path
