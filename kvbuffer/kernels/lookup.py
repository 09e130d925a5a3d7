"""Find the compiled kernel for a KernelKey: the artifact cache, else a JIT compile, else an error.

1. the artifact cache (built by `kvbuffer tune`; nothing is compiled), else
2. a JIT compile of the key's spec (kvbuffer.kernels.specs) for the local GPU, only when allowed
   (`KVBUFFER_JIT=1` or `allow_jit()`), else
3. ArtifactError naming the `kvbuffer tune ...` command that builds it.
"""

from __future__ import annotations

import logging
import os

from ..errors import ArtifactError
from . import specs
from .compiled import CompiledOp
from .keys import KernelKey, linear_dims
from .specs import spec_for

log = logging.getLogger(__name__)

_JIT = {"allowed": None}  # None: follow $KVBUFFER_JIT
_KERNELS: dict = {}       # (KernelKey, batch) -> CompiledOp: one dict lookup per call
_LOADED: dict = {}        # artifact name or ("jit", KernelKey) -> CompiledOp: each kernel loaded once


def allow_jit(allowed: bool | None = True) -> None:
    """Let CUDA calls compile missing kernels with TileLang (instead of raising ArtifactError);
    None: follow $KVBUFFER_JIT again."""
    _JIT["allowed"] = None if allowed is None else bool(allowed)


def jit_allowed() -> bool:
    if _JIT["allowed"] is not None:
        return _JIT["allowed"]
    return os.environ.get("KVBUFFER_JIT", "") not in ("", "0")


def kernel_for(key: KernelKey, batch: int = 1) -> CompiledOp:
    """The compiled kernel for `key` at this batch size; cached."""
    op = _KERNELS.get((key, batch))
    if op is None:
        op = _KERNELS[(key, batch)] = _load(key, max(int(batch), 1))
    return op


def loaded_keys() -> list[KernelKey]:
    """The keys this process has looked up (each once, whatever the batch sizes)."""
    return list(dict.fromkeys(key for key, _ in _KERNELS))


def clear_kernels(family: str | None = None) -> None:
    """Forget the looked-up kernels, all or one family's (e.g. after rebuilding the artifact cache)."""
    if family is None:
        _KERNELS.clear()
        _LOADED.clear()
        return
    dropped = {id(op) for (key, _), op in _KERNELS.items() if key.family == family}
    for entry in [e for e in _KERNELS if e[0].family == family]:
        del _KERNELS[entry]
    for name in [n for n, op in _LOADED.items() if id(op) in dropped or (isinstance(n, tuple) and n[1].family == family)]:
        del _LOADED[name]


def _load(key: KernelKey, batch: int) -> CompiledOp:
    try:
        return _from_artifacts(key, batch)
    except ArtifactError as e:
        if not jit_allowed():
            raise ArtifactError(f"{e}\n(or set KVBUFFER_JIT=1 / call kvbuffer.ops.allow_jit() to compile "
                                "missing kernels with TileLang)") from None
        if ("jit", key) not in _LOADED:
            log.info("kvbuffer: no artifact for %s (%s); compiling with TileLang", key, str(e).splitlines()[0])
            _LOADED[("jit", key)] = jit(key)
        return _LOADED[("jit", key)]


def _from_artifacts(key: KernelKey, batch: int) -> CompiledOp:
    template = specs.tune_template(key)
    if template is None:
        raise ArtifactError(f"`kvbuffer tune` builds no {key.op} kernel for {key} (it builds the recurrent step and, for "
                            "buffers of C + T + 1 entries, decode steps, prefill chunks, verifies of T + 1 tokens "
                            "and flushes, and the chunked prefill; for the conv, the SiLU step, prompt, verify and "
                            "accept; for attention, 1 .. 8 new tokens per row; for a projection, one row)")
    spec = spec_for(key)
    errors = []
    for shape in specs.record_shapes(key):
        try:
            if spec.parts is None:
                return _load_artifact(key, shape, template, batch)
            return _load_parts(key, shape, template, spec.parts(key), batch)
        except ArtifactError as e:
            errors.append(e)
    # a record that exists but lacks this layout says more than the shapes that have none
    raise next((e for e in errors if "in this tuning record" in str(e)), errors[0])


def _load_parts(key: KernelKey, shape: dict, template: str, parts: tuple, batch: int) -> CompiledOp:
    """A kernel of several launches, stored as one artifact per part (`<template>_<part>`), built together
    with one set of tunables."""
    loaded = {part: _load_artifact(key, shape, f"{template}_{part}", batch) for part in parts}
    entry = ("parts", key, tuple(id(op) for op in loaded.values()))  # each part's artifact is loaded once
    if entry not in _LOADED:
        first = next(iter(loaded.values()))
        _LOADED[entry] = CompiledOp({part: op.fn for part, op in loaded.items()}, first.kind, first.params)
    return _LOADED[entry]


def _load_artifact(key: KernelKey, shape: dict, template: str, batch: int) -> CompiledOp:
    """The artifact the local GPU's tuning record for `shape` names for `template` at this batch, in
    the first of the key's layouts it was built for; each artifact is loaded once."""
    from ..gpus import detect_local_gpu
    from ..tuning import TuningStore, select

    gpu = detect_local_gpu()
    if gpu is None:
        raise ArtifactError("no CUDA GPU here: compiled kernels run on CUDA tensors")
    store = TuningStore()
    hint = f"build it with `{specs.tune_command(key).replace('<gpu>', gpu.name)}`"
    try:
        record = store.find_tuning(gpu.name, gpu.arch, shape)
    except ArtifactError as e:
        raise ArtifactError(f"no compiled {template} kernel for {shape} on {gpu.name}: {e}; {hint}") from None
    missing = None
    for chunk, drafts in specs.layouts(key):
        try:
            name, chunk = select(record, template, batch, chunk, drafts)
            break
        except KeyError as e:
            missing = missing or e.args[0]
    else:
        raise ArtifactError(f"{missing} ({template}); {hint}")
    if name not in _LOADED:
        artifact = store.load(name, arch=gpu.arch, gpu=gpu.name, expect=(template, shape, chunk, drafts))
        log.info("kvbuffer.kernels: %s from artifact %s", template, name)
        _LOADED[name] = CompiledOp(artifact.fn, spec_for(key).kind, spec_for(key).launch_params(key, artifact.key.tunables))
    return _LOADED[name]


def untuned_tunables(family: str, op: str, K: int, V: int, T: int = 1, group: int = 1) -> dict:
    """The untuned tunables of a linear kernel of head dims K, V at T tokens per row (`group`: value
    heads per key head): its spec's defaults."""
    key = KernelKey(family, op, linear_dims(family, 1, group, K, V), T=T)
    return spec_for(key).defaults(key)


def jit_tunables(key: KernelKey) -> dict:
    """The tunables a JIT compile of `key` gets (its spec's defaults)."""
    return spec_for(key).defaults(key)


def jit(key: KernelKey) -> CompiledOp:
    """Compile the kernel for `key` with TileLang for the local GPU (imports the compile side)."""
    return spec_for(key).build(key)
