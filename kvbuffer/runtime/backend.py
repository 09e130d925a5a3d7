"""The Backend: what the mixers and the runner call for step, verify, flush, accept and the conv.

`LLM` resolves one Backend when it is built (`resolve_backend`) and the runner carries it on every
ForwardBatch, so no layer chooses between the reference and the kernels per call:

- REFERENCE runs kvbuffer.reference (pure torch, any device, the dtypes it is given);
- KernelBackend runs kvbuffer's kernel layer: it casts the activations to the kernels' dtype (the
  buffer's: bf16 unless the model is fp16) and the layer parameters to fp32, makes them contiguous
  (the model's projections are split views), launches, and casts the output back. It launches the
  engine's own rows: the slots and fills were built and checked on the host, so the launches skip
  the checks that read the device back. A prompt that reaches a flush point folds on the chunked
  prefill kernel (kvbuffer.kernels.prefill) and buffers its rest as kvbuffer.kernels.PREFILL_CHUNKS
  verify chunks; a shorter one, or one whose chunked kernel does not load, runs as verify chunks. The
  short conv runs on its kernel when that loads, else on the reference (logged once per kernel).

Linear-op inputs travel as GDNInputs / Mamba2Inputs, named tuples in the ops' argument order.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Union

import torch

from ..errors import ArtifactError
from ..kernels import autobuild, launch, lookup, specs
from ..kernels import prefill as prefill_kernels
from ..kernels.keys import (
    ATTENTION_HEAD_DIMS,
    ATTENTION_MAX_TOKENS,
    DTYPE_NAMES,
    PREFILL_CHUNKS,
    GDNDims,
    KernelKey,
    Mamba2Dims,
    prefill_plan,
)
from ..reference import conv as ref_conv
from ..reference import chunked_ops as ref_chunked
from ..reference import core as ref_core
from ..reference import gating as ref_gating
from ..reference import gdn as ref_gdn
from ..reference import mamba2 as ref_mamba2
from . import regions

log = logging.getLogger("kvbuffer")
_OPS = {"gdn": launch.GDN_OPS, "mamba2": launch.MAMBA2_OPS}  # a linear family's ops, by its inputs' family


class GDNInputs(NamedTuple):
    """Gated DeltaNet op inputs: per-token q, k (B, [T,] Hk, K), v (.., Hv, V), a, b (.., Hv); parameters."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor

    family = "gdn"
    output_like = "v"  # the input whose shape and dtype the output has


class Mamba2Inputs(NamedTuple):
    """Mamba-2 op inputs: per-token x (B, [T,] H, P), dt (.., H), B, C (.., G, N); parameters."""

    x: torch.Tensor
    dt: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor

    family = "mamba2"
    output_like = "x"


LinearInputs = Union[GDNInputs, Mamba2Inputs]
PARAMETERS = ("A_log", "dt_bias", "D")  # the per-layer parameters; every other input is per token


def out_dtype(inputs: LinearInputs) -> torch.dtype:
    return getattr(inputs, inputs.output_like).dtype


def per_token(inputs: LinearInputs, fn) -> LinearInputs:
    """`inputs` with fn applied to each per-token tensor (e.g. a slice of the token axis)."""
    return inputs._replace(**{f: fn(getattr(inputs, f)) for f in inputs._fields if f not in PARAMETERS})


class ReferenceBackend:
    """kvbuffer.reference on the engine's rows (the unchecked, sync-free row forms)."""

    name = "reference"
    kernels = False
    _MODULES = {"gdn": ref_gdn, "mamba2": ref_mamba2}

    def recurrent_step(self, inputs: LinearInputs, state, state_slots):
        return self._MODULES[inputs.family].recurrent_step(*inputs, state, state_slots)

    def buffered_step(self, inputs: LinearInputs, state, state_slots, buf, slots, lengths, flush_at: int):
        return self._MODULES[inputs.family].buffered_step(*inputs, state, state_slots, *buf, slots, lengths,
                                                           flush_at=flush_at)

    def verify(self, inputs: LinearInputs, state, state_slots, buf, slots, lengths, flush_at: int = 0):
        """T tokens per row; with flush_at, a prompt chunk that folds the buffers it fills."""
        return self._MODULES[inputs.family].verify(*inputs, state, state_slots, *buf, slots, lengths,
                                                    flush_at=flush_at)

    def recurrent_drafts(self, inputs: LinearInputs, state, state_slots, draft_states, draft_rows):
        """Today's servers' verify: T tokens per row through the recurrence, the state after each kept in
        draft_states[draft_rows[b], t]; `state` is only read."""
        return self._MODULES[inputs.family].recurrent_drafts(*inputs, state, state_slots, draft_states, draft_rows)

    def flush(self, family: str, state, state_slots, buf, slots, lengths) -> None:
        ref_core.flush(state, state_slots, *buf, slots, lengths)

    _PREFILL = {"gdn": ref_chunked.gdn_prefill, "mamba2": ref_chunked.mamba2_prefill}

    def prefill(self, inputs: LinearInputs, state, state_slots, buf, slots, fill: int, flush_at: int,
                fuse: bool = False):
        """A prompt of T tokens per row (inputs (B, T, ...)), every row at buffer fill `fill`: the
        chunked form (kvbuffer.reference.chunked) folds up to the last flush point and buffers the rest.
        Returns o (B, T, Hv, V). `fuse` (ForwardBatch.fuse) lets a Backend run the prompt's elementwise
        front as a compiled region (kvbuffer.runtime.regions); the reference runs it eagerly."""
        B, T = getattr(inputs, inputs.output_like).shape[:2]
        packed = per_token(inputs, lambda t: t.reshape(B * T, *t.shape[2:]))
        cu_seqlens = torch.arange(B + 1, dtype=torch.int64, device=state.device) * T
        lengths = torch.full((B,), fill, dtype=torch.int64, device=state.device)
        o, _ = self._PREFILL[inputs.family](*packed, cu_seqlens, state, state_slots, *buf, slots, lengths, flush_at)
        return o.reshape(B, T, *o.shape[1:])

    def prefill_in_chunks(self, inputs: LinearInputs, state, state_slots, buf, slots, fill: int, flush_at: int):
        """The same prompt as verify chunks that stop at each flush point (the chunk reaching it folds
        the buffer): kvbuffer.kernels.PREFILL_CHUNKS on the kernels, any length on the reference."""
        outs, start, T = [], 0, getattr(inputs, inputs.output_like).shape[1]
        for take in prefill_plan(fill, T, flush_at, kernels=self.kernels):
            part = per_token(inputs, lambda t: t[:, start:start + take])
            lengths = torch.full_like(slots, fill)
            outs.append(self.verify(part, state, state_slots, buf, slots, lengths, flush_at=flush_at))
            fill, start = (fill + take) % flush_at, start + take
        return torch.cat(outs, 1)

    def short_conv(self, x, conv_state, slots, weight, bias, phase: str):
        """Causal depthwise conv + SiLU over x (B, T, D) after each row's history; a verify keeps
        the drafts pending."""
        if phase == "prefill":
            return ref_conv.prefill_rows(x, conv_state, slots, weight, bias)
        if phase == "decode":
            return ref_conv.step_rows(x[:, 0], conv_state, slots, weight, bias)[:, None]
        return ref_conv.verify_rows(x, conv_state, slots, weight, bias)

    def conv_accept(self, conv_state, slots, accepted, width: int) -> None:
        ref_conv.accept_rows(conv_state, slots, accepted, width)

    def attends_in_place(self, q, k_cache) -> bool:
        """Whether `cache_attention` serves this call (else attention gathers windows in torch)."""
        return False


REFERENCE = ReferenceBackend()
_CONV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernel_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Activations and buffer entries on the kernels: the model's bf16/fp16, else bf16."""
    return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


class KernelBackend(ReferenceBackend):
    """kvbuffer's kernel layer on the engine's rows; the conv falls back to the reference per kernel."""

    name = "kernels"
    kernels = True

    def __init__(self):
        self.conv_on_reference: set = set()  # conv kernel keys that did not load: the reference until JIT is on
        self.attention_on_window_path: set = set()  # attention kernel keys that did not load: the torch window path
        self.prefill_in_verify_chunks: set = set()  # chunked prefill keys that did not load: verify chunks

    @staticmethod
    def _cast(inputs: LinearInputs, dtype: torch.dtype) -> LinearInputs:
        return inputs._make(t.float().contiguous() if f in PARAMETERS else t.to(dtype).contiguous()
                            for f, t in zip(inputs._fields, inputs))

    def recurrent_step(self, inputs: LinearInputs, state, state_slots):
        args = self._cast(inputs, kernel_dtype(out_dtype(inputs)))
        o = _OPS[inputs.family].recurrent_step(*args, state, state_slots)
        return o.to(out_dtype(inputs))

    def buffered_step(self, inputs: LinearInputs, state, state_slots, buf, slots, lengths, flush_at: int):
        args = self._cast(inputs, buf[0].dtype)
        o = _OPS[inputs.family].buffered_step(*args, state, state_slots, *buf, slots, lengths, flush_at)
        return o.to(out_dtype(inputs))

    def verify(self, inputs: LinearInputs, state, state_slots, buf, slots, lengths, flush_at: int = 0):
        args = self._cast(inputs, buf[0].dtype)
        o = _OPS[inputs.family].verify(*args, state, state_slots, *buf, slots, lengths, flush_at)
        return o.to(out_dtype(inputs))

    def recurrent_drafts(self, inputs: LinearInputs, state, state_slots, draft_states, draft_rows):
        args = self._cast(inputs, kernel_dtype(out_dtype(inputs)))
        o = _OPS[inputs.family].recurrent_drafts(*args, state, state_slots, draft_states, draft_rows)
        return o.to(out_dtype(inputs))

    def flush(self, family: str, state, state_slots, buf, slots, lengths) -> None:
        _OPS[family].flush(state, state_slots, *buf, slots, lengths)

    def prefill(self, inputs: LinearInputs, state, state_slots, buf, slots, fill: int, flush_at: int,
                fuse: bool = False):
        """The reference Backend's prompt contract on the kernels. A prompt that reaches no flush point
        (fill + T < C) runs as verify chunks; else (a) the fill buffered entries are flushed, (b) the chunked
        prefill folds each row's first T - r tokens (r = (fill + T) mod C) from its state, and (c) the last r
        become buffer entries 0 .. r-1 as verify chunks from fill 0. Without the chunked prefill kernel
        (no artifact, JIT off, head dims it does not take) the whole prompt runs as verify chunks."""
        T = getattr(inputs, inputs.output_like).shape[1]
        if fill + T < flush_at or not self._chunk_prefill_runs(inputs, state):
            return self.prefill_in_chunks(inputs, state, state_slots, buf, slots, fill, flush_at)
        if fill:
            self.flush(inputs.family, state, state_slots, buf, slots, torch.full_like(slots, fill))
        r = (fill + T) % flush_at
        o = self._fold_prompt(per_token(inputs, lambda t: t[:, :T - r]), state, state_slots, slots, buf[0].dtype,
                              fuse)
        if not r:
            return o
        tail = per_token(inputs, lambda t: t[:, T - r:])
        outs = self._verify_chunks(tail, state, state_slots, buf, slots, 0, flush_at)
        return torch.cat([o, *outs], 1).to(out_dtype(inputs))

    def prefill_in_chunks(self, inputs: LinearInputs, state, state_slots, buf, slots, fill: int, flush_at: int):
        """The reference Backend's verify chunks on the kernels, the outputs joined and cast back once."""
        outs = self._verify_chunks(inputs, state, state_slots, buf, slots, fill, flush_at)
        return (torch.cat(outs, 1) if len(outs) > 1 else outs[0]).to(out_dtype(inputs))

    def _verify_chunks(self, inputs: LinearInputs, state, state_slots, buf, slots, fill: int,
                       flush_at: int) -> list[torch.Tensor]:
        """Each verify chunk's outputs (B, take, Hv, V) in the buffer's dtype. One row's inputs are cast to
        that dtype once (a slice of its tokens is then contiguous as it is), several rows' per chunk (their
        slices would need copies again)."""
        dtype, op = buf[0].dtype, _OPS[inputs.family].verify
        whole = slots.shape[0] == 1
        args = self._cast(inputs, dtype) if whole else inputs
        outs, start, T = [], 0, getattr(inputs, inputs.output_like).shape[1]
        for take in prefill_plan(fill, T, flush_at, kernels=True):
            part = per_token(args, lambda t: t[:, start:start + take])
            part = part if whole else self._cast(part, dtype)
            outs.append(op(*part, state, state_slots, *buf, slots, torch.full_like(slots, fill), flush_at))
            fill, start = (fill + take) % flush_at, start + take
        return outs

    def _fold_prompt(self, inputs: LinearInputs, state, state_slots, slots, act_dtype: torch.dtype,
                     fuse: bool = False):
        """The chunked prefill of every row's P tokens from its state slot, packed (on CUDA: bf16 activations,
        fp32 gates; on the CPU: `act_dtype` and the state's dtype). GDN's front runs in torch first (with
        `fuse`, as one compiled region where its layout allows); Mamba-2's op takes the raw x and dt and does
        its front and D skip itself. Padding rows (slot -1, state slot -1: the engine's) start from zero,
        write no state and give zeros. Returns (B, P, Hv, V)."""
        like = getattr(inputs, inputs.output_like)
        B, P = like.shape[:2]
        act = torch.bfloat16 if state.is_cuda else act_dtype
        cu = torch.arange(0, (B + 1) * P, P, dtype=torch.int32, device=state.device)
        rows = state_slots.to(torch.int32)
        pack = lambda t, dtype=act: t.reshape(B * P, *t.shape[2:]).to(dtype).contiguous()  # noqa: E731
        if inputs.family == "gdn":
            real = slots >= 0  # a padding row's front makes its outputs zero (its q)
            front = regions.gdn_front_region(inputs.q, inputs.k, inputs.v, inputs.a, inputs.b, inputs.A_log,
                                             inputs.dt_bias, act, state.dtype, real) if fuse else None
            if front is None:
                q, k, g, beta = ref_gating.gdn_prompt_front(inputs.q, inputs.k, inputs.a, inputs.b, inputs.A_log,
                                                            inputs.dt_bias, act, state.dtype, real)
                front = q, k, pack(inputs.v), g, beta
            o = _OPS["gdn"].chunk_prefill(*front, cu, state, rows)
        else:  # a padding row's state slot is -1: the op gives it zeros
            param = lambda t: t.to(state.dtype).contiguous()  # noqa: E731  (fp32 already: no copy)
            o = launch.MAMBA2_OPS.chunk_prefill(pack(inputs.x), pack(inputs.dt, state.dtype), param(inputs.A_log),
                                     param(inputs.dt_bias), pack(inputs.B), pack(inputs.C), param(inputs.D), cu, state,
                                     rows)
        return o.view(like.shape).to(out_dtype(inputs))

    def _chunk_prefill_runs(self, inputs: LinearInputs, state) -> bool:
        """Whether the chunked prefill serves these inputs: on the CPU always (its op is the reference);
        on CUDA for head dims the templates take, when its kernel loads (an artifact, or JIT-compiled now;
        logged once per kernel if not, and the prompt runs as verify chunks)."""
        if not state.is_cuda:
            return True
        key_t, val_t = (inputs.k, inputs.v) if inputs.family == "gdn" else (inputs.B, inputs.x)
        if not prefill_kernels.fits(key_t.shape[-1], val_t.shape[-1]):
            return False
        key = launch.chunk_prefill_key(inputs.family, key_t, val_t)
        return _loads([key], key_t.shape[0], self.prefill_in_verify_chunks, "prompts run as verify chunks")

    def short_conv(self, x, conv_state, slots, weight, bias, phase: str):
        mode = "verify" if phase == "verify" else "advance"
        suits = x.dtype == conv_state.dtype and x.dtype in _CONV_DTYPES and weight.dtype in _CONV_DTYPES \
            and (bias is None or bias.dtype == weight.dtype)
        if not suits or not self._conv_kernel_loads(launch.conv_update_key(mode, x, conv_state, weight, bias, True),
                                                    x.shape[0]):
            return super().short_conv(x, conv_state, slots, weight, bias, phase)
        return launch.CONV_UPDATE(x, conv_state, slots.contiguous(), weight.contiguous(),
                                  None if bias is None else bias.contiguous(), mode)

    def conv_accept(self, conv_state, slots, accepted, width: int) -> None:
        if conv_state.dtype not in _CONV_DTYPES or \
                not self._conv_kernel_loads(launch.conv_accept_key(conv_state, width), slots.shape[0]):
            return super().conv_accept(conv_state, slots, accepted, width)
        launch.CONV_ACCEPT(conv_state, slots.to(torch.int32), accepted.to(torch.int32), int(width))

    def _conv_kernel_loads(self, key: KernelKey, batch: int) -> bool:
        """Whether the conv kernel for `key` is there (an artifact, or JIT-compiled now); logs once per
        key if not: without it the conv runs on the reference (the linear mixers keep their kernels).
        `kvbuffer tune --model ...` builds the conv's artifacts. Under torch.compile no lookup runs
        (its file reads would break the graph and send the whole forward back to eager): a key not
        known to be missing is taken to load, and if it does not, the op raises ArtifactError at the
        CUDA-graph warm-up, where the engine drops the compiled forward."""
        return _loads([key], batch, self.conv_on_reference, "the short conv runs on the reference ops")

    def attends_in_place(self, q, k_cache) -> bool:
        """Whether decode attention of q (B, T, H, D) over this cache runs on the kernel: CUDA, 1 .. 8
        new tokens, dtypes and head dims the kernels take, and the kernel pair (decode, combine)
        loads; a missing pair is built once into the artifact cache where that is possible
        (kvbuffer.kernels.autobuild), else the torch path is used (logged once per kernel)."""
        if not (q.is_cuda and 1 <= q.shape[1] <= ATTENTION_MAX_TOKENS and q.dtype in _CONV_DTYPES
                and k_cache.dtype in _CONV_DTYPES and q.shape[3] in ATTENTION_HEAD_DIMS
                and q.shape[2] % k_cache.shape[2] == 0):
            return False
        keys = [launch.attention_key(spec, q, k_cache) for spec in (specs.ATTENTION_DECODE, specs.ATTENTION_COMBINE)]
        missing = self.attention_on_window_path
        if not torch.compiler.is_compiling() and keys[0] not in missing and not lookup.jit_allowed():
            try:
                lookup.kernel_for(keys[0], q.shape[0])
            except ArtifactError:
                unbuilt = autobuild.ensure_attention_kernels(keys[0])
                if unbuilt is not None:
                    missing.update(keys)
                    log.info("kvbuffer: attention runs on the torch path (%s)", unbuilt)
        return _loads(keys, q.shape[0], missing, "attention runs on the torch path")

    def cache_attention(self, q, k_cache, v_cache, slots, cached, scale: float, context_len: int):
        """Attention of q's new tokens over each row's cache positions 0 .. cached + t (written already)."""
        return launch.ATTENTION_DECODE(q.contiguous(), k_cache, v_cache, slots.to(torch.int32),
                                       cached.to(torch.int32), float(scale), int(context_len))


def _loads(keys: list[KernelKey], batch: int, missing: set, fallback: str) -> bool:
    """Whether every kernel of `keys` is there (an artifact, or JIT-compiled now); a key that is not
    is remembered in `missing` (tried again only once JIT is on) and logged once with `fallback`.
    Under torch.compile no lookup runs: see KernelBackend._conv_kernel_loads."""
    if torch.compiler.is_compiling():
        return not any(key in missing for key in keys)
    if any(key in missing for key in keys) and not lookup.jit_allowed():
        return False
    try:
        for key in keys:
            lookup.kernel_for(key, batch)
        return True
    except ArtifactError as e:
        missing.update(keys)
        log.info("kvbuffer: %s (%s)", fallback, str(e).splitlines()[0])
        return False


Backend = Union[ReferenceBackend, KernelBackend]


# ----------------------------------------------------------------------------------------------
# choosing one when an LLM is built


def needed_kernels(spec, dtype: torch.dtype, mode: str) -> list[KernelKey]:
    """The linear kernels an engine with these caches launches (for probing the artifact cache); in
    kvbuffer mode without those of its unbuffered steps (unbuffered_kernels), which are optional."""
    step = decode_step_key(spec, dtype)
    family, dims, name = step.family, step.dims, step.in_dtype
    if mode == "recurrent":  # with drafts, the servers' verify: a state per fed token
        drafts = [KernelKey(family, "recurrent_drafts", dims, name, T=spec.max_drafts)] if spec.max_drafts > 1 else []
        return [KernelKey(family, "recurrent", dims, name)] + drafts
    cap, C = step.cap, step.C
    keys = [KernelKey(family, "buffered", dims, name, name, cap=cap, T=T, C=C) for T in (*PREFILL_CHUNKS, 1) if T <= C]
    if spec.max_drafts > 1:  # speculative verify, and the flush of buffers that accepted drafts past C
        keys.append(KernelKey(family, "buffered", dims, name, name, cap=cap, T=spec.max_drafts, C=0))
        keys.append(KernelKey(family, "flush", dims, "", name, cap=cap))
    return keys


def unbuffered_kernels(spec, dtype: torch.dtype) -> list[KernelKey]:
    """What a kvbuffer-mode decode step of few rows launches when it skips the buffer
    (kvbuffer.engine.runner): the flush of its rows' buffers and the recurrent step."""
    step = decode_step_key(spec, dtype)
    return [KernelKey(step.family, "flush", step.dims, "", step.in_dtype, cap=step.cap),
            KernelKey(step.family, "recurrent", step.dims, step.in_dtype)]


def decode_step_key(spec, dtype: torch.dtype) -> KernelKey:
    """The decode step's kernel: its head shape, dtype and buffer layout (C + max_drafts entries)
    name everything `kvbuffer tune` builds for this engine."""
    s = spec.linear_shape
    family = "gdn" if s.delta_rule else "mamba2"
    dims = (GDNDims if family == "gdn" else Mamba2Dims)(s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim)
    name = DTYPE_NAMES[kernel_dtype(dtype)]
    return KernelKey(family, "buffered", dims, name, name, cap=spec.chunk_size + spec.max_drafts, T=1,
                     C=spec.chunk_size)


def kernels_supported(spec) -> str | None:
    """Why the kernels cannot serve these head dims (None: they can)."""
    s = spec.linear_shape
    if s is None:
        return "the model has no linear-attention layers"
    if s.head_k_dim % 16 or s.head_v_dim % 16:
        return f"head dims {s.head_k_dim} x {s.head_v_dim} are not multiples of 16"
    return None


def resolve_backend(kernels, device: torch.device, spec, dtype: torch.dtype, mode: str) -> tuple[Backend, str]:
    """LLM(kernels=True | False | "auto") -> (the Backend, why it was chosen).

    "auto": the kernels on CUDA when the head dims suit them and every kernel the engine needs loads
    from the artifact cache, or may be compiled (kvbuffer.ops.allow_jit / KVBUFFER_JIT=1). Missing
    kernels are built into the artifact cache first where TileLang is installed
    (kvbuffer.kernels.autobuild); True raises if they can be neither loaded nor built. Logged. The
    chunked prefill is optional: built the same way when it alone is missing, else prompts run as
    verify chunks.
    """
    if kernels not in (True, False, "auto"):
        raise ValueError(f"kernels must be True, False or 'auto', got {kernels!r}")
    if kernels is False:
        return REFERENCE, "kernels=False"
    if not spec.num_linear_layers:
        return REFERENCE, "the model has no linear-attention layers"
    if kernels == "auto" and device.type != "cuda":
        return REFERENCE, f"the device is {device.type}"
    why = "the device is not CUDA" if device.type != "cuda" else kernels_supported(spec)
    if why is None and not lookup.jit_allowed() and _missing_artifact(spec, dtype, mode):
        step = decode_step_key(spec, dtype)
        unbuilt = autobuild.ensure_kernels(step, DTYPE_NAMES.get(dtype, step.in_dtype))
        why = unbuilt or _missing_artifact(spec, dtype, mode)
    if why is None:
        log.info("kvbuffer: linear layers run on the compiled kernels")
        if mode == "kvbuffer":
            _ensure_prefill_kernel(spec, dtype)
        return KernelBackend(), "compiled kernels"
    if kernels is True:
        raise ValueError(f"kernels=True, but {why}")
    log.info("kvbuffer: linear layers run on the reference ops: %s", why)
    return REFERENCE, why


def prefill_kernel(spec, dtype: torch.dtype) -> KernelKey | None:
    """The chunked prefill kvbuffer mode's prompts fold on (None: the head dims do not suit it). Optional:
    without it prompts run as verify chunks."""
    s = spec.linear_shape
    if not prefill_kernels.fits(s.head_k_dim, s.head_v_dim):
        return None
    step = decode_step_key(spec, dtype)
    return KernelKey(step.family, "chunk_prefill", step.dims, "bfloat16")


def _ensure_prefill_kernel(spec, dtype: torch.dtype) -> None:
    """Build the chunked prefill on first use where it is missing (an artifact cache from before it, JIT
    off), with the rest of the shape's set (which is reused); if it cannot be built, say so once."""
    key = prefill_kernel(spec, dtype)
    if key is None or lookup.jit_allowed() or missing_kernel([key]) is None:
        return
    step = decode_step_key(spec, dtype)
    unbuilt = autobuild.ensure_kernels(step, DTYPE_NAMES.get(dtype, step.in_dtype))
    if unbuilt is not None:
        log.info("kvbuffer: prompts run as verify chunks (%s)", unbuilt)


def _missing_artifact(spec, dtype, mode) -> str | None:
    return missing_kernel(needed_kernels(spec, dtype, mode))


def missing_kernel(keys: list[KernelKey]) -> str | None:
    """Why one of `keys` can neither be loaded nor JIT-compiled here (None: all of them can)."""
    for key in keys:
        try:
            lookup.kernel_for(key, 1)
        except ArtifactError as e:
            return f"no compiled kernel: {str(e).splitlines()[0]}"
    return None
