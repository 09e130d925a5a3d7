"""`kvbuffer plan`: how many concurrent requests fit, with KVBuffer and with today's scheme."""

from __future__ import annotations

import math

import click

from kvbuffer.defaults import DEFAULT_CHUNK_SIZE


def _bytes(text: str) -> int:
    """'80GiB', '141GB', '512MiB' or a bare number of GiB -> bytes, finite and positive."""
    units = {"gib": 2**30, "gb": 10**9, "mib": 2**20, "mb": 10**6}
    t = text.strip().lower()
    number, factor = t, 2**30  # a bare number is GiB
    for unit, f in units.items():
        if t.endswith(unit):
            number, factor = t[: -len(unit)], f
            break
    try:
        value = float(number) * factor
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size such as 80GiB, 141GB or 512MiB",
                                 param_hint="--gpu-memory") from None
    if not math.isfinite(value) or value <= 0:
        raise click.BadParameter(f"{text!r} must be a positive, finite size", param_hint="--gpu-memory")
    return int(value)


@click.command("plan")
@click.option("--model", required=True, help="A preset (qwen3.5-9b, ..., nemotron-3-super) or a checkpoint directory.")
@click.option("--gpu-memory", default="141GiB", show_default=True, help="Memory of one GPU, e.g. 80GiB or 141GB.")
@click.option("--draft-tokens", default=0, show_default=True, type=click.IntRange(min=0),
              help="Draft tokens a speculative step verifies (0: no speculation).")
@click.option("--context", default=4096, show_default=True, type=click.IntRange(min=1), help="Tokens per request.")
@click.option("--chunk-size", default=DEFAULT_CHUNK_SIZE, show_default=True, type=click.IntRange(min=1),
              help="KVBuffer's buffer length C: entries held per request before they fold into its state.")
@click.option("--reserve", default=0.1, show_default=True, type=click.FloatRange(0, 0.9),
              help="Fraction of memory kept for activations and workspaces.")
def plan_command(model, gpu_memory, draft_tokens, context, chunk_size, reserve):
    """Bytes per request and maximum concurrent requests for both schemes."""
    from pathlib import Path

    from kvbuffer.plan import GEOMETRIES, format_plan, geometry_of, plan

    if model.lower() in GEOMETRIES:
        geo = GEOMETRIES[model.lower()]
    elif Path(model, "config.json").is_file():
        from kvbuffer.models.loader import build_model, read_config

        geo = geometry_of(build_model(read_config(model)).to(dtype=__import__("torch").bfloat16))
    else:
        raise click.BadParameter(f"{model!r} is neither a preset ({', '.join(GEOMETRIES)}) nor a checkpoint dir",
                                 param_hint="--model")
    try:
        plans = plan(geo, gpu_memory=_bytes(gpu_memory), context=context, draft_tokens=draft_tokens,
                     chunk_size=chunk_size, reserve_fraction=reserve)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(format_plan(geo, plans, context=context, draft_tokens=draft_tokens))
