"""The engine's compiled-kernel backend: kvbuffer.reference.gdn / .mamba2's signatures on torch.ops.kvbuffer.

mixing.py calls `recurrent_step`, `buffered_step`, `verify` and `prefill` of either the reference
module or one of the objects here, with the same arguments. These cast the activations to the
kernels' dtype (the buffer's: bf16 unless the model is fp16) and the layer parameters to fp32, make
them contiguous (the model's projections are split views), call the custom op, and cast the output
back. The engine cuts prompts into chunks of PREFILL_CHUNKS tokens that never cross a flush boundary;
the chunk that fills a buffer folds it into the state in the same launch.
"""

from __future__ import annotations

import logging

import torch

from .. import ops
from ..reference import gdn as ref_gdn
from ..reference import mamba2 as ref_mamba2

log = logging.getLogger("kvbuffer")

PREFILL_CHUNKS = (8, 4, 2, 1)  # the prompt-chunk lengths the engine feeds the kernels, which tune builds


def kernel_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Activations and buffer entries on the kernels: the model's bf16/fp16, else bf16."""
    return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


class KernelOps:
    """One family's ops on the custom ops; `acts` / `params` index the activations / fp32 parameters."""

    def __init__(self, family: str, acts: tuple[int, ...], params: tuple[int, ...], out_like: int):
        self.family, self.acts, self.params, self.out_like = family, acts, params, out_like
        self.width = len(acts) + len(params)  # arguments before the state

    def _op(self, name: str):
        return getattr(torch.ops.kvbuffer, f"{self.family}_{name}")

    def _front(self, front, dtype) -> list:
        front = list(front)
        for i in self.acts:
            front[i] = front[i].to(dtype).contiguous()
        for i in self.params:
            front[i] = front[i].float().contiguous()
        return front

    def recurrent_step(self, *args):
        front, (state, state_slots) = args[:self.width], args[self.width:]
        dtype = kernel_dtype(front[self.out_like].dtype)
        o = self._op("recurrent_step")(*self._front(front, dtype), state, state_slots)
        return o.to(front[self.out_like].dtype)

    def _buffered(self, name, args, *extra):
        front, pools = args[:self.width], args[self.width:self.width + 7]
        o = self._op(name)(*self._front(front, pools[2].dtype), *pools, *extra)
        return o.to(front[self.out_like].dtype)

    def buffered_step(self, *args, flush_at=0):
        return self._buffered("buffered_step", args, flush_at)

    def verify(self, *args, flush_at=0):
        """T tokens per row; with flush_at, a prompt chunk (T in PREFILL_CHUNKS) that folds the
        buffers it fills in the same launch."""
        return self._buffered("verify", args, flush_at)


GDN = KernelOps("gdn", acts=(0, 1, 2, 3, 4), params=(5, 6), out_like=2)        # q k v a b | A_log dt_bias
MAMBA2 = KernelOps("mamba2", acts=(0, 1, 4, 5), params=(2, 3, 6), out_like=0)  # x dt B C | A_log dt_bias D
_BY_REFERENCE = {ref_gdn: GDN, ref_mamba2: MAMBA2}


def compiled(reference_module) -> KernelOps:
    """The kernel-backed counterpart of kvbuffer.reference.gdn or .mamba2."""
    return _BY_REFERENCE[reference_module]


def needed_kernels(spec, dtype: torch.dtype, mode: str) -> list[ops.KernelKey]:
    """The kernels an engine with these caches launches (for probing the artifact cache)."""
    s = spec.linear_shape
    family = "gdn" if s.delta_rule else "mamba2"
    dims = (s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim)
    name = ops._DTYPE_NAMES[kernel_dtype(dtype)]
    if mode == "recurrent":
        return [ops.KernelKey(family, "recurrent", *dims, name, "")]
    cap, C = spec.chunk_size + spec.max_drafts, spec.chunk_size
    keys = [ops.KernelKey(family, "buffered", *dims, name, name, cap, T, C) for T in PREFILL_CHUNKS if T <= C]
    if spec.max_drafts > 1:  # speculative verify, and the flush of buffers that accepted drafts past C
        keys.append(ops.KernelKey(family, "buffered", *dims, name, name, cap, spec.max_drafts, 0))
        keys.append(ops.KernelKey(family, "flush", *dims, "", name, cap))
    return keys


def kernels_supported(spec) -> str | None:
    """Why the kernels cannot serve these head dims (None: they can)."""
    s = spec.linear_shape
    if s is None:
        return "the model has no linear-attention layers"
    if s.head_k_dim % 16 or s.head_v_dim % 16:
        return f"head dims {s.head_k_dim} x {s.head_v_dim} are not multiples of 16"
    return None


def resolve(kernels, device: torch.device, spec, dtype: torch.dtype, mode: str) -> tuple[bool, str]:
    """LLM(kernels=True | False | "auto") -> (whether the linear layers run on compiled kernels, why).

    "auto": on CUDA when the head dims suit the kernels and every kernel the engine needs loads from
    the artifact cache, or may be compiled (kvbuffer.ops.jit_allowed()). The choice is logged.
    """
    if kernels not in (True, False, "auto"):
        raise ValueError(f"kernels must be True, False or 'auto', got {kernels!r}")
    if kernels is False:
        return False, "kernels=False"
    why = "the device is not CUDA" if device.type != "cuda" else kernels_supported(spec)
    if why is None and kernels == "auto" and not ops.jit_allowed():
        why = _missing_artifact(spec, dtype, mode)
    if why is None:
        log.info("kvbuffer: linear layers run on the compiled kernels (kvbuffer.ops)")
        return True, "compiled kernels"
    if kernels is True:
        raise ValueError(f"kernels=True, but {why}")
    log.info("kvbuffer: linear layers run on the reference ops: %s", why)
    return False, why


def _missing_artifact(spec, dtype, mode) -> str | None:
    from ..errors import ArtifactError

    for key in needed_kernels(spec, dtype, mode):
        try:
            ops.kernel_for(key, 1)
        except ArtifactError as e:
            return f"no compiled kernel and no JIT: {str(e).splitlines()[0]}"
    return None


# ----------------------------------------------------------------------------------------------
# the short conv (kvbuffer.conv_ops): compiled when its kernel loads, else the reference conv

_CONV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CONV_ON_REFERENCE: set = set()  # conv kernel keys that did not load: the reference until JIT is allowed


def conv_on_reference() -> list:
    """The conv kernel keys this process runs on the reference conv (their kernel did not load)."""
    return sorted(_CONV_ON_REFERENCE, key=repr)


def _conv_kernel_loads(key, batch: int) -> bool:
    """Whether the conv kernel for `key` is there (an artifact, or JIT-compiled now); logs once per key
    if not: without it the engine keeps the torch reference conv (the linear mixers still run on their
    kernels). `kvbuffer tune --model ...` builds the conv's artifacts."""
    from .. import conv_ops
    from ..errors import ArtifactError

    if key in _CONV_ON_REFERENCE and not ops.jit_allowed():
        return False
    try:
        conv_ops.kernel_for(key, batch)
        return True
    except ArtifactError as e:
        _CONV_ON_REFERENCE.add(key)
        log.info("kvbuffer: the short conv runs on the reference ops (%s)", str(e).splitlines()[0])
        return False


def conv_update(x, conv_state, slots, weight, bias, kind: str):
    """torch.ops.kvbuffer.conv1d_update for the engine's rows (SiLU), or None when its kernel is not
    there or the dtypes do not suit it (x and the pool one dtype; weight and bias one dtype)."""
    from .. import conv_ops

    if x.dtype != conv_state.dtype or x.dtype not in _CONV_DTYPES or weight.dtype not in _CONV_DTYPES \
            or (bias is not None and bias.dtype != weight.dtype):
        return None
    if not _conv_kernel_loads(conv_ops.update_key(kind, x, conv_state, weight, bias, True), x.shape[0]):
        return None
    return torch.ops.kvbuffer.conv1d_update(x.contiguous(), conv_state, slots.contiguous(), weight.contiguous(),
                                            None if bias is None else bias.contiguous(), kind)


def conv_accept(conv_state, slots, accepted, width: int) -> bool:
    """torch.ops.kvbuffer.conv1d_accept (int32 counts) if its kernel is there; False: call the reference."""
    from .. import conv_ops

    if conv_state.dtype not in _CONV_DTYPES or \
            not _conv_kernel_loads(conv_ops.accept_key(conv_state, width), slots.shape[0]):
        return False
    torch.ops.kvbuffer.conv1d_accept(conv_state, slots.to(torch.int32), accepted.to(torch.int32), int(width))
    return True
