"""`kvbuffer generate`: run a checkpoint (or the bundled demo model) on prompts."""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

import click

from kvbuffer.engine.validate import MIN_TEMPERATURE, check_temperature

from .engine_options import engine_options
from .presets import resolve_model


def _temperature(ctx, param, value):
    """The engine's own temperature rule (0, or at least its MIN_TEMPERATURE), as a usage error."""
    try:
        check_temperature(value)
    except (TypeError, ValueError):
        raise click.BadParameter(f"must be a finite number, 0 (greedy) or >= {MIN_TEMPERATURE}, got {value}") from None
    return value


def _seed(ctx, param, value):
    """The engine's own seed check, as a usage error."""
    from kvbuffer.engine.validate import check_seed

    try:
        check_seed(value)
    except (TypeError, ValueError) as e:
        raise click.BadParameter(str(e)) from None
    return value


@click.command()
@click.option("--model", "model", default=None, help="Checkpoint directory (config.json + *.safetensors). "
              "Default: the small demo model bundled with kvbuffer.")
@click.option("--prompt", "prompts", multiple=True, callback=lambda ctx, param, v: _non_empty(v),
              help="A prompt (repeat for a batch).")
@click.option("--prompts-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A file with one prompt per line.")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1),
              help="Most tokens generated per prompt (fewer where the model ends its text).")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              callback=_temperature, help=f"0 = greedy; else at least {MIN_TEMPERATURE}.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0),
              help="Sample among the k likeliest tokens only; 0 = all.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True),
              help="Sample among the likeliest tokens whose probabilities sum to p (nucleus); 1 = all.")
@click.option("--seed", default=None, type=int, callback=_seed,
              help="Seed of the sampling (prompt i draws from seed + i): the same seed repeats a sampled output. "
                   "Default: torch's global generator.")
@click.option("--presence-penalty", default=0.0, show_default=True, type=click.FloatRange(-2.0, 2.0),
              callback=lambda ctx, param, v: _finite(v),
              help="Subtracted once from the logit of every token generated so far (OpenAI's).")
@click.option("--frequency-penalty", default=0.0, show_default=True, type=click.FloatRange(-2.0, 2.0),
              callback=lambda ctx, param, v: _finite(v),
              help="Subtracted from a token's logit once per time it was generated so far (OpenAI's).")
@click.option("--repetition-penalty", default=1.0, show_default=True, type=click.FloatRange(min=0.0, min_open=True),
              callback=lambda ctx, param, v: _finite(v),
              help="Divides the positive logits (multiplies the negative ones) of the prompt's and the output's "
                   "tokens (vLLM's); 1 = off.")
@engine_options("mode", "chunk_size", "speculative", "max_len", "device", "dtype", "cuda_graphs", "compile")
def generate(model, prompts, prompts_file, max_new_tokens, temperature, top_k, top_p, seed, presence_penalty,
             frequency_penalty, repetition_penalty, config):
    """Generate text. Streams the output when there is a single prompt.

    --compile auto (the default) compiles the decode step only for a run long enough to repay it: at
    least 4096 decode steps (--max-new-tokens times the rounds of up to 64 prompts)."""
    from kvbuffer import LLM
    from kvbuffer.detokenize import IncrementalDetokenizer
    from kvbuffer.engine.compiled import keep_inductor_cache

    texts = list(prompts) + (_read_prompts(prompts_file) if prompts_file else [])
    if not texts:
        texts = ["The "]
    path = resolve_model(model)
    batch = max(1, min(len(texts), 64))
    config = _short_runs_uncompiled(config, max_new_tokens * -(-len(texts) // batch))
    keep_inductor_cache()
    llm = LLM(str(path), config, max_batch=batch)
    if llm.tokenizer is None:
        raise click.UsageError(f"{path} has no tokenizer files, so text prompts cannot be encoded")
    if llm.compiled:
        click.get_current_context().with_resource(_quiet_item_graph_breaks())  # until the command ends
        _compile(llm)
    stream = len(texts) == 1
    if stream:
        click.echo(texts[0], nl=False)

    detok = IncrementalDetokenizer(llm.tokenizer, llm.tokenizer.encode(texts[0])) if stream else None

    def on_token(_index, token):  # whole characters only: a UTF-8 character may span several tokens
        piece = detok.add(token)
        if piece:
            click.echo(piece, nl=False)
            sys.stdout.flush()

    t0 = time.perf_counter()
    try:
        outs = llm.generate(texts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, on_token=on_token if stream else None, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty)
    except BaseException:
        if stream:  # end the echoed prompt's line: an error (a prompt past --max-len, Ctrl-C) starts its own
            click.echo()
        raise
    elapsed = time.perf_counter() - t0
    if stream:
        click.echo(detok.flush())
        sys.stdout.flush()
    else:
        for text, out in zip(texts, outs):
            click.echo(f"--- {text!r}\n{out.text}")
    stats = llm.last_stats
    spec, speculative = "", config.speculative
    if speculative:
        acc = llm.acceptance
        spec = f", {speculative.method} drafts accepted {acc['acceptance_rate']:.0%}, {acc['tokens_per_step']:.2f} tokens/step"
    linear = "kernels" if llm.kernels else "reference ops"
    click.echo(f"[{stats.generated_tokens} tokens from {stats.requests} prompt(s) in {elapsed:.2f}s: "
               f"{stats.tokens_per_second:.1f} tok/s, mode={config.mode}, device={llm.device}, linear layers on "
               f"{linear}{spec}]", err=True)
    if llm.device.type == "cuda" and not llm.kernels and llm.kernels_reason.startswith("no compiled kernel"):
        click.echo(f"note: the linear layers ran on the reference ops: {llm.kernels_reason}", err=True)
    elif llm.kernels and llm.backend.conv_on_reference:
        click.echo("note: the short conv ran on the reference ops (no compiled conv kernel); build it with "
                   f"`{_tune_command(llm, path, speculative and speculative.num_draft_tokens)}`", err=True)


def _short_runs_uncompiled(config, steps: int):
    """--compile auto (the default) compiles only a run of enough decode steps to repay it
    (kvbuffer.engine.compiled.worth_compiling); --compile true and false are kept as given."""
    import dataclasses

    from kvbuffer.engine.compiled import worth_compiling

    if config.compile != "auto" or worth_compiling(steps):
        return config
    return dataclasses.replace(config, compile=False)


def _compile(llm) -> None:
    """Compile the decode forward now (LLM.warm_up: the compile says so on one stderr line), so that
    the output's first tokens do not wait for it."""
    llm.warm_up()


class _quiet_item_graph_breaks(logging.Filter):
    """Drops dynamo's one warning "Graph break from `Tensor.item()`" (16 lines) while entered. The
    reference ops read slot indices and buffer fills back to the host to check them (kvbuffer.checks,
    kvbuffer.reference.core): on the CPU those reads split the compiled forward by design, with no loss that
    matters, and the warning's advice (capture_scalar_outputs) is not one kvbuffer takes. Every other dynamo
    message still shows."""

    LOGGER = "torch._dynamo.variables.tensor"

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Graph break from `Tensor.item()`")

    def __enter__(self):
        logging.getLogger(self.LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(self.LOGGER).removeFilter(self)


def _non_empty(prompts: tuple[str, ...]) -> tuple[str, ...]:
    if any(p == "" for p in prompts):
        raise click.BadParameter("a prompt must not be empty", param_hint="--prompt")
    return prompts


def _finite(value: float) -> float:
    if not math.isfinite(value):  # FloatRange lets NaN and infinity through
        raise click.BadParameter(f"must be a finite number, got {value}")
    return value


def _read_prompts(path: Path) -> list[str]:
    """The file's non-blank lines; a binary or empty file is a mistake, not a prompt."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.BadParameter(f"{path} is not UTF-8 text (byte {e.start})", param_hint="--prompts-file") from None
    if "\x00" in text:
        raise click.BadParameter(f"{path} is a binary file (it holds NUL bytes)", param_hint="--prompts-file")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise click.BadParameter(f"{path} has no prompts (every line is blank)", param_hint="--prompts-file")
    return lines


def _tune_command(llm, path, drafts) -> str:
    """The `kvbuffer tune` run that builds what this engine launches (its C, dtype and drafts)."""
    import torch

    return (f"kvbuffer tune --model {path} --chunk-sizes {llm.chunk_size}"
            + (" --dtype float16" if llm.dtype == torch.float16 else "")  # the kernels run fp32 models in bf16
            + (f" --draft-tokens {drafts}" if drafts else ""))
