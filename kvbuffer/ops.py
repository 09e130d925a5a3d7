"""kvbuffer's kernels as torch custom ops (`torch.ops.kvbuffer.*`), for torch.compile and CUDA graphs.

    torch.ops.kvbuffer.gdn_recurrent_step(q, k, v, a, b, A_log, dt_bias, state, state_slots) -> o
    torch.ops.kvbuffer.gdn_buffered_step(q, k, v, a, b, A_log, dt_bias, state, state_slots,
                                         buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at) -> o
    torch.ops.kvbuffer.gdn_verify(<as gdn_buffered_step, inputs (B, T, ...)>, flush_at) -> o (B, T, Hv, V)
    torch.ops.kvbuffer.gdn_flush(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    torch.ops.kvbuffer.mamba2_recurrent_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, z=None) -> y
    torch.ops.kvbuffer.mamba2_buffered_step / mamba2_verify / mamba2_flush   (the same pattern)

Semantics, shapes and slot rules are kvbuffer.reference's (gdn / mamba2 / core); `flush_at` = C > 0
folds a row whose buffer reaches C entries with these tokens into its state in the same call (the
caller resets its length), 0 = no fused flush. Declared mutations: `state` and the three buffer
tensors (entries are written at lengths[b] ..; lengths are never changed).

CPU: the pure-torch reference. CUDA: a compiled kernel for the arguments' shapes (activations and
buffer entries bf16 or fp16, states and log decays fp32, contiguous), looked up once per
(kind, head shape, dtypes, cap, T, C, batch bucket):

1. the artifact cache (kvbuffer.artifacts; built by `kvbuffer tune`; nothing is compiled), else
2. a JIT compile through kvbuffer.kernels.build_* (imports TileLang), only when allowed:
   `KVBUFFER_JIT=1` or `kvbuffer.ops.allow_jit()`, else
3. ArtifactError naming the `kvbuffer tune ...` command.

Eager CUDA calls go through kvbuffer.kernels' validated launchers. While a CUDA graph is being
captured the launch is direct (the launchers' value checks synchronize); validate by running the
same shapes eagerly first, which also loads the kernel.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from .errors import ArtifactError
from .reference import core as ref_core
from .reference import gdn as ref_gdn
from .reference import mamba2 as ref_mamba2

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_JIT = {"allowed": None}  # None: follow $KVBUFFER_JIT
_KERNELS: dict = {}       # (KernelKey, batch) -> kvbuffer.kernels.CompiledOp: one dict lookup per call
_LOADED: dict = {}        # artifact name or ("jit", KernelKey) -> CompiledOp: each kernel loaded once


def allow_jit(allowed: bool = True) -> None:
    """Let CUDA calls compile missing kernels with TileLang (instead of raising ArtifactError)."""
    _JIT["allowed"] = bool(allowed)


def jit_allowed() -> bool:
    if _JIT["allowed"] is not None:
        return _JIT["allowed"]
    return os.environ.get("KVBUFFER_JIT", "") not in ("", "0")


# ----------------------------------------------------------------------------------------------
# kernel lookup


@dataclass(frozen=True)
class KernelKey:
    """What one compiled kernel is specialised for (batch and pool sizes are dynamic)."""

    family: str        # "gdn" | "mamba2"
    kind: str          # "recurrent" | "buffered" | "flush"
    Hk: int            # Mamba-2: groups G
    Hv: int            # Mamba-2: heads H
    K: int             # Mamba-2: state size N
    V: int             # Mamba-2: head dim P
    in_dtype: str      # activations ("" for the flush)
    buf_dtype: str     # buffer entries ("" for the recurrent step)
    cap: int = 0       # buffer entries per slot
    T: int = 1         # tokens per row (verify drafts / prefill chunk)
    C: int = 0         # flush_at (0: no fused flush)
    has_z: bool = False

    @property
    def shape(self) -> dict:
        """The artifact cache's head shape (kvbuffer.autotune.models)."""
        return {"family": self.family, "Hk": self.Hk, "Hv": self.Hv, "K": self.K, "V": self.V,
                "dtype": self.in_dtype or self.buf_dtype}

    def tune_command(self) -> str:
        layouts = self.layouts()
        C, drafts = layouts[0] if len(layouts) == 1 else (self.cap - 1, 0)
        dtype = self.in_dtype or self.buf_dtype
        return (f"kvbuffer tune --gpu <gpu> --heads {self.Hk},{self.Hv},{self.K},{self.V}"
                + (f" --family {self.family}" if self.family != "gdn" else "")
                + (f" --dtype {dtype}" if dtype != "bfloat16" else "")
                + (f" --chunk-sizes {C}" if self.kind != "recurrent" else "")
                + (f" --draft-tokens {drafts}" if drafts else ""))

    def layouts(self) -> list[tuple[int | None, int]]:
        """The (chunk size C, speculative drafts) buffer layouts, C + drafts + 1 entries, this kernel fits.

        The decode step and prefill chunks name C (flush_at), so drafts = cap - C - 1; a verify (no
        flush) is fed drafts + 1 = T tokens, so drafts = T - 1 and C = cap - T; a flush fits every
        split of its capacity (the first one built is used).
        """
        if self.kind == "recurrent":
            return [(None, 0)]
        if self.kind == "flush":
            return [(self.cap - 1 - d, d) for d in range(self.cap - 1)]
        if self.C:
            return [(self.C, self.cap - self.C - 1)] if self.cap > self.C else []
        return [(self.cap - self.T, self.T - 1)] if self.T > 1 and self.cap > self.T else []


def _template(key: KernelKey) -> str | None:
    """The `kvbuffer tune` template that builds this kernel, or None if tune builds no such variant.

    tune builds the recurrent step, and per buffer layout (C + T + 1 entries for T speculative
    drafts, `--draft-tokens`; C + 1 for plain decoding) the decode step (flush fused at C), the
    8/4/2-token prefill chunks (flush fused at C), the verify of T drafts plus the last token and
    the flush, all without z and with activations and entries of one dtype.
    """
    if key.has_z or (key.kind == "buffered" and key.in_dtype != key.buf_dtype) or not key.layouts():
        return None
    if key.kind == "recurrent":
        return f"{key.family}_recurrent"
    if key.kind == "flush":
        return f"{key.family}_flush"
    if key.C == 0:
        return f"{key.family}_verify"
    if key.T == 1:
        return f"{key.family}_buffered_step"
    if key.T in (2, 4, 8) and key.C >= key.T:
        return f"{key.family}_prefill_chunk{key.T}"  # the engine's prefill chunks, flush fused at C
    return None


def kernel_for(key: KernelKey, batch: int):
    """The compiled kernel (kvbuffer.kernels.CompiledOp) for `key` at this batch size; cached."""
    op = _KERNELS.get((key, batch))
    if op is None:
        op = _KERNELS[(key, batch)] = _load(key, max(int(batch), 1))
    return op


def _load(key: KernelKey, batch: int):
    return artifact_or_jit(key, batch, _from_artifacts, _jit, _LOADED, ("jit", key))


def artifact_or_jit(key, batch: int, from_artifacts, jit, jitted: dict, jit_key):
    """`from_artifacts(key, batch)`; when there is no artifact, `jit(key)` (compiled once, kept in
    jitted[jit_key]) if JIT is allowed, else the ArtifactError with how to allow it."""
    try:
        return from_artifacts(key, batch)
    except ArtifactError as e:
        if not jit_allowed():
            raise ArtifactError(f"{e}\n(or set KVBUFFER_JIT=1 / call kvbuffer.ops.allow_jit() to compile "
                                "missing kernels with TileLang)") from None
        if jit_key not in jitted:
            log.info("kvbuffer: no artifact for %s (%s); compiling with TileLang", key, str(e).splitlines()[0])
            jitted[jit_key] = jit(key)
        return jitted[jit_key]


def _params(key: KernelKey, tunables: dict) -> dict:
    """The compile-time parameters kvbuffer.kernels' launchers validate against."""
    p = dict(tunables, Hk=key.Hk, Hv=key.Hv, K=key.K, V=key.V, cap=key.cap, T_new=key.T, flush_at=key.C,
             in_dtype=key.in_dtype, buf_dtype=key.buf_dtype, has_z=key.has_z)
    if key.family == "mamba2":
        p.update(G=key.Hk, H=key.Hv, N=key.K, P=key.V)
    return p


def _from_artifacts(key: KernelKey, batch: int):
    from .kernels import CompiledOp

    template = _template(key)
    if template is None:
        raise ArtifactError(f"`kvbuffer tune` builds no {key.kind} kernel with cap={key.cap}, T={key.T}, "
                            f"flush_at={key.C}, has_z={key.has_z} (it builds the recurrent step and, for buffers of "
                            "C + T + 1 entries, decode steps, 8/4/2-token prefill chunks, verifies of T + 1 tokens "
                            "and flushes)")
    return load_artifact(key.shape, template, batch, key.layouts(), key.tune_command(),
                         lambda artifact: CompiledOp(artifact.fn, key.kind, _params(key, artifact.key.tunables)))


def load_artifact(shape: dict, template: str, batch: int, layouts, tune_command: str, make_op):
    """`make_op(artifact)` for the artifact the tuning record of this GPU and shape names for
    `template` at this batch, in the first of `layouts` ((chunk size, drafts) pairs) it was built
    for; each artifact is loaded once. ArtifactError (naming `tune_command`) when there is none."""
    from .artifacts import ArtifactStore
    from .autotune.gpus import detect_local_gpu
    from .autotune.policy import select

    gpu = detect_local_gpu()
    if gpu is None:
        raise ArtifactError("no CUDA GPU here: compiled kernels run on CUDA tensors")
    store = ArtifactStore()
    hint = f"build it with `{tune_command.replace('<gpu>', gpu.name)}`"
    try:
        record = store.find_tuning(gpu.name, gpu.arch, shape)
    except ArtifactError as e:
        raise ArtifactError(f"no compiled {template} kernel for {shape} on {gpu.name}: {e}; {hint}") from None
    missing = None
    for chunk, drafts in layouts:
        try:
            name, _ = select(record, template, batch, chunk, drafts)
            break
        except KeyError as e:
            missing = missing or e.args[0]
    else:
        raise ArtifactError(f"{missing} ({template}); {hint}")
    if name not in _LOADED:
        artifact = store.load(name, arch=gpu.arch, gpu=gpu.name)
        log.info("kvbuffer.ops: %s from artifact %s", template, name)
        _LOADED[name] = make_op(artifact)
    return _LOADED[name]


def jit_tunables(key: KernelKey) -> dict:
    """The tunables a JIT-compiled kernel gets when nothing was tuned.

    Buffered kernels: the template's measured best, narrowed for small head dims
    (tiles.<family>.default_buffered_tunables). The recurrent step and the flush: BV = 32 (at most V).
    """
    if key.kind == "buffered":
        tiles = importlib.import_module(f"kvbuffer.tiles.{key.family}")
        return tiles.default_buffered_tunables(key.K, key.V)
    return {"BV": min(32, key.V), "threads": 128}


def _jit(key: KernelKey):
    from . import kernels

    t = jit_tunables(key)
    dims = (key.Hk, key.Hv, key.K, key.V)
    extra = {"has_z": key.has_z} if key.family == "mamba2" and key.kind != "flush" else {}
    if key.kind == "recurrent":
        build = kernels.build_gdn_recurrent if key.family == "gdn" else kernels.build_mamba2_recurrent
        return build(*dims, in_dtype=key.in_dtype, **extra, **t)
    if key.kind == "buffered":
        build = kernels.build_gdn_buffered if key.family == "gdn" else kernels.build_mamba2_buffered
        return build(*dims, cap=key.cap, T_new=key.T, flush_at=key.C, in_dtype=key.in_dtype,
                     buf_dtype=key.buf_dtype, **extra, **t)
    build = kernels.build_gdn_flush if key.family == "gdn" else kernels.build_mamba2_flush
    return build(*dims, cap=key.cap, buf_dtype=key.buf_dtype, **t)


def clear_kernels() -> None:
    """Forget the looked-up kernels (e.g. after rebuilding the artifact cache)."""
    _KERNELS.clear()
    _LOADED.clear()


# ----------------------------------------------------------------------------------------------
# CUDA launch


def _dtype(t: torch.Tensor) -> str:
    return _DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch."))


_TRUST = threading.local()


@contextlib.contextmanager
def unchecked():
    """Within this block the CUDA ops skip their data-dependent checks (slot ranges, duplicate
    slots, buffer room, the fill rules), which read the device back and so stall the launch queue.
    For callers that built the slots and lengths themselves, like kvbuffer's engine; shapes, dtypes
    and contiguity are still checked by the compiled kernels' entry. CUDA-graph capture skips the
    checks too (it must)."""
    before = getattr(_TRUST, "on", False)
    _TRUST.on = True
    try:
        yield
    finally:
        _TRUST.on = before


def _launch_directly() -> bool:
    """Launch directly, without the reading-back checks: under capture or unchecked()."""
    return getattr(_TRUST, "on", False) or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _on_torch_stream(fn, *args):
    """Launch on torch's current stream (the capture stream during CUDA graph capture)."""
    import tvm_ffi

    with tvm_ffi.use_torch_stream():
        return fn(*args)


def _gdn_key(kind, k, v, buf_k=None, T=1, C=0) -> KernelKey:
    cap = buf_k.shape[1] if buf_k is not None else 0
    return KernelKey("gdn", kind, k.shape[-2], v.shape[-2], k.shape[-1], v.shape[-1], _dtype(v),
                     _dtype(buf_k) if buf_k is not None else "", cap, T, C)


def _m2_key(kind, x, Bm, buf_k=None, T=1, C=0, z=None) -> KernelKey:
    cap = buf_k.shape[1] if buf_k is not None else 0
    return KernelKey("mamba2", kind, Bm.shape[-2], x.shape[-2], Bm.shape[-1], x.shape[-1], _dtype(x),
                     _dtype(buf_k) if buf_k is not None else "", cap, T, C, z is not None)


def _flush_key(family, state, buf_k) -> KernelKey:
    return KernelKey(family, "flush", buf_k.shape[2], state.shape[1], state.shape[2], state.shape[3], "",
                     _dtype(buf_k), buf_k.shape[1])


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet ops


@torch.library.custom_op("kvbuffer::gdn_recurrent_step", mutates_args=("state",), device_types="cpu")
def gdn_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                       state_slots: torch.Tensor) -> torch.Tensor:
    """reference.gdn.recurrent_step: q, k (B, Hk, K), v (B, Hv, V), a, b (B, Hv) -> o (B, Hv, V)."""
    return ref_gdn.recurrent_step(q, k, v, a, b, A_log, dt_bias, state, state_slots)


@gdn_recurrent_step.register_kernel("cuda")
def _(q, k, v, a, b, A_log, dt_bias, state, state_slots):
    from . import kernels

    op = kernel_for(_gdn_key("recurrent", k, v), q.shape[0])
    if not _launch_directly():
        return _on_torch_stream(kernels.gdn_recurrent_step, op, q, k, v, a, b, A_log, dt_bias, state, state_slots)
    o = torch.empty_like(v)
    u = lambda t: t.unsqueeze(1)  # noqa: E731  (the kernel takes a token axis of 1)
    _on_torch_stream(op.fn, u(q), u(k), u(v), u(a), u(b), A_log, dt_bias, state, state_slots, u(o))
    return o


def _gdn_buffered_cpu(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                      lengths, flush_at):
    """reference verify of T tokens, folding the buffers that reach flush_at (the kernels' semantics)."""
    return ref_gdn.verify(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                          lengths, flush_at)


_BUFFER_MUTATIONS = ("state", "buf_k", "buf_v", "buf_g")


@torch.library.custom_op("kvbuffer::gdn_buffered_step", mutates_args=_BUFFER_MUTATIONS, device_types="cpu")
def gdn_buffered_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
                      buf_k: torch.Tensor, buf_v: torch.Tensor, buf_g: torch.Tensor, buffer_slots: torch.Tensor,
                      lengths: torch.Tensor, flush_at: int) -> torch.Tensor:
    """reference.gdn.buffered_step(flush_at): q, k (B, Hk, K), v (B, Hv, V), a, b (B, Hv) -> o (B, Hv, V)."""
    u = lambda t: t.unsqueeze(1)  # noqa: E731
    return _gdn_buffered_cpu(u(q), u(k), u(v), u(a), u(b), A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g,
                             buffer_slots, lengths, flush_at)[:, 0]


@gdn_buffered_step.register_kernel("cuda")
def _(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at):
    from . import kernels

    op = kernel_for(_gdn_key("buffered", k, v, buf_k, 1, flush_at), q.shape[0])
    bufs = (state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if not _launch_directly():
        return _on_torch_stream(kernels.gdn_buffered_step, op, q, k, v, a, b, A_log, dt_bias, *bufs)
    u = lambda t: t.unsqueeze(1)  # noqa: E731
    o = torch.empty_like(v)
    _on_torch_stream(op.fn, u(q), u(k), u(v), u(a), u(b), A_log, dt_bias, *bufs, u(o))
    return o


@torch.library.custom_op("kvbuffer::gdn_verify", mutates_args=_BUFFER_MUTATIONS, device_types="cpu")
def gdn_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
               buf_k: torch.Tensor, buf_v: torch.Tensor, buf_g: torch.Tensor, buffer_slots: torch.Tensor,
               lengths: torch.Tensor, flush_at: int = 0) -> torch.Tensor:
    """reference.gdn.verify of T tokens (inputs (B, T, ...)) -> o (B, T, Hv, V); flush_at > 0: a prefill chunk."""
    return _gdn_buffered_cpu(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g,
                             buffer_slots, lengths, flush_at)


@gdn_verify.register_kernel("cuda")
def _(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at=0):
    from . import kernels

    op = kernel_for(_gdn_key("buffered", k, v, buf_k, q.shape[1], flush_at), q.shape[0])
    args = (q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if not _launch_directly():
        return _on_torch_stream(kernels.gdn_verify, op, *args)
    o = torch.empty_like(v)
    _on_torch_stream(op.fn, *args, o)
    return o


@torch.library.custom_op("kvbuffer::gdn_flush", mutates_args=("state",), device_types="cpu")
def gdn_flush(state: torch.Tensor, state_slots: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor,
              buf_g: torch.Tensor, buffer_slots: torch.Tensor, lengths: torch.Tensor) -> None:
    """reference.core.flush: fold each row's lengths[b] entries into its state."""
    ref_core.flush(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)


def _flush_cuda(family: str, launcher_name: str):
    def impl(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths):
        from . import kernels

        op = kernel_for(_flush_key(family, state, buf_k), buffer_slots.shape[0])
        args = (state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
        if _launch_directly():
            _on_torch_stream(op.fn, *args)
        else:
            _on_torch_stream(getattr(kernels, launcher_name), op, *args)
    return impl


gdn_flush.register_kernel("cuda")(_flush_cuda("gdn", "gdn_flush"))


# ----------------------------------------------------------------------------------------------
# Mamba-2 ops (G groups = key heads, H heads, N state size = K, P head dim = V)


@torch.library.custom_op("kvbuffer::mamba2_recurrent_step", mutates_args=("state",), device_types="cpu")
def mamba2_recurrent_step(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                          B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                          state_slots: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference.mamba2.recurrent_step: x (Bt, H, P), dt (Bt, H), B, C (Bt, G, N) -> y (Bt, H, P)."""
    return ref_mamba2.recurrent_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, z)


@mamba2_recurrent_step.register_kernel("cuda")
def _(x, dt, A_log, dt_bias, B, C, D, state, state_slots, z=None):
    from . import kernels

    op = kernel_for(_m2_key("recurrent", x, B, z=z), x.shape[0])
    if not _launch_directly():
        return _on_torch_stream(kernels.mamba2_recurrent_step, op, x, dt, A_log, dt_bias, B, C, D, state,
                                state_slots, z)
    u = lambda t: t.unsqueeze(1)  # noqa: E731
    y = torch.empty_like(x)
    _on_torch_stream(op.fn, u(x), u(dt), A_log, dt_bias, u(B), u(C), D, u(x if z is None else z), state,
                     state_slots, u(y))
    return y


def _m2_buffered_cpu(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                     lengths, flush_at, z):
    return ref_mamba2.verify(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                             lengths, z, flush_at)


@torch.library.custom_op("kvbuffer::mamba2_buffered_step", mutates_args=_BUFFER_MUTATIONS, device_types="cpu")
def mamba2_buffered_step(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                         B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                         state_slots: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor, buf_g: torch.Tensor,
                         buffer_slots: torch.Tensor, lengths: torch.Tensor, flush_at: int,
                         z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference.mamba2.buffered_step(flush_at): x (Bt, H, P) ... -> y (Bt, H, P)."""
    u = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731
    return _m2_buffered_cpu(u(x), u(dt), A_log, dt_bias, u(B), u(C), D, state, state_slots, buf_k, buf_v, buf_g,
                            buffer_slots, lengths, flush_at, u(z))[:, 0]


@mamba2_buffered_step.register_kernel("cuda")
def _(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at,
      z=None):
    from . import kernels

    op = kernel_for(_m2_key("buffered", x, B, buf_k, 1, flush_at, z), x.shape[0])
    pools = (state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if not _launch_directly():
        return _on_torch_stream(kernels.mamba2_buffered_step, op, x, dt, A_log, dt_bias, B, C, D, *pools, z)
    u = lambda t: t.unsqueeze(1)  # noqa: E731
    y = torch.empty_like(x)
    _on_torch_stream(op.fn, u(x), u(dt), A_log, dt_bias, u(B), u(C), D, u(x if z is None else z), *pools, u(y))
    return y


@torch.library.custom_op("kvbuffer::mamba2_verify", mutates_args=_BUFFER_MUTATIONS, device_types="cpu")
def mamba2_verify(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                  B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
                  buf_k: torch.Tensor, buf_v: torch.Tensor, buf_g: torch.Tensor, buffer_slots: torch.Tensor,
                  lengths: torch.Tensor, flush_at: int = 0, z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference.mamba2.verify of T tokens (inputs (Bt, T, ...)) -> y (Bt, T, H, P); flush_at > 0: a prefill chunk."""
    return _m2_buffered_cpu(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                            lengths, flush_at, z)


@mamba2_verify.register_kernel("cuda")
def _(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at=0,
      z=None):
    from . import kernels

    op = kernel_for(_m2_key("buffered", x, B, buf_k, x.shape[1], flush_at, z), x.shape[0])
    pools = (state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if not _launch_directly():
        return _on_torch_stream(kernels.mamba2_verify, op, x, dt, A_log, dt_bias, B, C, D, *pools, z)
    y = torch.empty_like(x)
    _on_torch_stream(op.fn, x, dt, A_log, dt_bias, B, C, D, x if z is None else z, *pools, y)
    return y


@torch.library.custom_op("kvbuffer::mamba2_flush", mutates_args=("state",), device_types="cpu")
def mamba2_flush(state: torch.Tensor, state_slots: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor,
                 buf_g: torch.Tensor, buffer_slots: torch.Tensor, lengths: torch.Tensor) -> None:
    """reference.mamba2.flush (the same fold as GDN's)."""
    ref_core.flush(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)


mamba2_flush.register_kernel("cuda")(_flush_cuda("mamba2", "mamba2_flush"))


# ----------------------------------------------------------------------------------------------
# fake (meta) implementations: output shapes only, for torch.compile and export


@gdn_recurrent_step.register_fake
def _(q, k, v, a, b, A_log, dt_bias, state, state_slots):
    return torch.empty_like(v)


@gdn_buffered_step.register_fake
def _(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at):
    return torch.empty_like(v)


@gdn_verify.register_fake
def _(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at=0):
    return torch.empty_like(v)


@mamba2_recurrent_step.register_fake
def _(x, dt, A_log, dt_bias, B, C, D, state, state_slots, z=None):
    return torch.empty_like(x)


@mamba2_buffered_step.register_fake
def _(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at,
      z=None):
    return torch.empty_like(x)


@mamba2_verify.register_fake
def _(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at=0,
      z=None):
    return torch.empty_like(x)


@gdn_flush.register_fake
def _(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths):
    return None


@mamba2_flush.register_fake
def _(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths):
    return None


OPS = ("gdn_recurrent_step", "gdn_buffered_step", "gdn_verify", "gdn_flush",
       "mamba2_recurrent_step", "mamba2_buffered_step", "mamba2_verify", "mamba2_flush")

__all__ = ["OPS", "KernelKey", "allow_jit", "clear_kernels", "jit_allowed", "jit_tunables", "kernel_for", *OPS]
