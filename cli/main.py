"""The `kvbuffer` command line.

Subcommands are thin: they parse options and call library functions, so everything the CLI does
is also available from Python.
"""

from __future__ import annotations

import importlib.metadata
import platform
import shutil

import click


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version("kvbuffer"), prog_name="kvbuffer")
def main():
    """kvbuffer: buffered decoding for linear-attention LLMs (Gated DeltaNet, Mamba-2)."""


@main.command()
def env():
    """Show the GPU, CUDA toolkit and library versions that kvbuffer sees."""
    import torch

    rows = [
        ("python", platform.python_version()),
        ("kvbuffer", _version("kvbuffer")),
        ("torch", torch.__version__),
        ("tilelang (compile side)", _version("tilelang")),
        ("apache-tvm-ffi (runtime ABI)", _version("apache-tvm-ffi")),
        ("nvcc", shutil.which("nvcc") or "not found"),
    ]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows += [("gpu", props.name), ("compute capability", f"{props.major}.{props.minor}"),
                 ("gpu memory", f"{props.total_memory / 2**30:.1f} GiB")]
    else:
        rows.append(("gpu", "none (reference path on CPU)"))
    rows += _artifact_rows()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


def _artifact_rows() -> list[tuple[str, str]]:
    """The cache dir, and which of its artifacts and tuning records this machine's GPU can use."""
    from kvbuffer.artifacts import ArtifactStore, cache_dir
    from kvbuffer.autotune.gpus import detect_local_gpu
    from kvbuffer.errors import ArtifactError

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
    for name, e in sorted(tunings.items()):
        if e.get("gpu") == gpu.name:
            s = e["shape"]
            rows.append(("tuning record", f"{s['family']} Hk={s['Hk']} Hv={s['Hv']} K={s['K']} V={s['V']} "
                                          f"{s['dtype']}: {e['status']}"))
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
