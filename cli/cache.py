"""`kvbuffer cache ls|path|clear|prune|export|import`: inspect, clear, prune and move the compiled-artifact cache."""

from __future__ import annotations

import json

import click

_CACHE_DIR = click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                          help="Cache root [default: $KVBUFFER_CACHE_DIR, else $XDG_CACHE_HOME/kvbuffer].")


@click.group()
def cache():
    """Inspect, clear, prune, export or import the compiled-artifact cache."""


@cache.command()
@_CACHE_DIR
def path(cache_dir):
    """Print the cache root."""
    from ..artifacts import cache_dir as resolve

    click.echo(str(resolve(cache_dir)))


@cache.command(name="ls")
@_CACHE_DIR
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def ls(cache_dir, as_json):
    """List artifacts and tuning records, their status, and whether their checksums verify.

    Reads under the cache's lock (shared): a clear or import running meanwhile is seen before or
    after, never halfway. A folder that is not kvbuffer's cache is an error, and nothing is read."""
    from ..autotune.cache import ArtifactCache

    store = ArtifactCache(cache_dir)
    with store.reading():
        _list(store, as_json)


def _list(store, as_json: bool) -> None:
    rows = store.entries()
    if as_json:
        for row in rows:
            click.echo(json.dumps(row, sort_keys=True))
        return
    if not rows:
        click.echo(f"{store.root}: empty")
        _prunable_lines(store)
        return
    table = [("type", "gpu", "arch", "kernel", "status", "check", "KiB", "name")]
    for r in rows:
        kib = f"{r['bytes'] / 1024:.0f}" if r["bytes"] is not None else "-"
        table.append((r["type"], r["gpu"] or "-", r["arch"] or "-", r["kernel"] or "-", r["status"],
                      "ok" if r["ok"] else "CORRUPT", kib, r["name"]))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
    for row in table:
        click.echo("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    bad = sum(not r["ok"] for r in rows)
    if bad:
        click.echo(f"{bad} corrupt entr{'y' if bad == 1 else 'ies'}: rebuild with `kvbuffer tune --gpu ...`"
                   " (corrupt files are replaced, never loaded)")
    _prunable_lines(store)


def _prunable_lines(store) -> None:
    """What `cache prune` (at its default age) would remove, said as it will remove it."""
    from ..errors import ArtifactError

    try:
        plan = store.prunable()
    except ArtifactError:
        return  # an unreadable record: prune removes nothing, and the corrupt line above says why
    if plan.artifacts:
        n = len(plan.artifacts)
        click.echo(f"{n} artifact{'s' * (n != 1)} ({plan.bytes / 2**20:.1f} MiB) named by no tuning record (left by an "
                   "interrupted tune, a re-tune or a kvbuffer upgrade): `kvbuffer cache prune` removes them")
    if plan.orphans or plan.staging:
        n = len(plan.orphans) + len(plan.staging)
        click.echo(f"{n} leftover file{'s' * (n != 1)} of interrupted builds (staging, unlisted entries): "
                   "`kvbuffer cache prune` removes them")
    if plan.kept_running:
        click.echo(f"{plan.kept_running} artifact{'s' * (plan.kept_running != 1)} named by no tuning record yet, "
                   "built by a tune still running: `kvbuffer cache prune` keeps them")


@cache.command()
@_CACHE_DIR
@click.option("--gpu", default=None, help="Only this GPU's artifacts and tuning records.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def clear(cache_dir, gpu, yes):
    """Delete cached artifacts and tuning records (of kvbuffer's cache only: a folder without its marker
    and not provably its cache is refused)."""
    from ..autotune.cache import ArtifactCache

    store = ArtifactCache(cache_dir)
    store.check_ours()  # another program's folder: refused before anything is asked or removed
    what = f"{gpu}'s entries" if gpu else "every entry"
    if not yes:
        click.confirm(f"delete {what} in {store.root}?", abort=True)
    store.mark()
    n = store.clear(gpu)
    click.echo(f"removed {n} entr{'y' if n == 1 else 'ies'} from {store.root}")


def _seconds(text: str) -> float:
    """'90m', '2h', '1d', '45s' or a number of hours, in seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    scale = units.get(text[-1:], None)
    try:
        value = float(text[:-1] if scale else text) * (scale or 3600)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise click.BadParameter(f"takes a duration such as 90m, 2h or 1d (a bare number is hours), got {text!r}",
                                 param_hint="--older-than")
    return value


@cache.command()
@_CACHE_DIR
@click.option("--older-than", default="0", show_default=True,
              help="Keep the unnamed artifacts built more recently than this (90m, 2h, 1d; a bare number is hours). "
              "Whatever its value, those built by a tune still running are kept.")
@click.option("--keep-hours", type=click.FloatRange(min=0), default=None, hidden=True,
              help="The same as --older-than in hours.")
def prune(cache_dir, older_than, keep_hours):
    """Delete what an interrupted or superseded tune left: artifacts no tuning record names, staging
    leftovers and entries the manifest does not list (what `cache ls` counts as removable)."""
    from ..autotune.cache import ArtifactCache

    seconds = keep_hours * 3600 if keep_hours is not None else _seconds(older_than)
    store = ArtifactCache(cache_dir)
    store.mark()
    plan = store.prune(seconds)
    n, leftovers = len(plan.artifacts), len(plan.orphans) + len(plan.staging)
    line = f"removed {n} unused artifact{'s' * (n != 1)} ({plan.bytes / 2**20:.1f} MiB)"
    if leftovers:
        line += f" and {leftovers} leftover{'s' * (leftovers != 1)} of interrupted builds"
    line += f" from {store.root}"
    kept = [f"{plan.kept_running} built by a tune still running"] * bool(plan.kept_running) \
        + [f"{plan.kept_young} built in the last {older_than if keep_hours is None else f'{keep_hours}h'}"] \
        * bool(plan.kept_young)
    if kept:
        line += f"; kept {' and '.join(kept)}"
    click.echo(line)


def _summary(report, verb: str, where) -> str:
    mib = f" ({report.bytes / 2**20:.1f} MiB)" if report.bytes else ""
    new = f" ({report.artifacts - report.kept} new, {report.kept} already there)" if report.kept else ""
    return (f"{verb} {report.artifacts} artifact{'s' * (report.artifacts != 1)}{new} and {report.tunings} tuning "
            f"record{'s' * (report.tunings != 1)}{mib} {where}")


@cache.command(name="export")
@_CACHE_DIR
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--gpu", default=None, help="Only this GPU's artifacts and tuning records.")
def export_(cache_dir, bundle, gpu):
    """Write the cache's kernels to BUNDLE (a .tar.gz), for `kvbuffer cache import` on other machines.

    Tune once where TileLang, nvcc and the GPU are, then serve from machines that have only the
    runtime. Entries whose checksums fail are left out and listed. Prints the file's sha256, for
    `import --sha256`."""
    from ..autotune.bundle import export_bundle
    from ..autotune.cache import ArtifactCache

    store = ArtifactCache(cache_dir)
    report = export_bundle(store, bundle, gpu)
    for line in report.skipped:
        click.echo(f"skipped {line}")
    click.echo(_summary(report, "exported", f"to {bundle}"))
    click.echo(f"sha256 {report.sha256}")


@cache.command(name="import")
@_CACHE_DIR
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--sha256", default=None, help="The sha256 `cache export` printed: checked before anything else.")
def import_(cache_dir, bundle, sha256):
    """Add the kernels of BUNDLE (written by `kvbuffer cache export`) to the cache.

    A bundle holds native code that kvbuffer will load: import only bundles you built or trust.
    Every file is checked before anything is added (damage, not tampering: its checksums are its
    own); kernels already in the cache are kept, and tuning records are merged as `kvbuffer tune`
    merges them."""
    from ..autotune.bundle import import_bundle
    from ..autotune.cache import ArtifactCache

    store = ArtifactCache(cache_dir)
    store.mark()
    report = import_bundle(store, bundle, sha256)
    for line in report.notes:
        click.echo(f"note: {line}")
    click.echo(_summary(report, "imported", f"into {store.root}"))
