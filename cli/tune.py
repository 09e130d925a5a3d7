"""`kvbuffer tune`: build (no GPU here) or tune (GPU here) the kernels for one GPU and head shape."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

import click

from kvbuffer.defaults import MAX_DRAFT_TOKENS
from kvbuffer.option_values import positive_ints

DEFAULT_CHUNKS = "8,16,32"
DEFAULT_BUCKETS = "1,16,64,256,1024"


def _ints(text: str, option: str) -> tuple[int, ...]:
    """The distinct values of a comma-separated option, ascending."""
    return tuple(sorted(set(positive_ints(text, option))))


def _chunk_free(family: str) -> bool:
    """Whether a family's kernels serve every chunk size C: the conv's, attention's and the projections'."""
    return family in ("conv1d", "attention") or _projection(family)


def _projection(family: str) -> bool:
    """The projection kernels' families (kvbuffer.kernels.keys.GEMV_FAMILIES): none depends on C, and
    each is timed at one size alone (what a one-token or few-token forward runs; the grouped experts
    kernel at one routed load, kvbuffer.kernels.gemv.grouped_counts)."""
    from ..kernels.keys import GEMV_FAMILIES

    return family in GEMV_FAMILIES


def _table(rows: list[tuple], echo=click.echo) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        echo("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def _resolve_shapes(model, heads, family, dtype, conv: bool, attention: bool = False, gemv: bool = False,
                    fp8: bool = False) -> list[dict]:
    """The head shapes to build, each once: a model's or --heads' linear-layer shape, (with `conv`)
    its short conv's, (with `attention`, a model only) its attention layers' decode kernels and (with
    `gemv`, a model only) its projections' one-row kernels, (with `fp8`, a preset) those of its FP8
    checkpoint too; neither given: every bundled preset's. dtype None: a checkpoint's own, else bfloat16."""
    from pathlib import Path

    from ..autotune import models

    if model and heads:
        raise click.UsageError("give --model or --heads, not both")
    try:
        if model is not None and model.lower() not in models.HEAD_SHAPES and Path(model).exists():
            if fp8:
                raise ValueError("--fp8 names a preset's FP8 form; a checkpoint directory's own quantization "
                                 "config decides which projections are FP8")
            shape = models.checkpoint_shape(model, dtype)
            pairs = [(shape, models.checkpoint_conv_shape(model, shape))]
            softmax = [models.checkpoint_attention_shape(model, dtype)]
            projections = models.checkpoint_gemv_shapes(model, dtype) if gemv else []
        else:
            if heads:
                linear, names = [models.parse_heads(heads, family, dtype or models.DEFAULT_DTYPE)], []
            else:  # unknown preset: preset_shape lists them
                names = [model] if model else list(models.HEAD_SHAPES)
                linear = [models.preset_shape(name, dtype or models.DEFAULT_DTYPE) for name in names]
            pairs = [(shape, models.conv_shape(shape)) for shape in linear]
            softmax = [models.preset_attention_shape(name, dtype or models.DEFAULT_DTYPE) for name in names]
            projections = [p for name in names if gemv
                           for p in models.preset_gemv_shapes(name, dtype or models.DEFAULT_DTYPE, fp8)]
    except (ValueError, KeyError, OSError) as e:
        raise click.BadParameter(str(e), param_hint="--model/--heads") from None
    shapes = [linear for linear, _ in pairs] + ([c for _, c in pairs] if conv else []) \
        + ([a for a in softmax if a is not None] if attention else []) + projections
    return list({tuple(sorted(s.items())): s for s in shapes}.values())


def _drafts(text: str) -> tuple[int, ...]:
    """--draft-tokens: speculative draft counts (1..MAX_DRAFT_TOKENS); plain decoding's layout (0) is always built."""
    if not text.strip():
        return (0,)
    values = _ints(text, "--draft-tokens")
    if values[-1] > MAX_DRAFT_TOKENS:
        raise click.BadParameter(f"draft counts must be in [1, {MAX_DRAFT_TOKENS}] (the engine's limit), got {text!r}",
                                 param_hint="--draft-tokens")
    return (0,) + values


def _resolve_gpu(name):
    """(GPU to build for, whether it is the local device 0)."""
    from ..gpus import detect_local_gpu, get_gpu

    try:
        local = detect_local_gpu()
    except ValueError as e:
        local, note = None, str(e)
    else:
        note = "no CUDA GPU here"
    if name is None:
        if local is None:
            raise click.UsageError(f"{note}: name the GPU to build for with --gpu (see --list-gpus)")
        return local, True
    try:
        gpu = get_gpu(name)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--gpu") from None
    if local is not None and local.name == gpu.name:
        return local, True
    return gpu, False


def _templates(shapes: list[dict], kernels: str | None) -> list[tuple[dict, list]]:
    """(shape, its templates) for each shape that has any left after --kernels."""
    try:
        from ..autotune.registry import templates
    except ImportError as e:
        raise click.ClickException(f"the compile side needs TileLang: pip install 'kvbuffer[gpu]' ({e})")
    found = [(shape, templates(shape["family"])) for shape in shapes]
    if not found[0][1]:
        raise click.ClickException(f"no TileLang templates are registered for the {shapes[0]['family']} family yet")
    if kernels:
        wanted = {k.strip() for k in kernels.split(",")}
        names = [t.name for _, tpls in found for t in tpls]
        unknown = wanted - set(names)
        if unknown:
            families = ", ".join(s["family"] for s in shapes)
            raise click.BadParameter(f"unknown kernel(s) {sorted(unknown)}; the {families} kernels are {names}",
                                     param_hint="--kernels")
        found = [(shape, [t for t in tpls if t.name in wanted]) for shape, tpls in found]
    return [(shape, tpls) for shape, tpls in found if tpls]


@click.command()
@click.option("--gpu", help="GPU to build for (see --list-gpus); default: the local GPU.")
@click.option("--list-gpus", is_flag=True, help="List the GPUs kvbuffer can build for, and exit.")
@click.option("--model", help="Model preset (qwen3.5-9b, ..., nemotron-3-super) or a checkpoint directory "
              "[default: every preset, each distinct head shape once].")
@click.option("--heads", help="Explicit head shape Hk,Hv,K,V (instead of --model).")
@click.option("--family", type=click.Choice(["gdn", "mamba2"]), default="gdn", show_default=True,
              help="Layer family for --heads.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16"]), default=None,
              help="Activation/buffer dtype [default: the checkpoint's, else bfloat16].")
@click.option("--chunk-sizes", default=DEFAULT_CHUNKS, show_default=True, help="Chunk sizes C to build.")
@click.option("--batch-buckets", default=DEFAULT_BUCKETS, show_default=True, help="Batch buckets to tune for.")
@click.option("--draft-tokens", default="", help="Speculative draft counts T to build buffer layouts for "
              "(C + T + 1 entries, the verify of T drafts), e.g. 4 or 2,4,8 [default: plain decoding only].")
@click.option("--conv/--no-conv", default=True, show_default=True,
              help="Also build the short conv's kernels (shape from the model, or 2*Hk*K + Hv*V channels).")
@click.option("--attention/--no-attention", default=True, show_default=True,
              help="Also build the model's decode attention kernels (its attention layers' heads; not with --heads).")
@click.option("--gemv/--no-gemv", default=True, show_default=True,
              help="Also build the one-row kernel of each of the model's projection shapes (a one-token "
              "forward's) and both experts kernels of its routed-expert weight shapes (not with --heads).")
@click.option("--fp8", is_flag=True,
              help="Also the one-row kernels of the preset's FP8 checkpoint (its family's published format); a "
                   "checkpoint directory's quantization config decides this itself.")
@click.option("--kernels", help="Comma-separated template names (default: every template of the family, "
              "its conv, the model's attention and its projections).")
@click.option("--build-only", is_flag=True, help="Compile defaults without measuring, even on the named GPU.")
@click.option("--max-configs", type=click.IntRange(min=1), default=None,
              help="Try at most this many configs per template.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Cache root [default: $KVBUFFER_CACHE_DIR, else $XDG_CACHE_HOME/kvbuffer].")
def tune(gpu, list_gpus, model, heads, family, dtype, chunk_sizes, batch_buckets, draft_tokens, conv, attention,
         gemv, fp8, kernels, build_only, max_configs, cache_dir):
    """Compile kernels for a GPU and head shape into the artifact cache, measuring them if the GPU is here.

    Without the named GPU, each kernel is compiled for its arch with default tunables and recorded
    as untuned. With it, every config is checked against the reference, timed per batch bucket,
    and the winners and a chunk-size policy are recorded as tuned. The linear layers' kernels and
    the short conv's get one tuning record each (so do the attention layers and each projection
    shape). With neither --model nor --heads, every bundled preset's head shapes are built.

    Every option, and every kernel's defaults for the head shapes, is checked before the first
    compile. stderr shows the whole run's progress: kernels and groups done, elapsed, time left.
    Ctrl-C stops it (exit 130), keeping the finished kernels and the records of finished groups.
    """
    from ..gpus import catalogue_table

    if list_gpus:
        _table(catalogue_table())
        return
    from ..autotune.cache import ArtifactCache
    from ..autotune.models import HEAD_SHAPES
    from ..kernels.autobuild import nvcc_problem

    shapes = _resolve_shapes(model, heads, family, dtype, conv, attention, gemv, fp8)
    target, present = _resolve_gpu(gpu)
    chunks, buckets = _ints(chunk_sizes, "--chunk-sizes"), _ints(batch_buckets, "--batch-buckets")
    drafts = _drafts(draft_tokens)
    groups = _planned(_templates(shapes, kernels), chunks, drafts)
    problem = nvcc_problem()
    if problem:
        raise click.ClickException(problem)
    with _ctrl_c_exits(lambda: "Interrupted while checking the kernels to build: nothing was built"):
        _check_builds(groups, presets=heads is None and (model is None or model.lower() in HEAD_SHAPES))
    cache = ArtifactCache(cache_dir)
    _run(cache, target, present and not build_only, groups, chunks, buckets, drafts, max_configs)


def _planned(found: list[tuple[dict, list]], chunks, drafts) -> list[tuple[dict, list, list]]:
    """(shape, templates, the (template, C, drafts) builds of the tuner's plan) per group; a usage
    error where a group has nothing to build."""
    from ..autotune import tuner

    groups = []
    for shape, tpls in found:
        items = tuner.plan(tpls, shape, chunks, drafts)
        if not items:
            raise click.UsageError(f"nothing to build for {', '.join(t.name for t in tpls)}: a verify or accept "
                                   "needs --draft-tokens T, a T-token prefill chunk a chunk size >= T")
        groups.append((shape, tpls, items))
    return groups


def _check_builds(groups, presets: bool) -> None:
    """Every build's defaults, and its TileLang trace, before anything compiles: a head size or chunk
    size a template does not take is an error now (exit 1: the options are well formed, the templates'
    limits refuse them), not after minutes of compiling the others.
    Each (template, C, drafts) is traced once; a shape not from a preset (--heads, a checkpoint) at
    every build, since its head sizes are new to the templates."""
    from ..autotune.tuner import label

    click.echo(f"checking {sum(len(items) for _, _, items in groups)} kernel build(s) against their templates "
               "before compiling", err=True)
    traced: set = set()
    for shape, _, items in groups:
        for tpl, chunk, drafts in items:
            seen = (tpl.name, chunk, drafts) if presets else (tpl.name, chunk, drafts, _shape_text(shape))
            try:
                tpl.check(shape, chunk, drafts, traced=seen not in traced)
            except ImportError as e:
                raise click.ClickException(f"the compile side needs TileLang: pip install 'kvbuffer[gpu]' ({e})") \
                    from None
            except Exception as e:  # the template's own message says what it does not take
                raise click.ClickException(f"{label(tpl, chunk, drafts)} cannot be built for {_shape_text(shape)} "
                                           f"(--model/--heads, --chunk-sizes): "
                                           f"{' '.join(str(e).split()) or type(e).__name__}") from None
            traced.add(seen)


def _run(cache, target, measuring, groups, chunks, buckets, drafts, max_configs) -> None:
    """Build (or measure) every group under one overall progress line; Ctrl-C stops it cleanly: the
    interrupted build's staging removed, what finished kept, exit 130."""
    from ..autotune.progress import TuneProgress

    overall = TuneProgress(len(groups), sum(len(items) for _, _, items in groups))
    recorded = [0]

    def said() -> str:
        return (f"Interrupted: {overall.count} of {overall.kernels} kernels built and kept, {recorded[0]} of "
                f"{len(groups)} tuning records written; the interrupted build's staging removed "
                "(`kvbuffer cache prune` removes kernels no record names)")

    with _ctrl_c_exits(said, cache.remove_own_staging), cache.tune_running(), overall:
        for i, (one_shape, tpls, _) in enumerate(groups):
            overall.start_group(i)
            step = f"[{i + 1}/{len(groups)}] " if len(groups) > 1 else ""
            _tune_shape(cache, target, measuring, one_shape, tpls, chunks,
                        (1,) if _projection(one_shape["family"]) else buckets, drafts, max_configs, step, overall)
            recorded[0] += 1


@contextlib.contextmanager
def _ctrl_c_exits(said: Callable[[], str], cleanup: Callable[[], object] = lambda: None) -> Iterator[None]:
    """A Ctrl-C inside (a KeyboardInterrupt, or any error raised while one arrived: TileLang's compiler
    turns it into others) ends the command: cleanup(), the line said() on stderr, exit 130."""
    from ..autotune.progress import catching_sigint

    with catching_sigint() as sigint:
        try:
            yield
        except BaseException as e:
            if not (isinstance(e, KeyboardInterrupt) or sigint.hit):
                raise
            cleanup()
            click.echo(said(), err=True)
            raise click.exceptions.Exit(130) from None


def _tune_shape(cache, target, measuring, shape, tpls, chunks, buckets, drafts, max_configs, step="",
                overall=None) -> None:
    """Build (or measure) one shape's templates, print its results table and its tuning record
    (with `overall`, a TuneProgress, through it)."""
    from ..autotune import tuner
    from ..autotune.progress import KernelProgress

    req = tuner.TuneRequest(target, shape, chunks, buckets, drafts)
    items = tuner.plan(tpls, req.shape, req.chunk_sizes, req.draft_tokens)
    echo = click.echo if overall is None else (lambda text: overall.write(f"{text}\n"))
    layouts = ("" if _chunk_free(shape["family"]) else f", C in {list(req.chunk_sizes)}") \
        + (f", drafts {list(drafts[1:])}" if len(drafts) > 1 else "")
    echo(f"{step}{'tuning' if measuring else 'building (untuned)'} {len(items)} kernel(s) for {target.name} "
               f"({target.arch}), {_shape_text(shape)}{layouts}, cache {cache.root}")
    with KernelProgress(len(items), sys.stdout, overall=overall) as bar:
        if measuring:
            results, record = tuner.measure(cache, req, tpls, progress=bar.done, on_start=bar.start,
                                            configs_limit=max_configs)
        else:
            results, record = tuner.build_untuned(cache, req, tpls, progress=bar.done, on_start=bar.start)
    tuning = cache.tuning(record)
    _table(results_table(results, shape, target.mem_bandwidth_gbs, measuring), echo)
    from ..tuning import ChunkPolicy

    for note in cache.notes:
        echo(f"note: {note}")
    measured = sum(w["median_us"] is not None for w in tuning["winners"])
    line = f"tuning record {record} ({tuning['status']}: {measured} of {len(tuning['winners'])} winners measured; "
    if _chunk_free(shape["family"]):
        line += f"drafts {tuning.get('draft_tokens', [0])})"
    else:
        policy = ChunkPolicy.from_json(tuning["chunk_policy"])
        line += (f"chunk sizes {tuning['chunk_sizes']}, drafts {tuning.get('draft_tokens', [0])}); chunk size per "
                 f"batch bucket ({policy.status}): "
                 + ", ".join(f"B<={b}: C={c}" for b, c in zip(policy.buckets, policy.chunk_sizes)))
        if policy.unbuffered_rows:
            line += (f"; decode steps of up to {policy.unbuffered_rows} row(s) unbuffered "
                     "(the recurrent step is faster there)")
        elif policy.unbuffered_rows == 0:
            line += "; every decode step buffered (the buffered step is faster at every batch)"
    echo(line)


def _shape_text(shape) -> str:
    if _projection(shape["family"]):
        return f"{shape['family']} N={shape['N']} K={shape['K']} {shape['dtype']}"
    if shape["family"] == "attention":
        return f"attention H={shape['H']} Hkv={shape['Hkv']} D={shape['D']} {shape['dtype']} cache {shape['kv_dtype']}"
    if shape["family"] == "conv1d":
        return (f"conv1d D={shape['D']} W={shape['W']} {shape['dtype']} weights {shape['w_dtype']}"
                f"{' with bias' if shape['bias'] else ''}")
    return f"{shape['family']} Hk={shape['Hk']} Hv={shape['Hv']} K={shape['K']} V={shape['V']} {shape['dtype']}"


def traffic_bytes(kernel: str, shape: dict, C: int, B: int) -> float | None:
    """The fewest DRAM bytes a call moves (fp32 states, 2-byte entries), to report achieved bandwidth;
    None for kernels this model does not cover (verify, prefill chunks, the conv).

    One-row projection: its weight, once; the experts kernel: the weights of the experts it is timed
    with (kvbuffer.kernels.gemv.EXPERTS_TIMED), once; the grouped experts kernel: its
    experts' weights once, its rows read and written once (kvbuffer.kernels.gemv.grouped_counts); the FP8
    one-row kernel: its 1-byte weight and fp32 scales, once; the activation quantizer: its timed rows'
    2-byte x read, 1-byte q and one fp32 scale per 128 written.
    Recurrent step: read + write every state. Buffered step: read every state, write it in the 1/C
    of rows that flush, read on average C/2 buffer entries. Flush: read + write, read C entries.
    """
    if shape["family"] == "gemv":
        return 2.0 * shape["N"] * shape["K"]
    if shape["family"] == "fp8_gemv":
        return shape["N"] * shape["K"] + 4.0 * -(-shape["N"] // shape["bn"]) * -(-shape["K"] // shape["bk"])
    if shape["family"] == "fp8_quant":
        from kvbuffer.kernels.fp8_ops import TIMED_ROWS

        return TIMED_ROWS * shape["K"] * (2 + 1 + 4 / 128)
    if shape["family"] == "experts":
        from kvbuffer.kernels.gemv import EXPERTS_TIMED

        return 2.0 * shape["N"] * shape["K"] * EXPERTS_TIMED
    if shape["family"] == "grouped":
        from kvbuffer.kernels.gemv import grouped_counts

        counts = grouped_counts()
        return 2.0 * (len(counts) * shape["N"] * shape["K"] + sum(counts) * (shape["N"] + shape["K"]))
    if not kernel.endswith(("recurrent", "buffered_step", "flush")):
        return None
    state = 4 * shape["Hv"] * shape["K"] * shape["V"]
    entry = 2 * (shape["Hk"] * shape["K"] + shape["Hv"] * shape["V"]) + 4 * shape["Hv"]
    if kernel.endswith("recurrent"):
        return 2.0 * state * B
    if kernel.endswith("buffered_step"):
        return B * (state * (1 + 1 / C) + entry * C / 2)
    return B * (2.0 * state + entry * C)


def results_table(results, shape: dict, peak_gbs: float, measured: bool) -> list[tuple]:
    """One row per artifact (header first). Measured: the batch buckets it won, with its median
    time and achieved bandwidth at each (a measured artifact has one result per bucket it won)."""
    header = ("kernel", "C", "drafts", "tunables", "status", "build", "seconds")
    rows = [header + (("won at B", "median us", "GB/s", "of peak") if measured else ()) + ("artifact",)]
    by_artifact: dict = {}
    for r in results:
        by_artifact.setdefault(r.artifact, []).append(r)
    for name, same in by_artifact.items():
        r = same[0]
        how = "cached" if r.reused else ("measured" if measured else "compiled")
        tun = " ".join(f"{k}={v}" for k, v in sorted(r.tunables.items()))
        row = (r.kernel, r.chunk_size or "-", r.drafts, tun, r.status, how, f"{r.seconds:.1f}")
        if measured:
            us = {b: t for x in same for b, t in x.median_us.items()}
            gbs = {b: None if (n := traffic_bytes(r.kernel, shape, r.chunk_size or 1, b)) is None else n / t / 1e3
                   for b, t in us.items()}
            row += ("/".join(str(b) for b in sorted(us)), "/".join(f"{us[b]:.1f}" for b in sorted(us)),
                    "/".join("-" if gbs[b] is None else f"{gbs[b]:.0f}" for b in sorted(us)),
                    "/".join("-" if gbs[b] is None else f"{gbs[b] / peak_gbs:.0%}" for b in sorted(us)))
        rows.append(row + (name,))
    return rows
