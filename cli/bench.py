"""`kvbuffer bench gdn|mamba2|decode|spec [ARGS...]`: run a benchmark script from benchmarks/ (needs a GPU).

The benchmark scripts live in the source checkout's benchmarks/ folder next to their committed
results, so this command works from a checkout installed with `pip install -e .`. Arguments after
the kernel name go to the script; `kvbuffer bench gdn --help` lists them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

# kernel or job -> (script in benchmarks/, arguments put first)
SCRIPTS = {"gdn": ("bench_gdn.py", []), "mamba2": ("bench_mamba2.py", []),
           "decode": ("bench_e2e.py", ["decode"]), "spec": ("bench_e2e.py", ["spec"])}


def _benchmarks_dir() -> Path:
    import kvbuffer

    return Path(kvbuffer.__file__).resolve().parent.parent / "benchmarks"


def _load(kernel: str):
    path = _benchmarks_dir() / SCRIPTS[kernel][0]
    if not path.is_file():
        raise click.ClickException(f"{path} not found: `kvbuffer bench` runs the scripts of a source checkout "
                                   "(git clone, then pip install -e .)")
    spec = importlib.util.spec_from_file_location(f"kvbuffer_bench_{kernel}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("kernel", type=click.Choice(sorted(SCRIPTS)))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(kernel, args):
    """Benchmark the buffered kernels against the recurrent baseline and the field's peer kernel."""
    import torch

    if not torch.cuda.is_available():
        raise click.ClickException("kvbuffer bench times GPU kernels and needs a CUDA GPU; none is visible")
    module = _load(kernel)
    module.main(SCRIPTS[kernel][1] + list(args))
