"""`kvbuffer serve`: the OpenAI-compatible server (needs the `serve` extra)."""

from __future__ import annotations

import errno
import logging
import signal
import socket

import click

from kvbuffer.serve.limits import DEFAULT_MAX_BODY_BYTES

from .engine_options import engine_options
from .presets import resolve_model


@click.command()
@click.option("--model", "model", default=None, help="Checkpoint directory. Default: the bundled demo model.")
@click.option("--preset", default=None, help="Serve a random-weight model of this preset's shape instead "
              "(benchmarks only: it has no tokenizer, so send token ids).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every IPv4 interface).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (checked before the model loads).")
@click.option("--served-model-name", default=None, help="The model id clients send [default: the directory name].")
@click.option("--chat-template", default=None, help="A Jinja chat template, as a file or inline, for chat prompts "
              "[default: the tokenizer's].")
@engine_options("mode", "chunk_size", "max_batch", "max_states", "memory_budget", "max_len", "max_prefill_tokens",
                "prefill_tokens_while_decoding", "speculative", "device", "dtype", "cuda_graphs", "compile",
                max_batch=64)
@click.option("--max-waiting", default=256, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait for a slot; past them the server answers 503.")
@click.option("--max-body-bytes", default=DEFAULT_MAX_BODY_BYTES, show_default=True, type=click.IntRange(min=1),
              help="Largest request body taken; a larger one gets HTTP 413.")
@click.option("--api-key", envvar="KVBUFFER_API_KEY", default=None, show_envvar=True,
              help="Require 'Authorization: Bearer <key>' on every route but /health (HTTP 401 without it). "
              "Prefer the environment variable: a command line is visible to other users.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, help="debug also logs one line per request (id, tokens, params, finish, latency).")
def serve(model, preset, host, port, served_model_name, chat_template, config, max_waiting, max_body_bytes, api_key,
          log_level):
    """Serve a model over HTTP with OpenAI's completions and chat completions API.

    SIGTERM (or Ctrl-C) stops taking requests, lets those in flight finish, then exits (0).
    """
    try:
        import uvicorn

        from kvbuffer.serve.app import build_app
        from kvbuffer.serve.engine_loop import AsyncEngine
        from kvbuffer.serve.metrics import ServerMetrics
    except ImportError as e:
        raise click.ClickException(f"kvbuffer serve needs the serve extra: pip install 'kvbuffer[serve]' ({e})")
    from kvbuffer import LLM
    from kvbuffer.engine.compiled import keep_inductor_cache

    if preset is not None and model is not None:
        raise click.UsageError("give --model or --preset, not both")
    if api_key is not None and not api_key.strip():
        raise click.BadParameter("the API key must not be empty", param_hint="--api-key / KVBUFFER_API_KEY")
    template = _chat_template(chat_template)
    if preset is not None:
        _check_preset(preset)
    else:
        model = resolve_model(model)
    check_port(host, port)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if preset is not None:
        source, name = _random_model(preset, config.device, config.dtype), served_model_name or preset
    else:
        source, name = str(model), served_model_name or model.name
    keep_inductor_cache()
    llm = LLM(source, config)
    if llm.compiled:  # compile now, not in the middle of the first requests (LLM.warm_up: one stderr line)
        llm.warm_up()
    metrics = ServerMetrics()
    app = build_app(AsyncEngine(llm, max_waiting=max_waiting, metrics=metrics), name, metrics, template,
                    api_key=api_key, max_body_bytes=max_body_bytes)
    click.echo(f"kvbuffer serve: {name} (mode={config.mode}, device={llm.device}, "
               f"max_batch={config.max_batch}, max_len={config.max_len}) on http://{host}:{port}/v1"
               f"{' (API key required)' if api_key is not None else ''}", err=True)
    signal.signal(signal.SIGTERM, _drained)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None)


def _drained(_signum, _frame):
    """uvicorn drains on SIGTERM, then raises the signal again once its own handler is gone: this
    handler receives it, so a drained shutdown exits 0, as one on Ctrl-C does."""
    raise SystemExit(0)


class CannotListen(click.ClickException):
    """The address or port given cannot be listened on: a usage mistake (exit 2, as click's), one line."""
    exit_code = 2


def check_port(host: str, port: int) -> None:
    """Bind host:port and let it go, so that a taken port is a one-line error before the model loads
    (with SO_REUSEADDR, as uvicorn binds: a port in TIME_WAIT is free)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise CannotListen(f"port {port} on {host} is in use") from None
        raise CannotListen(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _chat_template(value: str | None):
    """--chat-template's value, loaded and compiled (a usage error where it is neither file nor template)."""
    if value is None:
        return None
    from kvbuffer.serve.chat import ChatTemplate

    try:
        return ChatTemplate.load(value)
    except (ValueError, ImportError, OSError) as e:
        raise click.BadParameter(str(e), param_hint="--chat-template") from None


def _check_preset(preset: str) -> None:
    """An unknown --preset is a usage error, found before anything loads."""
    from kvbuffer.presets import get

    try:
        get(preset)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--preset") from None


def _random_model(preset: str, device, dtype):
    """A preset's shape with random weights (the benchmarks' builder, imported only when asked for)."""
    import torch

    from kvbuffer.bench.e2e import random_model

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return random_model(preset, device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32))
