"""The recurrent scheme on the kernels today's servers call: a benchmark-only Backend ("peers").

kvbuffer's own "recurrent" mode already runs on kvbuffer's recurrent kernels, which are faster than
what vLLM and SGLang launch; the figure users compare against is the servers' own. This Backend runs
the engine's recurrent mode with their state updates:

- Gated DeltaNet: FLA's indexed in-place recurrent kernel (fla-core 0.6.0), the form the servers'
  copies of FLA's GDN kernel take: states picked by `ssm_state_indices`, the final state written
  over the initial one, the gate (-exp(A_log) * softplus(a + dt_bias)), beta's sigmoid and the q/k
  L2 norm in the kernel. FLA ships that form as its KDA kernel (`fused_recurrent_kda_fwd`), whose
  gate has one value per key channel: GDN's per-head gate inputs are broadcast over K
  (`gate_per_channel`), which makes its update GDN's exactly. (`fused_recurrent_gated_delta_rule`
  itself takes no state index; kvbuffer bench gdn times it too.)
- Mamba-2: mamba_ssm's `selective_state_update`, in place through `state_batch_indices`, with the
  per-head dt, A, D and dt_bias broadcast over the head dim (stride 0) as vLLM passes them. Its states
  are kept in its own (H, P, N) layout, as vLLM keeps them (handed kvbuffer's (H, N, P) layout
  transposed, its loads are strided and it runs slower): each state slot's memory is read as
  (H, P, N). In recurrent mode every state access (prefill, decode, verify) goes through
  `recurrent_step`, so the pool is only ever read that way; states are copied whole otherwise.
- Speculative decoding: the recurrent verify, one state written per fed token (what SGLang and vLLM
  keep), token by token on the kernels above, each state then copied to the request's per-draft states
  (kvbuffer's own recurrent mode writes them in its fused `*_recurrent_drafts` kernel).

Padding rows (slot -1) read and write one reserved state slot, the pool's last (servers reserve a
pad slot the same way): build the engine with max_states = max_batch + 1 (`reserve_pad_slot`). The
short conv, flushes and everything else stay kvbuffer's. A missing package makes `load_peers`
return None for that family; the benchmark skips its rows with one line.

Under torch.compile the peers' updates are one custom op (`kvbuffer_bench::peer_recurrent_step`), as
servers register theirs: the compiled step keeps the glue around them fused, with no graph break.
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch

from ..runtime.backend import KernelBackend, LinearInputs, per_token
from ..runtime.mixing import put_slot_rows

log = logging.getLogger("kvbuffer")


def load_fla_indexed():
    """(FLA's indexed in-place recurrent kernel or None, one line saying what it is or why not)."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError as e:
        return None, f"FLA's indexed recurrent kernel is not importable ({e})"
    return fused_recurrent_kda_fwd, ("fused_recurrent_kda_fwd, indexed and in place (ssm_state_indices), the GDN "
                                     "gate broadcast over K, gate, beta sigmoid and q/k L2 norm in the kernel")


def gate_per_channel(a: torch.Tensor, dt_bias: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN's per-head gate inputs as the KDA kernel's per-key-channel ones: a (B, T, Hv) ->
    (B, T, Hv, K) and dt_bias (Hv,) -> (Hv * K,), each channel the head's value (dense: the kernel
    ignores strides)."""
    return (a[..., None].expand(*a.shape, K).contiguous(),
            dt_bias.float()[:, None].expand(dt_bias.shape[0], K).reshape(-1))


def fla_indexed_update(fwd, q, k, v, g, b, A_log, dt_bias_k, state, rows, out) -> torch.Tensor:
    """One GDN step of rows (B, T = 1) on FLA's indexed kernel `fwd`, in place on `state` (slots, Hv,
    K, V) at `rows` (int32, every row a real slot); g, dt_bias_k from gate_per_channel; output into `out`
    (B, T, Hv, V), which the kernel would otherwise allocate and zero in each call."""
    fwd(q, k, v, g=g, beta=b, A_log=A_log.float(), dt_bias=dt_bias_k, initial_state=state,
        inplace_final_state=True, ssm_state_indices=rows, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, out=out)
    return out


def load_peers() -> dict:
    """family -> the peer's state-update function, or None where its package is missing (logged)."""
    found = {}
    found["gdn"], why = load_fla_indexed()
    if found["gdn"] is None:
        log.info("kvbuffer: %s", why)
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        found["mamba2"] = selective_state_update
    except ImportError as e:
        log.info("kvbuffer: mamba_ssm's selective_state_update is not available: %s", e)
        found["mamba2"] = None
    return found


def reserve_pad_slot(max_batch: int) -> int:
    """The state-pool size a peers engine needs: one state per request plus the padding rows' slot."""
    return max_batch + 1


_UPDATES: dict[int, dict] = {}  # PeersBackend.key -> its updates, for the custom op to call
_KEYS = itertools.count()  # never reused, unlike id(): a key names one backend for good


@torch.library.custom_op("kvbuffer_bench::peer_recurrent_step", mutates_args=("state",))
def peer_recurrent_step(backend: int, family: str, inputs: list[torch.Tensor], state: torch.Tensor,
                        rows: torch.Tensor) -> torch.Tensor:
    """One recurrent step of `family` on the peer kernel of PeersBackend `backend` (its id): the
    kernel's inputs (peer_inputs), the layer's state pool, each row's state slot (int32; padding: the
    pad slot)."""
    step = _gdn if family == "gdn" else _mamba2
    return step(_UPDATES[backend][family], inputs, state, rows)


@peer_recurrent_step.register_fake
def _(backend, family, inputs, state, rows):
    # the output is v's per-token shape: peer_inputs' v (B, 1, Hv, V) for GDN, x (B, H, P) for Mamba-2
    return torch.empty_like(inputs[2][:, 0] if family == "gdn" else inputs[0])


def peer_inputs(inputs: LinearInputs) -> list[torch.Tensor]:
    """The peer kernel's inputs, made outside its custom op so that a compiled step fuses the copies
    into its glue: GDN's q, k, v, g (gate_per_channel), b as dense (B, 1, H, D), A_log, dt_bias per
    channel; Mamba-2's as they are (its broadcasts are stride-0 views)."""
    if inputs.family != "gdn":
        return list(inputs)
    q, k, v, a, b = (t[:, None].contiguous() for t in inputs[:5])  # its kernel assumes dense (B, T, H, D)
    g, dt_bias_k = gate_per_channel(a, inputs.dt_bias, q.shape[-1])
    return [q, k, v, g, b, inputs.A_log.float(), dt_bias_k]


def _gdn(update, inputs, state, rows):
    q, k, v, g, b, A_log, dt_bias_k = inputs
    out = fla_indexed_update(update, q, k, v, g, b, A_log, dt_bias_k, state, rows, torch.empty_like(v))
    return out[:, 0]  # padding rows all read and write the pad slot


def _mamba2(update, inputs, state, rows):
    x, dt, A_log, dt_bias, B, C, D = inputs
    H, P, N = x.shape[1], x.shape[2], B.shape[-1]
    A = -torch.exp(A_log.float())[:, None, None].expand(H, P, N)
    native = state.view(*state.shape[:-2], P, N)  # the slot's memory as mamba_ssm's (H, P, N) states (never a copy)
    y = update(native, x, dt[..., None].expand(-1, -1, P), A, B, C,
               D=D.float()[:, None].expand(H, P), dt_bias=dt_bias.float()[:, None].expand(H, P),
               dt_softplus=True, state_batch_indices=rows)
    return y.to(x.dtype)


class PeersBackend(KernelBackend):
    """KernelBackend with the recurrent step on the peers' kernels; recurrent mode only.

    gdn_update: a function with the signature of FLA's fused_recurrent_kda_fwd (load_fla_indexed);
    mamba2_update: one with mamba_ssm's selective_state_update signature (tests pass CPU stand-ins)."""

    name = "peers"

    def __init__(self, gdn_update=None, mamba2_update=None):
        super().__init__()
        self.updates = {"gdn": gdn_update, "mamba2": mamba2_update}
        self.key = next(_KEYS)  # a plain int: the compiled step passes it as a constant
        _UPDATES[self.key] = self.updates
        weakref.finalize(self, _UPDATES.pop, self.key, None)

    def recurrent_step(self, inputs: LinearInputs, state, state_slots):
        if self.updates[inputs.family] is None:
            raise ValueError(f"PeersBackend: no peer kernel for the {inputs.family} family (load_peers found none)")
        rows = torch.where(state_slots >= 0, state_slots, state.shape[0] - 1).to(torch.int32)  # padding -> the pad slot
        return peer_recurrent_step(self.key, inputs.family, peer_inputs(inputs), state, rows)

    def recurrent_drafts(self, inputs: LinearInputs, state, state_slots, draft_states, draft_rows):
        """The speculative verify step by step on the peers' kernels: each token's state, in the peer's
        own layout, copied to the request's per-draft states after its step (FLA's kernel can write
        per-token states through 2-D indices into its one pool; kvbuffer keeps draft states apart)."""
        real = draft_rows >= 0
        rows_states = state_slots.clamp(min=0).long()
        # the rows' states gathered once (an indexed read copies), plus a pad slot for padding rows
        scratch = state[torch.cat([rows_states, rows_states[:1]])]
        rows = torch.where(real, torch.arange(draft_rows.shape[0], dtype=torch.int32, device=scratch.device),
                           torch.full_like(draft_rows, -1))
        slots = draft_rows.clamp(min=0).long()
        outs = []
        for t in range(inputs[0].shape[1]):  # padding rows write nothing, with no host sync (CUDA graphs)
            outs.append(self.recurrent_step(per_token(inputs, lambda x: x[:, t]), scratch, rows))
            put_slot_rows(draft_states, slots, torch.full_like(slots, t), scratch[:-1], real)
        return torch.stack(outs, 1)

    def buffered_step(self, *args, **kwargs):
        raise ValueError("PeersBackend runs the recurrent scheme only: build the engine with mode='recurrent'")

    verify = buffered_step
