"""`kvbuffer serve`: the OpenAI-compatible server (needs the `serve` extra)."""

from __future__ import annotations

import logging

import click

from .engine_options import engine_options
from .presets import resolve_model


@click.command()
@click.option("--model", "model", default=None, help="Checkpoint directory. Default: the bundled demo model.")
@click.option("--preset", default=None, help="Serve a random-weight model of this preset's shape instead "
              "(benchmarks only: it has no tokenizer, so send token ids).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--served-model-name", default=None, help="The model id clients send [default: the directory name].")
@engine_options("mode", "chunk_size", "max_batch", "max_states", "max_len", "max_prefill_tokens", "speculative",
                "device", "dtype", "cuda_graphs", "compile", max_batch=64)
@click.option("--max-waiting", default=256, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait for a slot; past them the server answers 503.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def serve(model, preset, host, port, served_model_name, config, max_waiting, log_level):
    """Serve a model over HTTP with OpenAI's completions and chat completions API.

    SIGTERM (or Ctrl-C) stops taking requests, lets those in flight finish, then exits.
    """
    try:
        import uvicorn

        from kvbuffer.serve.app import build_app
        from kvbuffer.serve.engine_loop import AsyncEngine
        from kvbuffer.serve.metrics import ServerMetrics
    except ImportError as e:
        raise click.ClickException(f"kvbuffer serve needs the serve extra: pip install 'kvbuffer[serve]' ({e})")
    from kvbuffer import LLM

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if preset is not None:
        if model is not None:
            raise click.UsageError("give --model or --preset, not both")
        source, name = _random_model(preset, config.device, config.dtype), served_model_name or preset
    else:
        source = resolve_model(model)
        name = served_model_name or source.name
    llm = LLM(source if preset else str(source), config)
    if llm.compiled:  # compile now, not in the middle of the first requests (LLM.warm_up)
        click.echo("kvbuffer serve: compiling the decode step before serving (minutes for a large model)",
                   err=True)
        llm.warm_up()
    metrics = ServerMetrics()
    app = build_app(AsyncEngine(llm, max_waiting=max_waiting, metrics=metrics), name, metrics)
    click.echo(f"kvbuffer serve: {name} (mode={config.mode}, device={llm.device}, "
               f"max_batch={config.max_batch}, max_len={config.max_len}) on http://{host}:{port}/v1", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None)


def _random_model(preset: str, device, dtype):
    """A preset's shape with random weights (the benchmarks' builder, imported only when asked for)."""
    import torch

    from kvbuffer.bench.e2e import random_model

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return random_model(preset, device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32))
