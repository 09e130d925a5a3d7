"""Find the compiled kernel for a KernelKey: the artifact cache, else a JIT compile, else an error.

One lookup and one in-process cache for every family (GDN, Mamba-2, conv1d, attention, gemv):

1. the artifact cache (kvbuffer.artifacts; built by `kvbuffer tune`; nothing is compiled), else
2. a JIT compile with TileLang for the local GPU (kvbuffer.kernels' `build_*`), only when allowed:
   `KVBUFFER_JIT=1` or `allow_jit()`, else
3. ArtifactError naming the `kvbuffer tune ...` command that builds it.

The runtime side imports nothing from the compile side (kvbuffer.autotune, kvbuffer.tiles) unless a
JIT compile runs.
"""

from __future__ import annotations

import importlib
import logging
import os

from ..errors import ArtifactError
from .compiled import CompiledOp
from .keys import KernelKey

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
    template = key.template()
    if template is None:
        raise ArtifactError(f"`kvbuffer tune` builds no {key.op} kernel for {key} (it builds the recurrent step and, for "
                            "buffers of C + T + 1 entries, decode steps, prefill chunks, verifies of T + 1 tokens "
                            "and flushes; for the conv, the SiLU step, prompt, verify and accept; for attention, "
                            "1 .. 8 new tokens per row; for a projection, one row)")
    errors = []
    for shape in key.record_shapes():
        try:
            return _load_artifact(key, shape, template, batch)
        except ArtifactError as e:
            errors.append(e)
    # a record that exists but lacks this layout says more than the shapes that have none
    raise next((e for e in errors if "in this tuning record" in str(e)), errors[0])


def _load_artifact(key: KernelKey, shape: dict, template: str, batch: int) -> CompiledOp:
    """The artifact the local GPU's tuning record for `shape` names for `template` at this batch, in
    the first of the key's layouts it was built for; each artifact is loaded once."""
    from ..artifacts import ArtifactStore
    from ..gpus import detect_local_gpu
    from ..tuning import select

    gpu = detect_local_gpu()
    if gpu is None:
        raise ArtifactError("no CUDA GPU here: compiled kernels run on CUDA tensors")
    store = ArtifactStore()
    hint = f"build it with `{key.tune_command().replace('<gpu>', gpu.name)}`"
    try:
        record = store.find_tuning(gpu.name, gpu.arch, shape)
    except ArtifactError as e:
        raise ArtifactError(f"no compiled {template} kernel for {shape} on {gpu.name}: {e}; {hint}") from None
    missing = None
    for chunk, drafts in key.layouts():
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
        _LOADED[name] = CompiledOp(artifact.fn, key.compiled_kind(), key.launch_params(artifact.key.tunables))
    return _LOADED[name]


def untuned_tunables(family: str, op: str, K: int, V: int, T: int = 1, group: int = 1) -> dict:
    """The tunables a linear kernel gets when nothing was tuned (the JIT, and the kernel benchmarks
    without --configs).

    Buffered kernels of T tokens per row: the template's measured best, narrowed for small head dims
    (tiles.<family>.default_buffered_tunables; `group` is Hv / Hk, the value heads that share a key head,
    which a Mamba-2 block may serve together). The recurrent step and the flush: BV = 32 (at most V).
    """
    if op == "buffered":
        tiles = importlib.import_module(f"kvbuffer.tiles.{family}")
        return tiles.default_buffered_tunables(K, V, T, group)
    if op == "recurrent_drafts":  # the most threads its front can lay T x K token values out over
        fits = importlib.import_module("kvbuffer.tiles.recurrent_drafts").fits_threads
        threads = next((n for n in (128, 64, 32) if fits(T * K, n)), None)
        if threads is None:
            raise ValueError(f"no thread count in (128, 64, 32) lays out {T} tokens x K = {K} for the recurrent "
                             "verify's front (K a multiple of 32 always fits)")
        return {"BV": min(32, V), "threads": threads}
    return {"BV": min(32, V), "threads": 128}


def jit_tunables(key: KernelKey) -> dict:
    """untuned_tunables for the kernel `key` names."""
    dims = key.dims.record_fields()
    return untuned_tunables(key.family, key.op, dims["K"], dims["V"], key.T, dims["Hv"] // dims["Hk"])


def jit(key: KernelKey) -> CompiledOp:
    """Compile the kernel for `key` with TileLang for the local GPU (imports the compile side)."""
    from . import attention, conv, gdn, mamba2
    from .gemv import build_gemv, build_gemv_experts, build_grouped_experts

    if key.family == "gemv":
        if key.op == "grouped":
            defaults = importlib.import_module("kvbuffer.tiles.grouped").DEFAULT
            return build_grouped_experts(key.dims.N, key.dims.K, dtype=key.in_dtype, **defaults)
        defaults = importlib.import_module("kvbuffer.tiles.gemv").DEFAULT
        if key.op == "experts":
            return build_gemv_experts(key.dims.N, key.dims.K, dtype=key.in_dtype, **defaults)
        return build_gemv(key.dims.N, key.dims.K, key.T, dtype=key.in_dtype, **defaults)
    if key.family == "attention":
        d = key.dims
        if key.op == "combine":
            return attention.build_attention_combine(d.H, d.D, key.T, dtype=key.in_dtype)
        return attention.build_attention_decode(d.H, d.Hkv, d.D, key.T, dtype=key.in_dtype, kv_dtype=key.buf_dtype)
    if key.family == "conv1d":
        d = key.dims
        if key.op == "accept":
            return conv.build_conv1d_accept(d.D, d.W, d.span, dtype=key.in_dtype)
        return conv.build_conv1d_update(d.D, d.W, d.span, key.T, key.op, dtype=key.in_dtype, w_dtype=key.w_dtype,
                                        has_bias=key.has_bias, silu=key.silu)
    module = gdn if key.family == "gdn" else mamba2
    t = jit_tunables(key)
    dims = tuple(key.dims.record_fields().values())
    extra = {"has_z": key.has_z} if key.family == "mamba2" and key.op != "flush" else {}
    build = getattr(module, f"build_{key.family}_{key.op}")
    if key.op == "recurrent":
        return build(*dims, in_dtype=key.in_dtype, **extra, **t)
    if key.op == "recurrent_drafts":
        return build(*dims, T_new=key.T, in_dtype=key.in_dtype, **extra, **t)
    if key.op == "buffered":
        return build(*dims, cap=key.cap, T_new=key.T, flush_at=key.C, in_dtype=key.in_dtype,
                     buf_dtype=key.buf_dtype, **extra, **t)
    return build(*dims, cap=key.cap, buf_dtype=key.buf_dtype, **t)
