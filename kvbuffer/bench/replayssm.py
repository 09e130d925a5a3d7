"""The servers' ReplaySSM decode kernels as peers of `kvbuffer bench gdn|mamba2`, called as the servers call them.

ReplaySSM is the servers' name for deferring the state update: a per-slot ring of the last L steps'
records beside a checkpoint state that is read every step and written every L steps. Peers here:

- "sglang_step" / "sglang_step_bf16" (GDN): SGLang 0.5.23's `fused_recurrent_linear_replayssm_decode`
  as `TritonGDNKernel.packed_decode` calls it: packed `mixed_qkv`, state [slots, HV, V, K] fp32
  (value-major), rings d [slots, HV, L, V], k [slots, H, L, K], g [slots, HV, L] fp32, a per-row
  `write_pos` snapshot and an int32 `force_flush` (zeros: no radix track boundary), its default
  launch config. Ring dtype: SGLang's decode ring follows the state dtype (fp32, its default); its
  bf16 form is the activation-dtype ring the pool allocates when the speculative ring shares it.
- "sglang_verify5" / "sglang_verify5_commit" (GDN): 1 + 4 drafts through `gdn_replayssm_spec_decode(...,
  launch_mode="verify")` as `GDNAttnBackend._replayssm_target_verify` calls it (split q/k/v, bf16
  rings with low parts, fp32 checkpoint, null block -1), alone and followed by the commit the
  speculative worker runs after acceptance (`commit_gdn_replayssm_spec`, then
  `commit_gdn_replayssm_circular`, which folds the rows at capacity), one layer's worth.
  ACCEPTED tokens are committed per row and step, so the cursors and folds run as in a server.
- "vllm_step" (Mamba-2): vLLM 0.33.0's `selective_state_update_replayssm_output_only` as
  `MambaMixer2` calls it: state [slots, H, P, N] fp32, A, dt, dt_bias, D expanded over the head
  dim (stride 0), rings x, B in bf16 and dt fp32, a `bc_pre` scratch, `write_pos` = steps mod L
  and `is_flush` at L - 1, its Hopper config (replayssm_config.py). vLLM applies z after the kernel
  (its gated norm), so this kernel reads no z; kvbuffer's kernels apply it.

Rings are L = C (the bench's flush interval; both servers default to 16) and sized for every state
slot of the pools; timed calls get the pools' state bytes in the server's layout (a view) and
staggered cursors, like kvbuffer's fills. The modules are imported by name (MODULES): an installed
vllm / sglang, or the folder kvbuffer.bench.peer_sources writes; otherwise the row is skipped
with a "not installed" line. Each peer is gated on a run of several steps (a flush or fold
included) against kvbuffer's fp64 recurrent reference, token by token.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from . import kernels as common

MODULES = {
    "sglang_step": ("sglang.kernels.ops.attention.linear.fused_recurrent_linear_replayssm",
                    ("fused_recurrent_linear_replayssm_decode",)),
    "sglang_spec": ("sglang.kernels.ops.attention.linear.gdn_replayssm_spec_decode",
                    ("gdn_replayssm_spec_decode", "commit_gdn_replayssm_spec", "commit_gdn_replayssm_circular")),
    "vllm_step": ("vllm.model_executor.layers.mamba.ops.selective_state_update_replayssm_output_only",
                  ("selective_state_update_replayssm_output_only",)),
}
VERIFY_T = 5    # 1 + 4 drafts
ACCEPTED = 3    # tokens committed per verify (the bonus included): ~2.8 expected at acceptance 0.7, 4 drafts
# Both servers reconstruct states with bf16 tensor-core dots (their docs and tests: ~0.3-1% relative
# against fp64 where kvbuffer's kernels are exact to fp32 rounding): gated at 3x that.
TOLERANCE = 3e-2


def load(kind: str) -> tuple[dict | None, str]:
    """({function name: function} of MODULES[kind], or None, and one line saying which or why not)."""
    module, names = MODULES[kind]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return None, (f"{kind}: not installed ({module}: {e}); its rows are skipped (install "
                      f"{module.split('.')[0]}, or put a python -m kvbuffer.bench.peer_sources folder on PYTHONPATH)")
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        return None, f"{kind}: {module} ({mod.__file__}) has no {missing}: not the release these rows call; skipped"
    return {n: getattr(mod, n) for n in names}, f"{kind}: {module} from {mod.__file__}"


def _values(g, *shape, dtype, device) -> torch.Tensor:
    """Ring entries of a plausible size (~0.1)."""
    return (0.1 * torch.randn(*shape, device=device, generator=g)).to(dtype)


def _keys(g, *shape, device) -> torch.Tensor:
    """Unit keys, fp32."""
    return torch.nn.functional.normalize(torch.randn(*shape, device=device, generator=g), dim=-1)


def _log_decays(g, *shape, device) -> torch.Tensor:
    """fp32 log decays in [-0.05, 0]."""
    return -0.05 * torch.rand(*shape, device=device, generator=g)


# ---- SGLang GDN decode step -------------------------------------------------------------------------


class SGLangStep:
    """SGLang's ReplaySSM decode on `state` [slots, HV, V, K] with its own rings of `ring_dtype`."""

    def __init__(self, fn: Callable, state: torch.Tensor, Hk: int, B: int, L: int, ring_dtype, *, seed: int = 0):
        n, Hv, V, K = state.shape
        g = torch.Generator(device=state.device).manual_seed(seed)
        self.fn, self.state, self.L = fn, state, L
        self.force_flush = torch.zeros(B, dtype=torch.int32, device=state.device)  # no radix track boundary
        self.d = _values(g, n, Hv, L, V, dtype=ring_dtype, device=state.device)
        self.k = _keys(g, n, Hk, L, K, device=state.device).to(ring_dtype)
        self.g = _log_decays(g, n, Hv, L, device=state.device)

    def empty(self) -> "SGLangStep":
        """Rings of fresh requests (for the gate)."""
        for t in (self.d, self.k, self.g):
            t.zero_()
        return self

    @staticmethod
    def pack(q, k, v, a, b):
        """The backend's inputs from one token's (B, Hk, K), (B, Hv, V), (B, Hv): mixed_qkv, a, b."""
        return torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1), a, b

    def __call__(self, packed, A_log, dt_bias, slots, write_pos, out) -> torch.Tensor:
        mixed_qkv, a, b = packed
        self.fn(mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=self.state.shape[-1] ** -0.5,
                initial_state=self.state, d_cache=self.d, k_cache=self.k, g_cache=self.g, out=out,
                ssm_state_indices=slots, write_pos=write_pos, force_flush=self.force_flush,
                use_qk_l2norm_in_kernel=True)
        return out[:, 0]

    def next_write_pos(self, write_pos: torch.Tensor) -> torch.Tensor:
        """The backend's cursor advance (once per forward, all layers): 0 after a flush, else + 1."""
        return torch.where(write_pos == self.L - 1, torch.zeros_like(write_pos), write_pos + 1)


def sglang_step_peer(name: str, fn: Callable, ring_dtype) -> common.Peer:
    def op(pools, inputs):
        _, Hv, K, V = pools.state.shape
        step = SGLangStep(fn, pools.state.view(-1, Hv, V, K), pools.buf_k.shape[2], pools.B, pools.C, ring_dtype)
        sets = [SGLangStep.pack(*(t[:, 0] for t in toks)) for toks in inputs.tokens[1]]
        out = torch.empty(pools.B, 1, Hv, V, device=pools.device, dtype=torch.bfloat16)
        return lambda s: step(sets[s % common.INPUT_SETS], *inputs.params, pools.state_slots(s), pools.lengths(s),
                              out)

    def check(family, heads, C, device):
        def stepper(state, B, L):
            step = SGLangStep(fn, state.transpose(-1, -2).contiguous(), heads["Hk"], B, L, ring_dtype).empty()

            def run(toks, prm, slots, write_pos):
                out = torch.full((B, 1, heads["Hv"], heads["V"]), float("nan"), device=device, dtype=torch.bfloat16)
                return step(SGLangStep.pack(*toks), *prm, slots, write_pos, out), step.next_write_pos(write_pos)
            return run
        return step_sequence_error(family, heads, C, device, stepper)
    return common.Peer(name, op, None, check=check, tolerance=TOLERANCE)


# ---- SGLang GDN speculative verify --------------------------------------------------------------------


class SGLangVerify:
    """SGLang's ReplaySSM verify of T tokens per row on `state` [slots, HV, V, K] fp32, with its bf16
    rings (d, k and their low parts, g fp32) and request-slot cursors (write_pos, cache_base, is_flush)."""

    def __init__(self, fns: dict, state: torch.Tensor, Hk: int, L: int, T: int, *, seed: int = 0):
        n, Hv, V, K = state.shape
        if L & (L - 1) or L < 2 * T:
            raise ValueError(f"SGLang's verify ring needs a power-of-two length >= 2 * {T} tokens, got C = {L}")
        g = torch.Generator(device=state.device).manual_seed(seed)
        self.fns, self.state, self.L, self.T = fns, state, L, T
        self.d = _values(g, n, Hv, L, V, dtype=torch.bfloat16, device=state.device)
        self.d_low = torch.zeros_like(self.d)
        keys = _keys(g, n, Hk, L, K, device=state.device)
        self.k, self.k_low = keys.to(torch.bfloat16), (keys - keys.to(torch.bfloat16).float()).to(torch.bfloat16)
        self.g = _log_decays(g, n, Hv, L, device=state.device)
        # cursors as the commit leaves them: history within L - 2T (the early-fold margin), no fold pending
        self.write_pos = torch.randint(0, L - 2 * T + 1, (n,), dtype=torch.int32, device=state.device, generator=g)
        self.cache_base = torch.randint(0, L, (n,), dtype=torch.int32, device=state.device, generator=g)
        self.is_flush = torch.zeros(n, dtype=torch.int8, device=state.device)

    def empty(self) -> "SGLangVerify":
        """Rings and cursors of fresh requests (for the gate)."""
        for t in (self.d, self.d_low, self.k, self.k_low, self.g, self.write_pos, self.cache_base, self.is_flush):
            t.zero_()
        return self

    @staticmethod
    def split(q, k, v, a, b):
        """The backend's inputs from (B, T, ...) tokens: each flattened to (B * T, ...)."""
        return tuple(t.flatten(0, 1) for t in (q, k, v, a, b))

    def verify(self, tokens, A_log, dt_bias, slots, query_start_loc, out) -> torch.Tensor:
        q, k, v, a, b = tokens
        self.fns["gdn_replayssm_spec_decode"](
            q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, checkpoint_state=self.state, d_cache=self.d,
            k_cache=self.k, g_cache=self.g, rawv_cache=self.d_low, rawk_cache=self.k_low, beta_cache=None, out=out,
            query_start_loc=query_start_loc, ssm_state_indices=slots, replay_indices=slots, write_pos=self.write_pos,
            cache_base=self.cache_base, is_flush=self.is_flush, max_cache_len=self.L, max_spec_len=self.T,
            scale=self.state.shape[-1] ** -0.5, use_qk_l2norm_in_kernel=True, null_block_id=-1, launch_mode="verify")
        return out

    def commit(self, slots, accepted) -> None:
        """The speculative worker's commit of `accepted` tokens per row (the bonus included), for one layer."""
        self.fns["commit_gdn_replayssm_spec"](
            write_pos=self.write_pos, cache_base=self.cache_base, is_flush=self.is_flush, num_accepted=accepted,
            replay_indices=slots, max_cache_len=self.L, max_spec_len=self.T,
            fold_every_commit=self.state.dtype != torch.float32, null_block_id=-1)
        self.fns["commit_gdn_replayssm_circular"](
            checkpoint_state=self.state[None], d_cache=self.d[None], k_cache=self.k[None], g_cache=self.g[None],
            d_residual_cache=self.d_low[None], k_residual_cache=self.k_low[None], state_batch_indices=slots,
            replay_indices=slots, write_pos=self.write_pos, cache_base=self.cache_base, is_flush=self.is_flush,
            accept_lens=accepted, mamba_track_indices=None, mamba_steps_to_track=None, null_block_id=-1)


def sglang_verify_peer(name: str, fns: dict, commit: bool) -> common.Peer:
    def op(pools, inputs):
        _, Hv, K, V = pools.state.shape
        ver = SGLangVerify(fns, pools.state.view(-1, Hv, V, K), pools.buf_k.shape[2], pools.C, VERIFY_T)
        sets = [SGLangVerify.split(*toks) for toks in inputs.tokens[VERIFY_T]]
        B = pools.B
        starts = torch.arange(0, B * VERIFY_T + 1, VERIFY_T, dtype=torch.int32, device=pools.device)
        accepted = torch.full((B,), ACCEPTED, dtype=torch.int32, device=pools.device)
        out = torch.empty(B * VERIFY_T, Hv, V, device=pools.device, dtype=torch.bfloat16)

        def run(s):
            ver.verify(sets[s % common.INPUT_SETS], *inputs.params, pools.state_slots(s), starts, out)
            if commit:
                ver.commit(pools.state_slots(s), accepted)
        return run

    def check(family, heads, C, device):
        return verify_sequence_error(fns, family, heads, C, device)
    return common.Peer(name, op, None, check=check, tolerance=TOLERANCE)


def verify_sequence_error(fns: dict, family, heads, L: int, device, *, B: int = 3, windows: int = 6) -> float:
    """Relative error of SGLang's verify over `windows` verify + commit steps from fresh states and
    rings (folds included), each row accepting 1..T tokens in turn, against the fp64 recurrent
    reference: every verify output is the reference run from the row's committed state."""
    g = torch.Generator(device=device).manual_seed(4)
    n, T = B + 2, VERIFY_T
    state = 0.1 * torch.randn(n, heads["Hv"], heads["K"], heads["V"], device=device, generator=g)
    prm = family.params(heads, g, device)
    slots = torch.randperm(n, device=device, generator=g)[:B].to(torch.int32)
    ver = SGLangVerify(fns, state.transpose(-1, -2).contiguous(), heads["Hk"], L, T).empty()
    starts = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=device)
    want_state, got, want = state.double(), [], []
    for w in range(windows):
        toks = family.tokens(heads, B, T, g, device)
        out = torch.full((B * T, heads["Hv"], heads["V"]), float("nan"), device=device, dtype=torch.bfloat16)
        got.append(ver.verify(SGLangVerify.split(*toks), *prm, slots, starts, out).view(B, T, *out.shape[1:]))
        accepted = (torch.arange(B, device=device) + w) % T + 1
        trial = want_state.clone()
        want.append(torch.stack([_reference_step(family, [x[:, t] for x in toks], prm, trial, slots)
                                 for t in range(T)], 1))
        for t in range(T):  # the committed state: each row's accepted prefix
            keep = (accepted > t)[:, None, None, None]
            before = want_state[slots.long()]
            _reference_step(family, [x[:, t] for x in toks], prm, want_state, slots)
            want_state[slots.long()] = torch.where(keep, want_state[slots.long()], before)
        ver.commit(slots, accepted.to(torch.int32))
    return common.rel_err(torch.cat(got), torch.cat(want))


# ---- vLLM Mamba-2 decode step ------------------------------------------------------------------------


class VLLMStep:
    """vLLM's ReplaySSM Mamba-2 decode on `state` [slots, H, P, N] with its own bf16 / fp32 rings."""

    def __init__(self, fn: Callable, state: torch.Tensor, G: int, B: int, L: int, *, seed: int = 0):
        n, H, P, N = state.shape
        g = torch.Generator(device=state.device).manual_seed(seed)
        self.fn, self.state, self.L = fn, state, L
        self.x = _values(g, n, H, L, P, dtype=torch.bfloat16, device=state.device)
        self.dt = 0.05 * torch.rand(n, H, L, device=state.device, generator=g)
        self.B = _values(g, n, G, L, N, dtype=torch.bfloat16, device=state.device)
        self.bc_pre = torch.empty(B, G, L, device=state.device)

    def empty(self) -> "VLLMStep":
        """Rings of fresh requests (for the gate)."""
        for t in (self.x, self.dt, self.B):
            t.zero_()
        return self

    def args(self, toks, prm) -> dict:
        """MambaMixer2's arguments from one token's x, dt, B, C (z is applied after the kernel)."""
        x, dt, Bm, Cm, _ = toks
        A_log, dt_bias, D = prm
        H, P, N = self.state.shape[1:]
        A = -torch.exp(A_log.float())  # vLLM keeps A = -exp(A_log) as the layer's parameter
        return dict(x=x, dt=dt[..., None].expand(*dt.shape, P), A=A[:, None, None].expand(H, P, N), B=Bm, C=Cm,
                    D=D[:, None].expand(H, P), dt_bias=dt_bias[:, None].expand(H, P))

    def __call__(self, args: dict, slots, write_pos, is_flush, out) -> torch.Tensor:
        # vLLM reserves slot 0 as its null block (NULL_BLOCK_ID = 0); the bench's pools give slot 0 to a
        # real row and have no padding rows, so the sentinel passed is one no row carries.
        self.fn(self.state, **args, dt_softplus=True, x_cache=self.x, dt_cache=self.dt, B_cache=self.B,
                bc_pre=self.bc_pre, write_pos=write_pos, is_flush=is_flush,
                max_cache_len=self.L, state_batch_indices=slots, null_block_id=-1, out=out)
        return out

    def is_flush(self, write_pos: torch.Tensor) -> torch.Tensor:
        """vLLM's flush flag (its metadata builds it with the cursor): the last ring position."""
        return (write_pos == self.L - 1).to(torch.int8)

    def next_write_pos(self, write_pos: torch.Tensor) -> torch.Tensor:
        """vLLM's cursor: decode steps mod L."""
        return (write_pos + 1) % self.L


def vllm_step_peer(fn: Callable) -> common.Peer:
    def op(pools, inputs):
        n, H, N, P = pools.state.shape
        step = VLLMStep(fn, pools.state.view(n, H, P, N), pools.buf_k.shape[2], pools.B, pools.C)
        sets = [step.args([t[:, 0] for t in toks], inputs.params) for toks in inputs.tokens[1]]
        flush = [step.is_flush(pools.lengths(i)) for i in range(pools.C)]
        out = torch.empty(pools.B, H, P, device=pools.device, dtype=torch.bfloat16)
        return lambda s: step(sets[s % common.INPUT_SETS], pools.state_slots(s), pools.lengths(s),
                              flush[s % pools.C], out)

    def check(family, heads, C, device):
        def stepper(state, B, L):
            step = VLLMStep(fn, state.transpose(-1, -2).contiguous(), heads["Hk"], B, L).empty()

            def run(toks, prm, slots, write_pos):
                out = torch.full(toks[0].shape, float("nan"), device=device, dtype=torch.bfloat16)
                y = step(step.args(toks, prm), slots, write_pos, step.is_flush(write_pos), out)
                return y, step.next_write_pos(write_pos)
            return run
        return step_sequence_error(family, heads, C, device, stepper, z=False)
    return common.Peer("vllm_step", op, None, check=check, tolerance=TOLERANCE)


# ---- the gates ---------------------------------------------------------------------------------------


def step_sequence_error(family, heads, L: int, device, make_stepper, *, B: int = 5, steps: int | None = None,
                        z: bool = True) -> float:
    """Relative error of a ReplaySSM step peer over `steps` tokens (default L + 3: a flush and the ring
    after it) from fresh states and empty rings, against the fp64 recurrent reference token by token.

    make_stepper(state (n, Hv, K, V) fp32 in kvbuffer's layout, B, L) -> run(tokens, params, slots,
    write_pos) -> (output, next write_pos). z=False: the peer applies no output gate (vLLM's)."""
    g = torch.Generator(device=device).manual_seed(3)
    n = B + 2
    state = 0.1 * torch.randn(n, heads["Hv"], heads["K"], heads["V"], device=device, generator=g)
    prm = family.params(heads, g, device)
    slots = torch.randperm(n, device=device, generator=g)[:B].to(torch.int32)
    run, want_state = make_stepper(state, B, L), state.double()
    write_pos = torch.zeros(B, dtype=torch.int32, device=device)
    got, want = [], []
    for _ in range(steps or L + 3):
        toks = [t[:, 0] for t in family.tokens(heads, B, 1, g, device)]
        if not z:
            toks[-1] = None
        out, write_pos = run(toks, prm, slots, write_pos)
        got.append(out)
        want.append(_reference_step(family, toks, prm, want_state, slots))
    return common.rel_err(torch.stack(got), torch.stack(want))


def _reference_step(family, toks, prm, state64, slots) -> torch.Tensor:
    """One fp64 recurrent step of the family's reference, in place on state64."""
    if family.NAME == "gdn":
        from ..reference import gdn as ref

        q, k, v, a, b = toks
        return ref.recurrent_step(q, k, v.double(), a, b, *prm, state64, slots).double()
    from ..reference import mamba2 as ref

    x, dt, Bm, Cm, z = (None if t is None else t.double() for t in toks)
    return ref.recurrent_step(x, dt, *prm[:2], Bm, Cm, prm[2], state64, slots, z=z).double()
