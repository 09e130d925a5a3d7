"""`kvbuffer bench gdn|mamba2|decode|spec|prefill|transformers|serve`: the benchmarks of kvbuffer.bench
(CUDA; `prefill --what e2e --device cpu` also runs on a CPU).

Each subcommand parses its options and calls kvbuffer.bench; `kvbuffer bench SUBCOMMAND --help`
lists them. Results (JSON, figure, table) land in --out, benchmarks/results/ by default.
"""

from __future__ import annotations

import click

from kvbuffer.bench import KERNEL_BATCHES
from kvbuffer.defaults import DEFAULT_CHUNK_SIZE, MAX_DRAFT_TOKENS
from kvbuffer.option_values import numbers, positive_ints

from .engine_options import engine_options


def _out_option(f):
    from kvbuffer.bench.results import DEFAULT_DIR

    return click.option("--out", default=DEFAULT_DIR, show_default=True, type=click.Path(file_okay=False),
                        help="Folder for the results JSON, figure and table.")(f)


@click.group("bench", invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def bench(ctx):
    """Benchmark the buffered kernels and the engine against the recurrent scheme and the peers (CUDA)."""
    if ctx.invoked_subcommand is None:
        need_cuda()
        click.echo(ctx.get_help())


def need_cuda() -> None:
    """One line and exit status 1 where no CUDA GPU is visible (checked when a benchmark runs, after --help)."""
    import torch

    if not torch.cuda.is_available():
        raise click.ClickException("kvbuffer bench times GPU work and needs a CUDA GPU; none is visible")


def _kernel_command(family: str, peer: str):
    @bench.command(family, help=f"Time the {family} decode kernels (ours and {peer}) in CUDA graphs, B = 1 to 1024.")
    @click.option("--shapes",
                  help=f"Model presets whose head shapes to time (default: kvbuffer.bench.{family}.SHAPES).")
    @click.option("--batches", default=",".join(map(str, KERNEL_BATCHES)), show_default=True, help="Batch sizes.")
    @click.option("--chunk-size", "C", default=DEFAULT_CHUNK_SIZE, show_default=True, type=click.IntRange(min=1),
                  help="Buffer chunk size C (the buffered step flushes at C).")
    @click.option("--cap", default=24, show_default=True, type=click.IntRange(min=2), help="Buffer entries per row.")
    @click.option("--launches", default=32, show_default=True, type=click.IntRange(min=1),
                  help="Launches captured in one CUDA graph.")
    @click.option("--replays", default=20, show_default=True, type=click.IntRange(min=1),
                  help="Graph replays; the median is reported.")
    @click.option("--configs", type=click.Path(exists=True, dir_okay=False),
                  help="JSON {preset: {recurrent|buffered|verify: tunables}} (verify follows buffered unless given); "
                       "default: the tunables the runtime gives untuned kernels.")
    @click.option("--tuned", is_flag=True,
                  help="At each batch, time the recurrent and decode steps `kvbuffer tune` picked for its bucket on "
                       "this GPU (--configs still overrides).")
    @_out_option
    def command(shapes, batches, C, cap, launches, replays, configs, tuned, out):
        import importlib
        import json

        need_cuda()
        from kvbuffer.bench import kernels, results

        module = importlib.import_module(f"kvbuffer.bench.{family}")
        cfg = json.loads(open(configs).read()) if configs else None
        chosen = tuple(s for s in shapes.split(",") if s) if shapes else module.SHAPES
        stem = "_".join((family,) + chosen)  # runs of other shapes on the same day keep their own files
        sizes = positive_ints(batches, "--batches")
        result = module.run(shapes=chosen, batches=sizes, C=C, cap=cap, configs=cfg, tuned=tuned, launches=launches,
                            replays=replays, on_row=lambda r: results.write(r, results.result_path(out, stem, r)))
        text = kernels.table(result)
        click.echo(text)
        for p in results.finish(result, results.result_path(out, stem, result), text):
            click.echo(f"wrote {p}")

    return command


_kernel_command("gdn", "FLA's fused_recurrent_gated_delta_rule, SGLang's ReplaySSM step and verify where importable")
_kernel_command("mamba2", "mamba_ssm's selective_state_update, vLLM's ReplaySSM step where importable")


def _fp8_option(f):
    return click.option("--fp8", is_flag=True,
                        help="Projections in FP8, as the preset's family publishes them (Qwen: block FP8, 128 x 128 "
                             "scales; Nemotron: ModelOpt per-tensor FP8): the random model quantized as loading "
                             "such a checkpoint gives it.")(f)


def _fp8_keyword(fp8: bool) -> dict:
    """The benchmark's keyword for --fp8 (none without it: the bf16 runs call exactly what they did)."""
    return {"fp8": True} if fp8 else {}


def _engine_options(f):
    options = [
        click.option("--preset", default="qwen3.5-9b", show_default=True,
                     help="Model preset (kvbuffer.presets): random weights in its shapes."),
        _fp8_option,
        click.option("--modes", default="kvbuffer,recurrent", show_default=True,
                     help="Engine modes to compare: kvbuffer, recurrent, peers (the recurrent scheme on the "
                          "servers' kernels: FLA, mamba_ssm), replayssm (the servers' ReplaySSM kernels in the "
                          "engine: SGLang's GDN step, verify and commit, vLLM's Mamba-2 step, on their own rings; "
                          "from an installed sglang / vllm or a python -m kvbuffer.bench.peer_sources folder on "
                          "PYTHONPATH)."),
        click.option("--replayssm-ring", type=click.Choice(["float32", "bfloat16"]), default="float32",
                     show_default=True, help="replayssm: SGLang's GDN decode ring dtype (float32 is its default; "
                                             "its speculative rings are bfloat16)."),
        click.option("--prompt-len", default=128, show_default=True, type=click.IntRange(min=1),
                     help="Prompt tokens. decode staggers them over one chunk (prompt-len .. prompt-len + "
                          "chunk-size - 1), so each step flushes 1/chunk-size of the rows, as a server does."),
        click.option("--new-tokens", default=32, show_default=True, type=click.IntRange(min=2),
                     help="Tokens generated per request."),
        # the benchmarks compile only when asked (--compile auto | true): each engine they time compiles anew
        engine_options("chunk_size", "kernels", "cuda_graphs", "compile", chunk_size=DEFAULT_CHUNK_SIZE, compile=False),
        _out_option,
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _engine_run(what, preset, fp8, modes, config, out, **options):
    from kvbuffer import presets
    from kvbuffer.bench import e2e
    from kvbuffer.engine.compiled import keep_inductor_cache

    keep_inductor_cache()
    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    try:
        e2e.check_modes(chosen, prompt_len=options["prompt_len"], chunk_size=config.chunk_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--modes") from None
    need_cuda()
    try:
        presets.get(preset)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--preset") from None
    e2e.run(what, preset=preset, out_dir=out, modes=chosen, chunk_size=config.chunk_size,
            kernels=config.kernels, cuda_graphs=config.cuda_graphs, compile=config.compile, **_fp8_keyword(fp8),
            **options)


def _profile_option(f):
    return click.option("--profile-batch", default=0, show_default=True, type=click.IntRange(min=0),
                        help="Profile the steps at this batch (wall vs device time, launches, device time by "
                             "kernel class); 0: none.")(f)


@bench.command("decode")
@_engine_options
@click.option("--batches", default="1,16,64,256", show_default=True, help="Batch sizes.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Sample every request at this temperature (0: greedy).")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True),
              help="Nucleus mass for the sampled requests.")
@engine_options("gemv")
@_profile_option
def decode(preset, fp8, modes, replayssm_ring, prompt_len, new_tokens, config, out, batches, temperature, top_p,
           profile_batch):
    """Decode throughput and step latency, kvbuffer vs the recurrent scheme, random-weight model (the peers
    and replayssm rows always run torch's GEMM)."""
    _engine_run("decode", preset, fp8, modes, config, out, prompt_len=prompt_len, new_tokens=new_tokens,
                replayssm_ring=replayssm_ring,
                batches=positive_ints(batches, "--batches"), temperature=temperature, top_p=top_p, gemv=config.gemv,
                profile_batch=profile_batch)


@bench.command("spec")
@_engine_options
@click.option("--setting", "settings", multiple=True, type=click.Choice(["equal", "capacity"]),
              default=("equal", "capacity"), show_default=True,
              help="equal: both modes admit the same requests; capacity: as many as --memory-budget holds.")
@click.option("--batches", default="1,16,64,256", show_default=True, help="Batch sizes of the equal setting.")
@click.option("--alphas", default="0,0.5,0.7,0.9", show_default=True,
              help="Probability that each draft is right (until the first miss).")
@click.option("--draft-tokens", default=4, show_default=True, type=click.IntRange(1, MAX_DRAFT_TOKENS),
              help="Drafts per step.")
@click.option("--memory-budget", default=40.0, show_default=True, type=click.FloatRange(min=0),
              help="GiB for the per-request caches (capacity setting).")
@click.option("--max-requests", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Cap on the requests admitted (capacity setting).")
@_profile_option
def spec(preset, fp8, modes, replayssm_ring, prompt_len, new_tokens, config, out, settings, batches, alphas,
         draft_tokens, memory_budget, max_requests, profile_batch):
    """Speculative decoding with a drafter of chosen acceptance: equal batch and under a memory budget."""
    _engine_run("spec", preset, fp8, modes, config, out, prompt_len=prompt_len, new_tokens=new_tokens,
                replayssm_ring=replayssm_ring,
                settings=tuple(settings),
                batches=positive_ints(batches, "--batches"), alphas=numbers(alphas, "--alphas"), drafts=draft_tokens,
                budget_bytes=int(memory_budget * 2**30), max_requests=max_requests, profile_batch=profile_batch)


@bench.command("transformers", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def transformers_bench(args):
    """model.generate tokens/s of a Qwen3.5-9B-shaped transformers model, stock vs kvbuffer-enabled
    (options: kvbuffer bench transformers --help)."""
    from kvbuffer.integrations.benchmark import main

    main(list(args))  # parses the options first (a typo answers at once), then asks for a CUDA GPU


@bench.command("prefill")
@click.option("--what", type=click.Choice(["kernels", "e2e"]), default="kernels", show_default=True,
              help="kernels: our chunked prefill kernels vs FLA's chunk_gated_delta_rule and mamba_ssm's "
                   "mamba_chunk_scan_combined; e2e: time to first token, kvbuffer's engine vs transformers.")
@click.option("--prompt-lens", help="Tokens per prompt, comma-separated [default: 4096,32768 (kernels, 512 to "
                                    "131072), 512,4096,16384 (e2e)].")
@click.option("--families", default="gdn,mamba2", show_default=True, help="kernels: gdn (Qwen3.5-9B heads), "
              "mamba2 (Nemotron-3-Nano heads), attention (the 9B's prompt attention: FlashAttention-2 against cuDNN).")
@click.option("--batches", default="1,8", show_default=True, help="kernels: prompts packed into one launch.")
@click.option("--launches", default=4, show_default=True, type=click.IntRange(min=1),
              help="kernels: launches captured in one CUDA graph (each a whole prefill).")
@click.option("--replays", default=10, show_default=True, type=click.IntRange(min=1),
              help="kernels: graph replays; the median is reported.")
@click.option("--preset", default="qwen3.5-9b", show_default=True,
              help="e2e: model preset (kvbuffer.presets), random weights in its shapes.")
@_fp8_option
@click.option("--device", default="cuda", show_default=True, help="e2e: cuda, cuda:N or cpu (kernels need CUDA).")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1),
              help="e2e: timed calls per length after one warm-up; the median is reported.")
@click.option("--transformers/--no-transformers", "with_transformers", default=True, show_default=True,
              help="e2e: also time stock transformers over the same prompts (--no-transformers: kvbuffer's "
                   "engine alone, to compare its settings).")
# e2e times what an engine's defaults give a prompt: compile "auto" (a prompt's compiled regions; no decode step
# is timed, so nothing else compiles)
@engine_options("chunk_size", "kernels", "cuda_graphs", "compile", "max_prefill_tokens")
@_out_option
def prefill(what, prompt_lens, families, batches, launches, replays, preset, fp8, device, repeats, with_transformers,
            config, out):
    """Prefill: the chunked prompt kernels against FLA and mamba_ssm (CUDA graphs, packed prompts), or the time to
    first token of the engine against transformers (B = 1)."""
    from kvbuffer import presets
    from kvbuffer.bench import prefill as bench_prefill
    from kvbuffer.bench import results

    kernels = what == "kernels"
    default = bench_prefill.PROMPT_LENS if kernels else bench_prefill.E2E_PROMPT_LENS
    lens = positive_ints(prompt_lens, "--prompt-lens") if prompt_lens else default
    try:
        bench_prefill.check_lengths(lens, lo=bench_prefill.MIN_LEN if kernels else 1,
                                    hi=bench_prefill.MAX_LEN if kernels else None)
    except ValueError as e:
        raise click.BadParameter(str(e).split(": ", 1)[1], param_hint="--prompt-lens") from None
    chosen = tuple(f.strip() for f in families.split(",") if f.strip())
    if not chosen or any(f not in bench_prefill.FAMILIES for f in chosen):
        raise click.BadParameter(f"expected families among {', '.join(bench_prefill.FAMILIES)}, got {families!r}",
                                 param_hint="--families")
    sizes = positive_ints(batches, "--batches")
    try:
        presets.get(preset)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--preset") from None
    if fp8 and kernels:
        raise click.BadParameter("--fp8 applies to --what e2e (the kernels benchmark runs no projection)",
                                 param_hint="--fp8")
    if kernels or not device.startswith("cpu"):
        need_cuda()
    if kernels:
        stem = "prefill_kernels_" + "-".join(chosen)
        save = lambda r: results.write(r, results.result_path(out, stem, r))  # noqa: E731
        result = bench_prefill.run_kernels(families=chosen, prompt_lens=lens, batches=sizes, launches=launches,
                                           replays=replays, on_row=save)
        text = bench_prefill.kernels_table(result)
    else:
        stem = f"prefill_e2e_{preset}" + ("_fp8" if fp8 else "")
        save = lambda r: results.write(r, results.result_path(out, stem, r))  # noqa: E731
        engine = dict(chunk_size=config.chunk_size, kernels=config.kernels, cuda_graphs=config.cuda_graphs,
                      compile=config.compile, max_prefill_tokens=config.max_prefill_tokens)
        result = bench_prefill.run_e2e(preset=preset, prompt_lens=lens, device=device, repeats=repeats, engine=engine,
                                       on_row=save, transformers=with_transformers, **_fp8_keyword(fp8))
        text = bench_prefill.e2e_table(result)
    for p in results.finish(result, results.result_path(out, stem, result), text):
        click.echo(f"wrote {p}")
    click.echo(text)


def _serve_command():
    from kvbuffer.serve.benchmark import bench_serve

    bench.add_command(bench_serve, "serve")


_serve_command()
