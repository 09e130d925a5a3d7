"""kvbuffer's kernels as torch custom ops (`torch.ops.kvbuffer.*`), for torch.compile and CUDA graphs.

    torch.ops.kvbuffer.gdn_recurrent_step(q, k, v, a, b, A_log, dt_bias, state, state_slots) -> o
    torch.ops.kvbuffer.gdn_buffered_step(q, k, v, a, b, A_log, dt_bias, state, state_slots,
                                         buf_k, buf_v, buf_g, buffer_slots, lengths, flush_at) -> o
    torch.ops.kvbuffer.gdn_verify(<as gdn_buffered_step, inputs (B, T, ...)>, flush_at) -> o (B, T, Hv, V)
    torch.ops.kvbuffer.gdn_flush(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    torch.ops.kvbuffer.gdn_recurrent_drafts(q, k, v, a, b, A_log, dt_bias, state, state_slots,
                                            draft_states, draft_rows) -> o (B, T, Hv, V)
    torch.ops.kvbuffer.mamba2_recurrent_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, z=None) -> y
    torch.ops.kvbuffer.mamba2_buffered_step / mamba2_verify / mamba2_flush / mamba2_recurrent_drafts  (the same)
    torch.ops.kvbuffer.gdn_chunk_prefill(q, k, v, g, beta, cu_seqlens, state, state_slots) -> o (N, Hv, V)
    torch.ops.kvbuffer.mamba2_chunk_prefill(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots,
                                            dt_min=0.0, dt_max=None) -> y (N, H, P)
    torch.ops.kvbuffer.conv1d_update(x, conv_state, slots, weight, bias=None, kind="advance", silu=True) -> out
    torch.ops.kvbuffer.conv1d_accept(conv_state, slots, accepted, width)
    torch.ops.kvbuffer.attention_decode(q, k_cache, v_cache, slots, cached, scale, context_len=0) -> out
    torch.ops.kvbuffer.gemv(x, weight) -> x (rows, K) . weight (N, K)^T, (rows, N)
    torch.ops.kvbuffer.gemv_experts(x, weight, expert) -> (S, J, N): x[s] . weight[expert[s, j]]^T
    torch.ops.kvbuffer.grouped_experts(x, weight, ends) -> (M, N): x[r] . weight[e(r)]^T, rows sorted by expert

Semantics, shapes and slot rules are kvbuffer.reference's (gdn / mamba2 / core / conv); `flush_at`
= C > 0 folds a row whose buffer reaches C entries with these tokens into its state in the same
call (the caller resets its length), 0 = no fused flush. Declared mutations: `state` and the three
buffer tensors (entries are written at lengths[b] ..; lengths are never changed); `conv_state`;
`draft_states` (the *_recurrent_drafts ops: today's servers' verify of T fed tokens, the state after
each token kept per draft row, `state` only read; the baseline kvbuffer's verify replaces).
conv1d_update's `kind` is the conv mode (torch's auto-functionalization reserves the name `mode`):
"advance" makes the last W - 1 inputs the history, "verify" stores the T drafts as pending;
conv1d_accept keeps the first accepted[b] drafts of each row. attention_decode reads the KV cache
(its T new tokens already written) and mutates nothing; context_len bounds the rows' positions on
the host (0: the cache's max_len) and only sets how the CUDA kernel splits them
(kvbuffer.kernels.attention). gemv is F.linear without a bias for a few rows (a forward of one
token): on CUDA a weight-streaming kernel, faster than torch's GEMM at that size. gemv_experts is
the same product through each row's chosen experts (weight (E, N, K), int64 ids (S, J)): a
mixture-of-experts layer at a few tokens, reading only the chosen experts' weights. grouped_experts
is torch._grouped_mm(x, weight.transpose(1, 2), offs=ends) for rows sorted by expert (int32 ends,
expert e's rows ending at ends[e]): the same layer at any token count (kvbuffer.reference.experts). The *_chunk_prefill ops run
the plain recurrence over each sequence of packed prompts (cu_seqlens (B + 1,)) from its state slot
(zero for -1), GDN's after its front, Mamba-2's from the raw x and dt with its front and D skip inside (a
sequence on slot -1 is padding there: zero outputs), and write each final state back (none for -1); they
mutate `state` (kvbuffer.kernels.prefill states the contract).

CPU: the pure-torch reference (with its checks). CUDA: kvbuffer.kernels.launch, which looks the
compiled kernel up (kvbuffer.kernels.lookup: artifact, else JIT when allowed, else ArtifactError)
and runs the validating launcher; during CUDA-graph capture the launch is direct. Every op has a
fake (meta) implementation for torch.compile and export. The checks that read no tensor data
(one device for every tensor, shapes, dtypes, parameter sizes, pools that alias) run in the fakes
and before every CUDA launch too, so a `meta` tensor among real ones is a DeviceError, never the
fake's uninitialised output. The op names and schemas are a public
interface: integrations build on them.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from ..checks import INDEX_DTYPES, check_expert_ends, check_expert_ids, check_same_device, check_slots, check_tensor, check_unique
from ..errors import BufferOverflowError
from ..reference import conv as ref_conv
from ..reference import core as ref_core
from ..reference import experts as ref_experts
from ..reference import gdn as ref_gdn
from ..reference import mamba2 as ref_mamba2
from . import launch, prefill
from .keys import CONV_UPDATE_KINDS


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet ops (CPU: the reference)


@torch.library.custom_op("kvbuffer::gdn_recurrent_step", mutates_args=("state",), device_types="cpu")
def gdn_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                       state_slots: torch.Tensor) -> torch.Tensor:
    """reference.gdn.recurrent_step: q, k (B, Hk, K), v (B, Hv, V), a, b (B, Hv) -> o (B, Hv, V)."""
    return ref_gdn.recurrent_step(q, k, v, a, b, A_log, dt_bias, state, state_slots)


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
    u = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731  (None: the reference names it)
    return _gdn_buffered_cpu(u(q), u(k), u(v), u(a), u(b), A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g,
                             buffer_slots, lengths, flush_at)[:, 0]


@torch.library.custom_op("kvbuffer::gdn_verify", mutates_args=_BUFFER_MUTATIONS, device_types="cpu")
def gdn_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
               buf_k: torch.Tensor, buf_v: torch.Tensor, buf_g: torch.Tensor, buffer_slots: torch.Tensor,
               lengths: torch.Tensor, flush_at: int = 0) -> torch.Tensor:
    """reference.gdn.verify of T tokens (inputs (B, T, ...)) -> o (B, T, Hv, V); flush_at > 0: a prefill chunk."""
    return _gdn_buffered_cpu(q, k, v, a, b, A_log, dt_bias, state, state_slots, buf_k, buf_v, buf_g,
                             buffer_slots, lengths, flush_at)


@torch.library.custom_op("kvbuffer::gdn_flush", mutates_args=("state",), device_types="cpu")
def gdn_flush(state: torch.Tensor, state_slots: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor,
              buf_g: torch.Tensor, buffer_slots: torch.Tensor, lengths: torch.Tensor) -> None:
    """reference.core.flush: fold each row's lengths[b] entries into its state."""
    ref_core.flush(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)


@torch.library.custom_op("kvbuffer::gdn_recurrent_drafts", mutates_args=("draft_states",), device_types="cpu")
def gdn_recurrent_drafts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
                         draft_states: torch.Tensor, draft_rows: torch.Tensor) -> torch.Tensor:
    """reference.gdn.recurrent_drafts: T tokens per row (inputs (B, T, ...)) -> o (B, T, Hv, V)."""
    return ref_gdn.recurrent_drafts(q, k, v, a, b, A_log, dt_bias, state, state_slots, draft_states, draft_rows)


# ----------------------------------------------------------------------------------------------
# Mamba-2 ops (G groups = key heads, H heads, N state size = K, P head dim = V)


@torch.library.custom_op("kvbuffer::mamba2_recurrent_step", mutates_args=("state",), device_types="cpu")
def mamba2_recurrent_step(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                          B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                          state_slots: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference.mamba2.recurrent_step: x (Bt, H, P), dt (Bt, H), B, C (Bt, G, N) -> y (Bt, H, P)."""
    return ref_mamba2.recurrent_step(x, dt, A_log, dt_bias, B, C, D, state, state_slots, z)


@torch.library.custom_op("kvbuffer::mamba2_recurrent_drafts", mutates_args=("draft_states",), device_types="cpu")
def mamba2_recurrent_drafts(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                            B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                            state_slots: torch.Tensor, draft_states: torch.Tensor, draft_rows: torch.Tensor,
                            z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference.mamba2.recurrent_drafts: T tokens per row (inputs (Bt, T, ...)) -> y (Bt, T, H, P)."""
    return ref_mamba2.recurrent_drafts(x, dt, A_log, dt_bias, B, C, D, state, state_slots, draft_states, draft_rows,
                                       z)


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


@torch.library.custom_op("kvbuffer::mamba2_verify", mutates_args=_BUFFER_MUTATIONS, device_types="cpu")
def mamba2_verify(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                  B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
                  buf_k: torch.Tensor, buf_v: torch.Tensor, buf_g: torch.Tensor, buffer_slots: torch.Tensor,
                  lengths: torch.Tensor, flush_at: int = 0, z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference.mamba2.verify of T tokens (inputs (Bt, T, ...)) -> y (Bt, T, H, P); flush_at > 0: a prefill chunk."""
    return _m2_buffered_cpu(x, dt, A_log, dt_bias, B, C, D, state, state_slots, buf_k, buf_v, buf_g, buffer_slots,
                            lengths, flush_at, z)


@torch.library.custom_op("kvbuffer::mamba2_flush", mutates_args=("state",), device_types="cpu")
def mamba2_flush(state: torch.Tensor, state_slots: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor,
                 buf_g: torch.Tensor, buffer_slots: torch.Tensor, lengths: torch.Tensor) -> None:
    """reference.mamba2.flush (the same fold as GDN's)."""
    ref_core.flush(state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)


# ----------------------------------------------------------------------------------------------
# the chunked prefill of packed prompts, after the families' fronts (kvbuffer.kernels.prefill)


@torch.library.custom_op("kvbuffer::gdn_chunk_prefill", mutates_args=("state",), device_types="cpu")
def gdn_chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      cu_seqlens: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor:
    """prefill.chunk_prefill_reference, delta rule: q, k (N, Hk, K) normalised (q scaled), v (N, Hv, V),
    g, beta (N, Hv) -> o (N, Hv, V); each sequence's final state written to its slot (none for -1)."""
    return prefill.chunk_prefill_reference(q, k, v, g, beta, cu_seqlens, state, state_slots)


@torch.library.custom_op("kvbuffer::mamba2_chunk_prefill", mutates_args=("state",), device_types="cpu")
def mamba2_chunk_prefill(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                         B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, cu_seqlens: torch.Tensor,
                         state: torch.Tensor, state_slots: torch.Tensor, dt_min: float = 0.0,
                         dt_max: Optional[float] = None) -> torch.Tensor:
    """prefill.mamba2_chunk_prefill_reference: raw x (N, H, P), dt (N, H), B, C (N, G, N_state), A_log, dt_bias,
    D (H,) -> y (N, H, P) with the D skip, before the gate; final states written as gdn_chunk_prefill's."""
    return prefill.mamba2_chunk_prefill_reference(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots,
                                                  dt_min, dt_max)


# ----------------------------------------------------------------------------------------------
# the checks that read no tensor data: run by the fakes and before every CUDA launch


def _meta_checks(name: str, args: dict) -> None:
    """Devices, shapes, dtypes, parameter sizes and pool aliasing of one call of op `name`.

    A fake (meta) implementation cannot read slots or fills, but it must still refuse what the
    real op refuses: a `meta` slots tensor among CPU ones routes the call here, and returning
    empty memory for it would be a silently wrong result.
    """
    check_same_device(args)
    if name == "gdn_chunk_prefill":
        return prefill.check_shapes(*(args[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "state",
                                                      "state_slots")), delta_rule=True)
    if name == "mamba2_chunk_prefill":
        return prefill.check_mamba2_shapes(**args)
    state = args["state"]
    if name.endswith("flush"):
        ref_core.check_flush_shapes(state, args["buf_k"], args["buf_v"], args["buf_g"])
        batch = args["buffer_slots"]
    else:
        if name.startswith("gdn"):
            ref_gdn.check_gates(state, args["v"], args["a"], args["b"], args["A_log"], args["dt_bias"])
            q, k, v, g = args["q"], args["k"], args["v"], args["a"]
        else:
            ref_mamba2.check_gates(state, args["x"], args["dt"], args["A_log"], args["dt_bias"], args["B"],
                                   args["C"], args["D"], args.get("z"))
            q, k, v, g = args["C"], args["B"], args["x"], args["dt"]
        buffers = None if "recurrent" in name else (args["buf_k"], args["buf_v"], args["buf_g"])
        with_time = name.endswith(("verify", "drafts"))
        ref_core.check_shapes(q, k, v, g, None, state, buffers, with_time=with_time)
        batch = q
        if name.endswith("drafts"):
            ref_core.check_draft_states(args["draft_states"], args["draft_rows"], state, q.shape[0], q.shape[1],
                                        values=False)
    check_tensor("state_slots", args["state_slots"], (batch.shape[0],), INDEX_DTYPES)
    for rows in ("buffer_slots", "lengths"):
        if rows in args:
            check_tensor(rows, args[rows], (batch.shape[0],), INDEX_DTYPES)


def _fake(name: str, output: str | None):
    """The fake of op `name`: the metadata checks, then an empty tensor shaped like `output`."""
    def fake(*args, **kwargs):
        bound = _bind(name, args, kwargs)
        _meta_checks(name, bound)
        return None if output is None else torch.empty_like(bound[output])
    return fake


# ----------------------------------------------------------------------------------------------
# CUDA: the kernel layer's launches (validated; direct under CUDA-graph capture)

_BY_NAME = {
    "gdn_recurrent_step": gdn_recurrent_step, "gdn_buffered_step": gdn_buffered_step, "gdn_verify": gdn_verify,
    "gdn_flush": gdn_flush, "gdn_recurrent_drafts": gdn_recurrent_drafts,
    "mamba2_recurrent_step": mamba2_recurrent_step, "mamba2_buffered_step": mamba2_buffered_step,
    "mamba2_verify": mamba2_verify, "mamba2_flush": mamba2_flush, "mamba2_recurrent_drafts": mamba2_recurrent_drafts,
    "gdn_chunk_prefill": gdn_chunk_prefill, "mamba2_chunk_prefill": mamba2_chunk_prefill,
}
_OUTPUTS = {name: ("x" if name.startswith("mamba2") else "v") for name in _BY_NAME}
_OUTPUTS.update(gdn_flush=None, mamba2_flush=None)
_PARAMS = {name: tuple(inspect.signature(op._init_fn).parameters.values()) for name, op in _BY_NAME.items()}


def _bind(name: str, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, defaults included (a zip over the schema: cheap per call)."""
    bound = {p.name: p.default for p in _PARAMS[name][len(args):]}
    bound.update(zip((p.name for p in _PARAMS[name]), args))
    bound.update(kwargs)
    return bound


def _checked_launch(name: str):
    """The CUDA implementation of op `name`: the metadata checks (no device reads), then the launch."""
    launch_fn = launch.CUDA_LAUNCHES[name]

    def cuda_impl(*args, **kwargs):
        _meta_checks(name, _bind(name, args, kwargs))
        return launch_fn(*args, **kwargs)
    return cuda_impl


for _name, _op in _BY_NAME.items():
    _op.register_fake(_fake(_name, _OUTPUTS[_name]))
    _op.register_kernel("cuda")(_checked_launch(_name))
