"""Comma-separated option values (`--batches 1,16,64`): one parser for every command that takes them,
so each rejects the same bad input with the same one-line usage error naming the option."""

from __future__ import annotations

import click


def positive_ints(text: str, option: str | None = None) -> tuple[int, ...]:
    """'1,16,64' -> (1, 16, 64), in the order given; BadParameter unless each value is an integer >= 1."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=option) from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"expected positive integers, got {text!r}", param_hint=option)
    return values


def numbers(text: str, option: str | None = None) -> tuple[float, ...]:
    """'0,0.5,0.9' -> (0.0, 0.5, 0.9); BadParameter unless each value is a number."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values:
        raise click.BadParameter(f"expected comma-separated numbers, got {text!r}", param_hint=option)
    return values
