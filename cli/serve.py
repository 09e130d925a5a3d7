"""`kvbuffer serve`: the OpenAI-compatible server (needs the `serve` extra)."""

from __future__ import annotations

import logging

import click

from .engine_options import compile_option
from .presets import resolve_model


@click.command()
@click.option("--model", "model", default=None, help="Checkpoint directory. Default: the bundled demo model.")
@click.option("--preset", default=None, help="Serve a random-weight model of this preset's shape instead "
              "(benchmarks only: it has no tokenizer, so send token ids).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--served-model-name", default=None, help="The model id clients send [default: the directory name].")
@click.option("--mode", type=click.Choice(["kvbuffer", "recurrent"]), default="kvbuffer", show_default=True)
@click.option("--chunk-size", default=None, type=click.IntRange(min=1),
              help="Buffer entries folded into the state per flush (C) [default: the tuned policy, else 16].")
@click.option("--max-batch", default=64, show_default=True, type=click.IntRange(min=1),
              help="Requests decoded together (request slots).")
@click.option("--max-states", default=None, type=click.IntRange(min=1),
              help="Recurrent state slots [default: --max-batch]; requests wait for one when all are taken.")
@click.option("--max-len", default=2048, show_default=True, type=click.IntRange(min=2),
              help="Longest context per request; a request that reaches it ends with finish_reason 'length'.")
@click.option("--max-prefill-tokens", default=1024, show_default=True, type=click.IntRange(min=1))
@click.option("--max-waiting", default=256, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait for a slot; past them the server answers 503.")
@click.option("--speculative", type=click.Choice(["ngram", "mtp"]), default=None,
              help="Speculative decoding: n-gram prompt lookup, or the checkpoint's MTP head.")
@click.option("--draft-tokens", default=4, show_default=True, type=click.IntRange(1, 16))
@click.option("--disable-speculation-above", default=None, type=click.IntRange(min=1),
              help="With --speculative ngram: steps with more running requests decode plainly (a verify's GEMMs "
                   "turn compute-bound at large batch, where speculating costs more than it saves).")
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None)
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True)
@compile_option
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def serve(model, preset, host, port, served_model_name, mode, chunk_size, max_batch, max_states, max_len,
          max_prefill_tokens, max_waiting, speculative, draft_tokens, disable_speculation_above, device, dtype,
          cuda_graphs, compile_, log_level):
    """Serve a model over HTTP with OpenAI's completions and chat completions API.

    SIGTERM (or Ctrl-C) stops taking requests, lets those in flight finish, then exits.
    """
    if disable_speculation_above is not None and speculative is None:
        raise click.UsageError("--disable-speculation-above needs --speculative ngram")
    try:
        import uvicorn

        from kvbuffer.serve.app import build_app
        from kvbuffer.serve.engine_loop import AsyncEngine
        from kvbuffer.serve.metrics import ServerMetrics
    except ImportError as e:
        raise click.ClickException(f"kvbuffer serve needs the serve extra: pip install 'kvbuffer[serve]' ({e})")
    import torch

    from kvbuffer import LLM

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    torch_dtype = getattr(torch, dtype) if dtype else None
    if preset is not None:
        if model is not None:
            raise click.UsageError("give --model or --preset, not both")
        source, name = _random_model(preset, device, torch_dtype), served_model_name or preset
    else:
        source = resolve_model(model)
        name = served_model_name or source.name
    llm = LLM(source if preset else str(source), device=device, dtype=torch_dtype, mode=mode, chunk_size=chunk_size,
              max_batch=max_batch, max_states=max_states, max_len=max_len, max_prefill_tokens=max_prefill_tokens,
              speculative={"method": speculative, "num_draft_tokens": draft_tokens,
                           "disable_above_batch": disable_speculation_above} if speculative else None,
              cuda_graphs="auto" if cuda_graphs else False, compile=compile_)
    if llm.compiled:  # compile now, not in the middle of the first requests (LLM.warm_up)
        click.echo("kvbuffer serve: compiling the decode step before serving (minutes for a large model)",
                   err=True)
        llm.warm_up()
    metrics = ServerMetrics()
    app = build_app(AsyncEngine(llm, max_waiting=max_waiting, metrics=metrics), name, metrics)
    click.echo(f"kvbuffer serve: {name} (mode={mode}, device={llm.device}, max_batch={max_batch}, "
               f"max_len={max_len}) on http://{host}:{port}/v1", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None)


def _random_model(preset: str, device, dtype):
    """A preset's shape with random weights (the benchmarks' builder, imported only when asked for)."""
    import torch

    from kvbuffer.bench.e2e import random_model

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return random_model(preset, device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32))
