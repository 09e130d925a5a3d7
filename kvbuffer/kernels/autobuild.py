"""First use on a GPU: build the model's missing kernels once into the artifact cache.

`resolve_backend` calls `ensure_kernels` when the kernels an engine launches are not in the artifact
cache and JIT is off: with TileLang and nvcc here, it compiles for the local GPU, untuned, what
`kvbuffer tune --build-only` builds for the model's head shape and buffer layout (the same builder,
kvbuffer.autotune.tuner.build_untuned), with one line and a progress bar; otherwise it returns one line
naming the command that builds them. Decode attention's kernels (`ensure_attention_kernels`) and the
projections' (`ensure_gemv_kernels`) are built the same way on first use. KVBUFFER_BUILD_KERNELS=0
turns the build off. `nvcc_problem` is also the hint `kvbuffer tune` and `kvbuffer env` give.

`complete` is the engine's one pass over every kernel its fast path will look up (`Planned`): it
builds each group with a missing kernel (the builds reuse what an interrupted build left, so a
partial cache is completed), then says in one WARNING line per group what is still missing, what
runs instead and which command builds it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from . import specs
from .keys import KernelKey

log = logging.getLogger("kvbuffer")

SWITCH = "KVBUFFER_BUILD_KERNELS"
INSTALL = 'pip install "kvbuffer[gpu]"'
DEFAULT_CUDA_HOME = Path("/usr/local/cuda")


def nvcc_path() -> str | None:
    """nvcc where TileLang 0.1.15 looks for it (tilelang.env._find_cuda_home): $CUDA_HOME or
    $CUDA_PATH if set (and only there), else `nvcc` on PATH, else the nvidia-cuda-nvcc wheel,
    else /usr/local/cuda."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        exe = Path(home) / "bin" / "nvcc"
        return str(exe) if exe.is_file() else None
    found = shutil.which("nvcc")
    if found:
        return found
    try:
        files = importlib.metadata.files("nvidia-cuda-nvcc") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    wheel = next((str(f.locate()) for f in files if f.name == "nvcc"), None)
    if wheel:
        return wheel
    default = DEFAULT_CUDA_HOME / "bin" / "nvcc"
    return str(default) if default.is_file() else None


def nvcc_problem() -> str | None:
    """One line on why kernels cannot be compiled here for want of nvcc (None: nvcc is found)."""
    if nvcc_path() is not None:
        return None
    home_var = "CUDA_HOME" if os.environ.get("CUDA_HOME") else "CUDA_PATH" if os.environ.get("CUDA_PATH") else None
    if home_var:
        return (f"building kernels needs the CUDA compiler, and ${home_var} ({os.environ[home_var]}) has no "
                f"bin/nvcc: point {home_var} at the CUDA toolkit's root (the directory holding bin/nvcc)")
    return ("building kernels needs the CUDA compiler nvcc, which is not found: install the CUDA toolkit and "
            "set CUDA_HOME to its root (e.g. /usr/local/cuda-13.0) or put its bin/ on PATH")


def build_problem() -> str | None:
    """Why this process cannot compile kernels (None: TileLang and nvcc are both there)."""
    if importlib.util.find_spec("tilelang") is None:
        return f"TileLang, which builds them, is not installed ({INSTALL})"
    return nvcc_problem()


def enabled() -> bool:
    """Whether a missing kernel may be built: yes unless KVBUFFER_BUILD_KERNELS=0."""
    return os.environ.get(SWITCH, "").strip() != "0"


def tune_command(key: KernelKey, gpu_name: str) -> str:
    """The one command that builds (and on this GPU measures) what `ensure_kernels(key)` builds."""
    return specs.tune_command(key).replace("<gpu>", gpu_name)


def ensure_kernels(key: KernelKey, conv_dtype: str) -> str | None:
    """Build the kernels of `key`'s head shape and buffer layout for the local GPU unless they
    cannot be built here; returns None once built, else one line saying why not and what to run.

    `key` is the engine's decode step: its head shape, dtype, chunk size and draft count name
    everything the engine launches (kvbuffer.runtime.backend.needed_kernels). The short conv runs
    in the model's own dtype, `conv_dtype` (the linear kernels run fp32 models in bf16).
    """
    where, why = _local_build(key, "kernels for this model")
    if why is None:
        build(key, conv_dtype, *where)
    return why


def ensure_attention_kernels(key: KernelKey, stream=None) -> str | None:
    """Build the attention shape of `key` (a decode kernel's) for the local GPU: the decode step and
    its combine, and for T > 1 the verify pair of T - 1 drafts, untuned. None once built, else one
    line saying why not and what to run."""
    where, why = _local_build(key, "attention kernels")
    if why is None:
        from ..autotune import tuner

        gpu, command = where
        drafts = specs.layouts(key)[0][1]
        req = tuner.TuneRequest(gpu, specs.record_shapes(key)[0], (1,), tuner.BATCH_BUCKETS, (0, drafts) if drafts else (0,))
        _build_untuned([(req, "attention")], "attention kernels", gpu, command, stream)
    return why


def ensure_gemv_kernels(keys: list[KernelKey], stream=None, checkpoint=None) -> str | None:
    """Build the projection kernels of `keys` (kvbuffer.kernels.launch.gemv_key, gemv_experts_key and
    grouped_experts_key) for the local GPU, untuned, one tuning record per weight shape; None once
    built, else one line saying why not and what to run. Those that still do not load are one
    WARNING line (complete): their projections keep torch's GEMM; its command names `checkpoint`
    (a checkpoint directory) where given."""
    if not keys:
        return None
    where, why = _local_build(keys[0], "projection kernels")
    if why is None:
        from ..autotune import tuner

        gpu, command = where
        requests = [(tuner.TuneRequest(gpu, shape, (1,), (1,)), shape["family"])
                    for shape in (specs.record_shapes(key)[0] for key in keys)]
        _build_untuned(requests, "projection kernels", gpu, command, stream)
    planned = [Planned(key, "projections", "their projections run on torch's GEMM") for key in keys]
    if why is not None and checkpoint is not None:
        why = why.replace("<model>", str(checkpoint))
    complete(planned, {"projections": lambda missing: why}, loads, lambda key: local_command(key, checkpoint))
    return why


def loads(key: KernelKey) -> bool:
    """Whether `key`'s kernel loads from the artifact cache (or JIT-compiles here)."""
    from ..errors import ArtifactError
    from . import lookup

    try:
        lookup.kernel_for(key, 1)
    except ArtifactError:
        return False
    return True


def local_command(key: KernelKey, model: str | None = None) -> str:
    """tune_command for this machine's GPU (`<gpu>` where none is found) and `model` (else `<model>`)."""
    from ..gpus import detect_local_gpu

    gpu = detect_local_gpu()
    command = tune_command(key, gpu.name if gpu is not None else "<gpu>")
    return command.replace("<model>", str(model)) if model is not None else command


def ensure_conv_kernels(keys: list[KernelKey], stream=None) -> str | None:
    """Build the short conv shapes of `keys` (kvbuffer.kernels.launch.conv_update_key and conv_accept_key)
    for the local GPU, untuned: the step, the any-length prompt and, where the pool spans drafts, the
    verify and accept; None once built, else one line saying why not and what to run."""
    if not keys:
        return None
    where, why = _local_build(keys[0], "short conv kernels")
    if why is None:
        from ..autotune import tuner

        gpu, command = where
        shaped = [k for k in keys if k.op != "accept"] or keys  # the accept reads no weights: any record has it
        shapes = {str(sorted(s.items())): (s, specs.layouts(key)[0][1]) for key in shaped
                  for s in specs.record_shapes(key)[:1]}
        requests = [(tuner.TuneRequest(gpu, s, (1,), tuner.BATCH_BUCKETS, (0, drafts) if drafts else (0,)), "conv1d")
                    for s, drafts in shapes.values()]
        _build_untuned(requests, "short conv kernels", gpu, command, stream)
    return why


def _local_build(key: KernelKey, what: str):
    """((local GPU, the command that builds `key`), None) when `what` can be built here, else
    (None, one line saying why not and what to run)."""
    from ..gpus import detect_local_gpu

    gpu = detect_local_gpu()
    if gpu is None:
        return None, "no CUDA GPU here to build kernels for"
    command = tune_command(key, gpu.name)
    if not enabled():
        return None, f"no compiled {what} on {gpu.name} ({SWITCH}=0); build them with `{command}`"
    problem = build_problem()
    if problem is not None:
        return None, f"no compiled {what} on {gpu.name}; {problem}; then `{command}` builds them"
    return (gpu, command), None


def build(key: KernelKey, conv_dtype: str, gpu, command: str, stream=None) -> None:
    """Compile `key`'s head shape and its short conv for `gpu` into the artifact cache, untuned."""
    from ..autotune import tuner
    from ..autotune.models import conv_shape

    shape = specs.record_shapes(key)[0]
    chunk, drafts = specs.layouts(key)[0]
    requests = [(tuner.TuneRequest(gpu, s, (chunk,), tuner.BATCH_BUCKETS, (0, drafts) if drafts else (0,)),
                 s["family"]) for s in (shape, conv_shape({**shape, "dtype": conv_dtype}))]
    _build_untuned(requests, "kernels", gpu, command, stream)


def _build_untuned(requests, what: str, gpu, command: str, stream=None) -> None:
    """Build each (TuneRequest, template family) untuned into the artifact cache, with one line
    saying so and one progress bar."""
    from ..autotune import tuner
    from ..autotune.cache import ArtifactCache
    from ..autotune.progress import KernelProgress
    from ..autotune.registry import templates

    stream = stream or sys.stderr
    cache = ArtifactCache()
    found = [(req, templates(family)) for req, family in requests]
    total = sum(len(tuner.plan(tpls, req.shape, req.chunk_sizes, req.draft_tokens)) for req, tpls in found)
    stream.write(f"kvbuffer: building the {total} {what} this model needs for the {gpu.name} once, with "
                 f"untuned defaults, into {cache.root} (later runs load them); `{command}` measures the "
                 "fastest\n")
    with KernelProgress(total, stream) as bar:
        for req, tpls in found:
            tuner.build_untuned(cache, req, tpls, progress=bar.done, on_start=bar.start)


# ----------------------------------------------------------------------------------------------
# the engine's one pass over its fast path


@dataclass(frozen=True)
class Planned:
    """A kernel the engine's fast path looks up: `group` names the first-use build that makes it
    (a key of `complete`'s builders), `instead` what runs without it ("the short conv runs on torch")."""

    key: KernelKey
    group: str
    instead: str


def kernel_name(key: KernelKey) -> str:
    """How a warning names a kernel: the template `kvbuffer tune` builds it from ('conv1d_step'), else its spec's name."""
    return specs.tune_template(key) or specs.spec_for(key).name


def complete(planned: list[Planned], builders: Mapping[str, Callable[[list[KernelKey]], str | None]],
             loads: Callable[[KernelKey], bool], command: Callable[[KernelKey], str]) -> list[Planned]:
    """Build what `planned` lacks, group by group in order (`builders[group](missing keys)` returns
    None once built, else one line saying why not), then log one WARNING per group whose kernels
    still do not load: the kernels, what runs instead, and the builder's line where it names the
    command (in backquotes), else `command(key)` (the `kvbuffer tune` run that builds them) and
    the builder's reason. Returns the kernels still missing."""
    unknown = sorted({p.group for p in planned} - set(builders))
    if unknown:
        raise ValueError(f"planned kernels name groups without a builder: {unknown}")
    missing = [p for p in planned if not loads(p.key)]
    why = {}
    for group in builders:
        keys = [p.key for p in missing if p.group == group and not loads(p.key)]
        if keys:
            why[group] = builders[group](keys)
    still = [p for p in missing if not loads(p.key)]
    for group in dict.fromkeys(p.group for p in still):
        part = [p for p in still if p.group == group]
        names = ", ".join(dict.fromkeys(kernel_name(p.key) for p in part))
        reason = why.get(group)
        tail = reason if reason and "`" in reason else \
            f"`{command(part[0].key)}` builds {'them' if len(part) > 1 else 'it'}" + (f" ({reason})" if reason else "")
        log.warning("kvbuffer: no compiled %s kernel%s: %s, slower; %s", names, "s" if len(part) > 1 else "",
                    part[0].instead, tail)
    return still
