"""The `kvbuffer` command line.

Subcommands are thin: they parse options and call library functions, so everything the CLI does
is also available from Python. Errors reach the user as one line `Error: ...` (exit 1; click's
usage errors exit 2); `--debug` or KVBUFFER_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

import click


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


class _OneLineErrors(click.Group):
    """A group whose subcommands' exceptions become one `Error: ...` line: a user who mistyped a
    path needs the message, not forty lines of stack (which `--debug` still shows)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except BrokenPipeError:
            # whoever read the output went away (`kvbuffer cache ls | head`): nothing to report, as
            # with any Unix tool; stdout goes to /dev/null so that the exit's flush cannot fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(1) from None
        except Exception as e:
            if ctx.params.get("debug") or os.environ.get("KVBUFFER_DEBUG", "") not in ("", "0"):
                raise
            raise click.ClickException(_one_line(e)) from None


def _one_line(e: Exception) -> str:
    """The error's message; errors kvbuffer does not raise on purpose also name their type and
    point at --debug, since they are likely bugs worth a report."""
    from kvbuffer.errors import KVBufferError

    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, (KVBufferError, ValueError, TypeError, OSError)):
        return text
    return f"{type(e).__name__}: {text} (run with --debug for the traceback)"


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version("kvbuffer"), prog_name="kvbuffer")
@click.option("--debug", is_flag=True, help="Show the full traceback of an error (also: KVBUFFER_DEBUG=1).")
def main(debug):
    """kvbuffer: buffered decoding for linear-attention LLMs (Gated DeltaNet, Mamba-2)."""


@main.command()
def env():
    """Show the GPU, CUDA toolkit and library versions that kvbuffer sees."""
    import torch

    from kvbuffer.artifacts import runtime_versions
    from kvbuffer.kernels.autobuild import nvcc_path, nvcc_problem

    rows = [
        ("python", platform.python_version()),
        ("kvbuffer", _version("kvbuffer")),
        ("torch", torch.__version__),
        ("tilelang (compile side)", _version("tilelang")),
        ("kernel templates (digest)", runtime_versions()["templates"]),
        ("apache-tvm-ffi (runtime ABI)", _version("apache-tvm-ffi")),
        ("nvcc (compile side)", nvcc_path() or f"not found: {nvcc_problem()}"),
    ]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows += [("gpu", props.name), ("compute capability", f"{props.major}.{props.minor}"),
                 ("gpu memory", f"{props.total_memory / 2**30:.1f} GiB"), ("JIT target", _jit_target())]
    else:
        rows.append(("gpu", "none (reference path on CPU)"))
    rows += _artifact_rows()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


def _jit_target() -> str:
    """The arch a JIT compile builds for here, or why there is none."""
    from kvbuffer.errors import DeviceError
    from kvbuffer.gpus import local_target

    try:
        return local_target()["arch"]
    except DeviceError as e:
        return f"none: {e}"


_BUILT_WITH = {"kvbuffer": "kvbuffer version", "tilelang": "TileLang version", "templates": "template source"}


def _artifact_rows() -> list[tuple[str, str]]:
    """The cache dir, and which of its artifacts and tuning records this machine's GPU can use (a record
    of other versions, the templates' digest among them, is listed as not used)."""
    from kvbuffer.artifacts import CHECKED_VERSIONS, ArtifactStore, cache_dir, runtime_versions, slug
    from kvbuffer.errors import ArtifactError
    from kvbuffer.gpus import detect_local_gpu

    rows = [("cache dir", str(cache_dir()))]
    try:
        manifest = ArtifactStore().manifest()
    except ArtifactError as e:
        return rows + [("artifacts", f"unreadable: {e}")]
    arts, tunings = manifest["artifacts"], manifest["tunings"]
    gpu = detect_local_gpu()
    if gpu is None:
        return rows + [("artifacts", f"{len(arts)} in the cache; no known GPU here to run them")]
    mine = [n for n, e in arts.items() if e.get("gpu") == gpu.name and e.get("arch") == gpu.arch]
    rows.append(("artifacts", f"{len(mine)} of {len(arts)} built for this {gpu.name} ({gpu.arch})"))
    have = runtime_versions()
    for name, e in sorted(tunings.items()):
        if e.get("gpu") == gpu.name:
            other = [lib for lib in CHECKED_VERSIONS if (e.get("versions") or {}).get(lib) != have[lib]]
            note = f" (built with another {' and '.join(_BUILT_WITH[lib] for lib in other)}: not used)" if other else ""
            rows.append(("tuning record", f"{slug(e['shape'])}: {e['status']}{note}"))
    return rows


from .cache import cache  # noqa: E402
from .tune import tune  # noqa: E402

main.add_command(tune)
main.add_command(cache)


from .bench import bench  # noqa: E402
from .generate import generate  # noqa: E402
from .plan import plan_command  # noqa: E402
from .serve import serve  # noqa: E402

main.add_command(generate)
main.add_command(bench)
main.add_command(plan_command)
main.add_command(serve)

if __name__ == "__main__":
    main()
