"""The servers' ReplaySSM kernels inside kvbuffer's engine: the `replayssm` mode of `kvbuffer bench decode|spec`.

ReplaySSMBackend runs a kvbuffer engine's linear layers on the kernels a server user gets
(kvbuffer.bench.replayssm.MODULES), in the server's own cache layout, in place, compiled and
CUDA-graphed like the engine's other modes; the conv, attention and projections stay the engine's
(the projections on torch's GEMM, as the servers' run):

- Gated DeltaNet (SGLang 0.5.23): value-major checkpoints [slots, HV, V, K] fp32; decode rings d
  [slots, HV, L, V], k [slots, H, L, K] (`ring_dtype`: fp32, SGLang's default, or bf16), g [slots,
  HV, L] fp32, keyed by state slot; each decode step is `fused_recurrent_linear_replayssm_decode`.
  With drafts, its speculative layout instead: bf16 rings d, k with their low parts and fp32 g,
  keyed by request slot with the request-keyed cursors (write_pos, cache_base, is_flush); a verify
  is `gdn_replayssm_spec_decode(launch_mode="verify")`, and the commit of the accepted counts is
  `commit_gdn_replayssm_spec` then `commit_gdn_replayssm_circular` (which folds the rows at
  capacity, every layer in one launch), as its speculative worker runs them.
- Mamba-2 (vLLM 0.33.0): value-major checkpoints [slots, H, P, N] fp32; rings x [slots, H, L, P] and
  B [slots, G, L, N] bf16, dt [slots, H, L] fp32; each decode step is
  `selective_state_update_replayssm_output_only` (A, dt, dt_bias, D tied over the head dim). vLLM
  has no ReplaySSM verify for Mamba-2: a speculative engine is refused (REPLAY_VERIFY).

L is the engine's chunk size. The decode cursor (write_pos, and vLLM's is_flush at L - 1) is the
engine's buffer fill, the context length mod L, which reaches the device with the step's inputs:
the count SGLang advances on the device and vLLM's metadata builds, with no host sync per step.
The engine runs in kvbuffer mode (its phases reach the Backend apart; its buffer pool is allocated
but unused) with no unbuffered steps; the checkpoints are its state pool, each slot's memory read
value-major. Every request needs its state from admission: prompts of at least L tokens.

The prefill is not the peer's: a prompt runs kvbuffer's prefill path (the chunked prefill and a
flush of its remainder) on the rows' checkpoints transposed to key-major, then written back
value-major, every ring entry zeroed (an update that replays as the identity) and the cursors at
the prompt's length mod L (decode; so rows fold at staggered steps, as a server's requests that
arrived at different times) or 0 (speculative). Under torch.compile each step or verify is one
custom op (kvbuffer_bench::replayssm_*), the kernels' argument glue fused around it.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from ..pools import LinearLayerShape
from ..rows import put_rows
from . import replayssm

RING_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MIN_VERIFY_RING = 16  # SGLang's commit: a tl.dot over the ring's entries, which Triton compiles for 16 or more
DECODE = {"gdn": "sglang_step", "mamba2": "vllm_step"}  # replayssm.MODULES' entry per family
REPLAY_VERIFY = {"gdn": "sglang_spec", "mamba2": None}
NO_VERIFY = ("vLLM 0.33.0 ships no ReplaySSM verify for Mamba-2 (its one ReplaySSM kernel, "
             "selective_state_update_replayssm_output_only, steps one token): no speculative replayssm rows")
NULL = -1  # the null block id passed to the kernels: the engine's padding rows carry slot -1


def family_of(shape: LinearLayerShape) -> str:
    return "gdn" if shape.delta_rule else "mamba2"


def unsupported(shape: LinearLayerShape | None, chunk_size: int, fed: int) -> str | None:
    """Why the servers' kernels cannot serve these heads, ring length (the chunk size) and tokens per
    verify (`fed`: 1 + drafts; 1 without speculation); None: they can."""
    if shape is None:
        return "the model has no linear-attention layers"
    family = family_of(shape)
    if fed > 1 and REPLAY_VERIFY[family] is None:
        return NO_VERIFY
    if family == "gdn":
        K = shape.head_k_dim
        if K & (K - 1) or K < 32:
            return f"SGLang's ReplaySSM kernels need a power-of-two head_k_dim >= 32 (2 K tiles of 16), got {K}"
        if fed > 1 and (chunk_size & (chunk_size - 1) or chunk_size < max(2 * fed, MIN_VERIFY_RING)):
            return (f"SGLang's verify ring needs a power-of-two length >= 2 x {fed} tokens per verify and >= "
                    f"{MIN_VERIFY_RING} (its commit folds the ring in one tl.dot), got chunk_size {chunk_size}")
    return None


def load_kernels(family: str, fed: int) -> tuple[dict | None, str]:
    """({name: function} the mode calls for `family` (its verify and commit where fed > 1), or None,
    and one line saying where they came from or why not)."""
    kind = DECODE[family] if fed == 1 else REPLAY_VERIFY[family]
    if kind is None:
        return None, NO_VERIFY
    return replayssm.load(kind)


@dataclass(frozen=True)
class ReplayLayout:
    """The server's per-layer caches beside the checkpoints: what ReplayCaches allocates, for planning."""

    shape: LinearLayerShape
    layers: int
    states: int  # state slots (decode rings are keyed by them)
    requests: int  # request slots (the speculative rings and cursors are keyed by them)
    L: int
    fed: int = 1  # tokens per verify; 1: the decode layout
    ring_dtype: torch.dtype = torch.float32  # GDN decode rings (the speculative rings are bf16)

    def tensor_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every tensor ReplayCaches holds."""
        s, n, L = self.shape, self.layers, self.L
        f32, bf16, i32 = torch.float32, torch.bfloat16, torch.int32
        if not s.delta_rule:  # vLLM: x, B bf16, dt fp32, keyed by state slot
            return {"x_ring": ((n, self.states, s.num_v_heads, L, s.head_v_dim), bf16),
                    "dt_ring": ((n, self.states, s.num_v_heads, L), f32),
                    "B_ring": ((n, self.states, s.num_k_heads, L, s.head_k_dim), bf16)}
        if self.fed == 1:
            return {"d_ring": ((n, self.states, s.num_v_heads, L, s.head_v_dim), self.ring_dtype),
                    "k_ring": ((n, self.states, s.num_k_heads, L, s.head_k_dim), self.ring_dtype),
                    "g_ring": ((n, self.states, s.num_v_heads, L), f32),
                    "force_flush": ((self.requests,), i32)}
        r = self.requests
        return {"d_ring": ((n, r, s.num_v_heads, L, s.head_v_dim), bf16),
                "d_low": ((n, r, s.num_v_heads, L, s.head_v_dim), bf16),
                "k_ring": ((n, r, s.num_k_heads, L, s.head_k_dim), bf16),
                "k_low": ((n, r, s.num_k_heads, L, s.head_k_dim), bf16),
                "g_ring": ((n, r, s.num_v_heads, L), f32),
                "write_pos": ((r,), i32), "cache_base": ((r,), i32), "is_flush": ((r,), torch.int8),
                "state_of": ((r + 1,), i32)}  # request slot -> state slot, and a sink for padding rows

    def nbytes(self) -> dict[str, int]:
        return {name: _numel(shape) * dtype.itemsize for name, (shape, dtype) in self.tensor_shapes().items()}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def request_nbytes(shape: LinearLayerShape, layers: int, L: int, fed: int, ring_dtype=torch.float32) -> int:
    """Ring and cursor bytes of one request (one state and one request slot)."""
    return sum(ReplayLayout(shape, layers, 1, 1, L, fed, ring_dtype).nbytes().values())


class ReplayCaches:
    """The tensors of a ReplayLayout, zeroed (a cursor of 0 and rings whose entries replay as the identity)."""

    def __init__(self, layout: ReplayLayout, device):
        self.layout = layout
        for name, (shape, dtype) in layout.tensor_shapes().items():
            setattr(self, name, torch.zeros(shape, dtype=dtype, device=device))
        if hasattr(self, "state_of"):
            self.state_of.fill_(NULL)

    def rings(self) -> list[torch.Tensor]:
        """Every per-layer ring tensor (layers, slots, ...)."""
        return [t for name, t in vars(self).items() if name.endswith(("_ring", "_low"))]


_BACKENDS: dict[int, "ReplaySSMBackend"] = {}  # ReplaySSMBackend.key -> backend, for its custom ops
_KEYS = itertools.count()


class ReplaySSMBackend:
    """The engine's Backend for the replayssm mode: the servers' step, verify and commit on their own
    layout; conv, attention and the prefill's kvbuffer path delegated to `base` (the Backend the LLM
    resolved). `states` is the engine's state pool tensor (layers, slots, Hv, K, V); `convs` its conv
    pool (its layer 0 marks a commit's first layer); `kernels` from load_kernels."""

    name = "replayssm"

    def __init__(self, base, states: torch.Tensor, convs, caches: ReplayCaches, kernels: dict):
        self.base, self.states, self.convs, self.caches, self.fns = base, states, convs, caches, kernels
        layout = caches.layout
        self.family, self.L, self.fed = family_of(layout.shape), layout.L, layout.fed
        self.key = next(_KEYS)  # a plain int: the compiled step passes it as a constant
        _BACKENDS[self.key] = self
        weakref.finalize(self, _BACKENDS.pop, self.key, None)

    @property
    def kernels(self) -> bool:
        return self.base.kernels

    # the server's kernels ------------------------------------------------------------------------
    def buffered_step(self, inputs, state, state_slots, buf, slots, lengths, flush_at: int):
        """One decode token per row on the server's step kernel; `lengths` (the engine's fill) is the cursor."""
        if self.fed > 1:
            raise ValueError("replayssm: a speculative engine keeps SGLang's verify layout; its plain decode steps "
                             "are not run (build it without disable_above_batch)")
        o = replayssm_step(self.key, _step_args(inputs), state, state_slots.to(torch.int32), lengths.to(torch.int32))
        return (o[:, 0] if self.family == "gdn" else o).to(_out_dtype(inputs))

    def verify(self, inputs, state, state_slots, buf, slots, lengths, flush_at: int = 0):
        """1 + drafts tokens per row on SGLang's verify (nothing committed: see conv_accept)."""
        if self.fed == 1:
            raise ValueError("replayssm: this engine has no speculative layout (it was built without drafts)")
        B, T = inputs.q.shape[:2]
        args = [t.flatten(0, 1).contiguous() for t in inputs[:5]] + [inputs.A_log.float(), inputs.dt_bias.float()]
        o = replayssm_verify(self.key, args, state, state_slots.to(torch.int32), slots.to(torch.int32))
        return o.view(B, T, *o.shape[1:]).to(_out_dtype(inputs))

    def conv_accept(self, conv_state, slots, accepted, width: int) -> None:
        """The engine's commit, per layer: the conv histories keep the accepted inputs; at its first
        layer, SGLang's commit of the accepted counts (cursors, then the fold of rows at capacity, every
        layer in one launch). Eager (the runner commits outside the compiled forward)."""
        self.base.conv_accept(conv_state, slots, accepted, width)
        if self.fed > 1 and conv_state.data_ptr() == self.convs.layer(0).data_ptr():
            self._commit(slots.to(torch.int32), accepted.to(torch.int32))

    def flush(self, family: str, state, state_slots, buf, slots, lengths) -> None:
        """Nothing: the engine's books fold a buffer at C; the server's kernels fold their own rings."""

    def recurrent_step(self, *args, **kwargs):
        raise ValueError("replayssm runs the engine in kvbuffer mode; its Backend has no recurrent step")

    recurrent_drafts = recurrent_step

    # the engine's own parts ----------------------------------------------------------------------
    def short_conv(self, *args, **kwargs):
        return self.base.short_conv(*args, **kwargs)

    def attends_in_place(self, *args, **kwargs):
        return self.base.attends_in_place(*args, **kwargs)

    def cache_attention(self, *args, **kwargs):
        return self.base.cache_attention(*args, **kwargs)

    def prefill(self, inputs, state, state_slots, buf, slots, fill: int, flush_at: int, fuse: bool = False):
        """kvbuffer's prefill of every row's whole prompt piece into its checkpoint (the module's
        docstring); the engine's buffers serve as scratch. Capturable: nothing is read back."""
        B, T = getattr(inputs, inputs.output_like).shape[:2]
        kept = state_slots >= 0  # padding rows (and prompts too short for a state: refused) write nothing
        rows = torch.where(kept, torch.arange(B, dtype=torch.int32, device=slots.device), NULL)
        at = state_slots.clamp(min=0).long()
        major = _value_major(state)
        scratch = major[at].transpose(-1, -2).contiguous()  # (B, Hv, K, V): kvbuffer's layout
        o = self.base.prefill(inputs, scratch, rows, buf, slots, 0, flush_at, fuse)
        if T % flush_at:  # the remainder buffered by the prefill: folded too
            self.base.flush(inputs.family, scratch, rows, buf, slots, torch.full_like(slots, T % flush_at))
        put_rows(major, (at,), scratch.transpose(-1, -2), kept)
        self._empty_rings(self._layer(state), state_slots, slots, kept)
        return o

    # helpers -------------------------------------------------------------------------------------
    def _layer(self, state: torch.Tensor) -> int:
        """The layer whose state pool view `state` is (its place in the engine's pool)."""
        step = self.states.stride(0) * self.states.element_size()
        layer, rest = divmod(state.data_ptr() - self.states.data_ptr(), step)
        if rest or not 0 <= layer < self.states.shape[0] or state.shape != self.states.shape[1:]:
            raise ValueError("replayssm: the state passed is not a layer of the engine's state pool")
        return layer

    def _empty_rings(self, layer: int, state_slots, slots, kept) -> None:
        """The kept rows' ring entries zeroed in `layer`; speculative cursors to 0 (decode: the engine's fill)."""
        keyed = slots if self.fed > 1 and self.family == "gdn" else state_slots
        at = keyed.clamp(min=0).long()
        for ring in self.caches.rings():
            put_rows(ring[layer], (at,), torch.zeros((at.shape[0], *ring.shape[2:]), dtype=ring.dtype,
                                                     device=ring.device), kept)
        if self.fed > 1:
            for name in ("write_pos", "cache_base", "is_flush"):
                t = getattr(self.caches, name)
                put_rows(t, (at,), torch.zeros(at.shape, dtype=t.dtype, device=t.device), kept)

    def _step(self, args: list[torch.Tensor], state, state_slots, lengths) -> torch.Tensor:
        layer, c = self._layer(state), self.caches
        if self.family == "gdn":
            mixed_qkv, a, b, A_log, dt_bias = args
            B = mixed_qkv.shape[0]
            major = _value_major(state)
            out = torch.empty(B, 1, major.shape[1], major.shape[2], dtype=mixed_qkv.dtype, device=state.device)
            self.fns["fused_recurrent_linear_replayssm_decode"](
                mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=major.shape[-1] ** -0.5,
                initial_state=major, d_cache=c.d_ring[layer], k_cache=c.k_ring[layer], g_cache=c.g_ring[layer],
                out=out, ssm_state_indices=state_slots, write_pos=lengths, force_flush=c.force_flush[:B],
                use_qk_l2norm_in_kernel=True)
            return out
        x, dt, A, Bm, Cm, D, dt_bias = args
        major = _value_major(state)
        H, P, N = major.shape[1:]
        out = torch.zeros_like(x)  # vLLM writes nothing for a padding row
        bc_pre = torch.empty(x.shape[0], Bm.shape[1], self.L, device=state.device)
        self.fns["selective_state_update_replayssm_output_only"](
            major, x=x, dt=dt[..., None].expand(*dt.shape, P), A=A[:, None, None].expand(H, P, N), B=Bm, C=Cm,
            D=D[:, None].expand(H, P), dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True, x_cache=c.x_ring[layer],
            dt_cache=c.dt_ring[layer], B_cache=c.B_ring[layer], bc_pre=bc_pre, write_pos=lengths,
            is_flush=(lengths == self.L - 1).to(torch.int8), max_cache_len=self.L, state_batch_indices=state_slots,
            null_block_id=NULL, out=out)
        return out

    def _verify(self, args: list[torch.Tensor], state, state_slots, slots) -> torch.Tensor:
        layer, c = self._layer(state), self.caches
        q, k, v, a, b, A_log, dt_bias = args
        B = slots.shape[0]
        T = q.shape[0] // B
        major = _value_major(state)
        c.state_of[torch.where(slots >= 0, slots, -1).long()] = torch.where(slots >= 0, state_slots, NULL)
        out = torch.empty_like(v)
        starts = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=q.device)
        self.fns["gdn_replayssm_spec_decode"](
            q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, checkpoint_state=major, d_cache=c.d_ring[layer],
            k_cache=c.k_ring[layer], g_cache=c.g_ring[layer], rawv_cache=c.d_low[layer], rawk_cache=c.k_low[layer],
            beta_cache=None, out=out, query_start_loc=starts, ssm_state_indices=state_slots, replay_indices=slots,
            write_pos=c.write_pos, cache_base=c.cache_base, is_flush=c.is_flush, max_cache_len=self.L,
            max_spec_len=self.fed, scale=major.shape[-1] ** -0.5, use_qk_l2norm_in_kernel=True, null_block_id=NULL,
            launch_mode="verify")
        return out

    def _commit(self, slots, accepted) -> None:
        c = self.caches
        self.fns["commit_gdn_replayssm_spec"](
            write_pos=c.write_pos, cache_base=c.cache_base, is_flush=c.is_flush, num_accepted=accepted,
            replay_indices=slots, max_cache_len=self.L, max_spec_len=self.fed, fold_every_commit=False,
            null_block_id=NULL)
        state_slots = torch.where(slots >= 0, c.state_of[slots.long()], NULL)
        self.fns["commit_gdn_replayssm_circular"](
            checkpoint_state=_value_major(self.states), d_cache=c.d_ring, k_cache=c.k_ring, g_cache=c.g_ring,
            d_residual_cache=c.d_low, k_residual_cache=c.k_low, state_batch_indices=state_slots,
            replay_indices=slots, write_pos=c.write_pos, cache_base=c.cache_base, is_flush=c.is_flush,
            accept_lens=accepted, mamba_track_indices=None, mamba_steps_to_track=None, null_block_id=NULL)


def _value_major(state: torch.Tensor) -> torch.Tensor:
    """A state pool's memory (..., Hv, K, V) read as the servers' value-major (..., Hv, V, K) (never a copy)."""
    return state.view(*state.shape[:-2], state.shape[-1], state.shape[-2])


def _out_dtype(inputs) -> torch.dtype:
    return getattr(inputs, inputs.output_like).dtype


def _step_args(inputs) -> list[torch.Tensor]:
    """The server's step arguments from one token's inputs, made outside its custom op (compiled: fused
    glue). GDN: SGLang's packed mixed_qkv, a, b, fp32 A_log, dt_bias. Mamba-2: x, dt, A = -exp(A_log),
    B, C, D, dt_bias, which the op ties over the head dim (stride-0 broadcasts, as MambaMixer2's: a
    custom op's arguments arrive with their broadcasts materialised)."""
    if inputs.family == "gdn":
        q, k, v, a, b = inputs[:5]  # one token: (B, H, D) and (B, Hv)
        mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1).contiguous()
        return [mixed, a.contiguous(), b.contiguous(), inputs.A_log.float(), inputs.dt_bias.float()]
    x, dt, A_log, dt_bias, Bm, Cm, D = inputs
    return [x.contiguous(), dt.contiguous(), -torch.exp(A_log.float()), Bm.contiguous(), Cm.contiguous(), D.float(),
            dt_bias.float()]


@torch.library.custom_op("kvbuffer_bench::replayssm_step", mutates_args=("state",))
def replayssm_step(backend: int, args: list[torch.Tensor], state: torch.Tensor, state_slots: torch.Tensor,
                   lengths: torch.Tensor) -> torch.Tensor:
    """One decode token of every row on ReplaySSMBackend `backend`'s server step (its rings mutated too):
    GDN (B, 1, Hv, V), Mamba-2 (B, H, P)."""
    return _BACKENDS[backend]._step(args, state, state_slots, lengths)


@replayssm_step.register_fake
def _(backend, args, state, state_slots, lengths):
    if len(args) == 5:  # GDN: out (B, 1, Hv, V)
        Hv, K, V = state.shape[-3:]
        return args[0].new_empty(args[0].shape[0], 1, Hv, V)
    return torch.empty_like(args[0])


@torch.library.custom_op("kvbuffer_bench::replayssm_verify", mutates_args=("state",))
def replayssm_verify(backend: int, args: list[torch.Tensor], state: torch.Tensor, state_slots: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
    """SGLang's verify of T tokens per row ((B * T, ...) args) on ReplaySSMBackend `backend`: (B * T, Hv, V)."""
    return _BACKENDS[backend]._verify(args, state, state_slots, slots)


@replayssm_verify.register_fake
def _(backend, args, state, state_slots, slots):
    return torch.empty_like(args[2])


def replayssm_llm(model, *, drafts: int = 0, ring_dtype: torch.dtype = torch.float32, **options):
    """A kvbuffer.LLM of `model` whose linear layers run the servers' ReplaySSM kernels (this module's
    docstring); with `drafts`, n-gram speculative decoding of that many drafts (a benchmark replaces
    the drafter). options: LLM's keywords (chunk_size, the ring length, is required; mode,
    unbuffered_rows and speculative are this function's). ValueError, before the rings are allocated, for heads, ring
    length or drafts the kernels do not take, or rings that do not fit in the device's free memory;
    RuntimeError where the kernels' modules cannot be imported (load_kernels says why). Its generate refuses a
    prompt shorter than the rings (ValueError, before anything is admitted)."""
    from ..engine.llm import LLM
    from ..engine.validate import free_memory
    from ..plan import check_fits, geometry_of

    if ring_dtype not in RING_DTYPES.values():
        raise ValueError(f"ring_dtype must be one of {list(RING_DTYPES)}, got {ring_dtype}")
    if not isinstance(options.get("chunk_size"), int):
        raise ValueError(f"chunk_size (the rings' length) must be given as an int, got {options.get('chunk_size')!r}")
    if {"mode", "unbuffered_rows", "speculative"} & set(options):
        raise ValueError("mode, unbuffered_rows and speculative are set by replayssm_llm (kvbuffer, 0, drafts)")
    if isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 0:
        raise ValueError(f"drafts must be an int >= 0, got {drafts!r}")
    fed = drafts + 1
    shape = geometry_of(model).linear_shape
    why = unsupported(shape, options["chunk_size"], fed)
    if why:
        raise ValueError(f"replayssm: {why}")
    fns, note = load_kernels(family_of(shape), fed)
    if fns is None:
        raise RuntimeError(f"replayssm: {note}")
    speculative = {"method": "ngram", "num_draft_tokens": drafts} if drafts else None
    llm = LLM(model, mode="kvbuffer", unbuffered_rows=0, speculative=speculative, **options)
    pools = llm.runner.caches
    layout = ReplayLayout(shape, pools.spec.num_linear_layers, pools.spec.max_states, pools.spec.max_requests,
                          pools.spec.chunk_size, fed, ring_dtype)
    sizes = f"max_batch={pools.spec.max_requests}, chunk_size={pools.spec.chunk_size}"
    check_fits(layout.nbytes(), free_memory(llm.device), {n: f"{sizes} (the ReplaySSM rings)" for n in
                                                          layout.tensor_shapes()}, str(llm.device))
    backend = ReplaySSMBackend(llm.backend, pools.states.state, pools.convs, ReplayCaches(layout, llm.device), fns)
    llm.backend = llm.runner.backend = backend
    engine_check = llm._check_prompt

    def check_prompt(ids, what):  # every request holds its state from admission (module docstring)
        engine_check(ids, what)
        if len(ids) < layout.L:
            raise ValueError(f"{what}: {len(ids)} tokens; the replayssm mode takes prompts of at least its rings' "
                             f"length, {layout.L} (each request holds a state from admission)")

    llm._check_prompt = check_prompt
    return llm
