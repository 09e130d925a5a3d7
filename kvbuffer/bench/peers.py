"""The recurrent scheme on the kernels today's servers call: a benchmark-only Backend ("peers").

kvbuffer's own "recurrent" mode already runs on kvbuffer's recurrent kernels, which are faster than
what vLLM and SGLang launch; the figure users compare against is the servers' own. This Backend runs
the engine's recurrent mode with their state updates:

- Gated DeltaNet: FLA's `fused_recurrent_gated_delta_rule` (fla-core 0.6.0) with the gate
  (-exp(A_log) * softplus(a + dt_bias)), beta's sigmoid and the q/k L2 norm in the kernel. Its API
  has no state index, so each step gathers the rows' states and scatters the final ones back.
- Mamba-2: mamba_ssm's `selective_state_update`, in place through `state_batch_indices`, with the
  per-head dt, A, D and dt_bias broadcast over the head dim (stride 0) as vLLM passes them. The state
  pool is kvbuffer's (H, N, P) layout, handed over transposed (the kernel takes any strides).
- Speculative decoding: the engine's recurrent verify, one state written per fed token (what
  SGLang and vLLM keep), each step on the kernels above.

Padding rows (slot -1) read and write one reserved state slot, the pool's last (servers reserve a
pad slot the same way): build the engine with max_states = max_batch + 1 (`reserve_pad_slot`). The
short conv, flushes and everything else stay kvbuffer's. A missing package makes `load_peers`
return None for that family; the benchmark skips its rows with one line.
"""

from __future__ import annotations

import logging

import torch

from ..runtime.backend import KernelBackend, LinearInputs

log = logging.getLogger("kvbuffer")


def load_peers() -> dict:
    """family -> the peer's state-update function, or None where its package is missing (logged)."""
    found = {}
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        found["gdn"] = fused_recurrent_gated_delta_rule
    except ImportError as e:
        log.info("kvbuffer: FLA's fused_recurrent_gated_delta_rule is not available: %s", e)
        found["gdn"] = None
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


class PeersBackend(KernelBackend):
    """KernelBackend with the recurrent step on the peers' kernels; recurrent mode only.

    gdn_update: a function with fla's fused_recurrent_gated_delta_rule signature; mamba2_update: one
    with mamba_ssm's selective_state_update signature (tests pass CPU stand-ins)."""

    name = "peers"

    def __init__(self, gdn_update=None, mamba2_update=None):
        super().__init__()
        self.updates = {"gdn": gdn_update, "mamba2": mamba2_update}

    def recurrent_step(self, inputs: LinearInputs, state, state_slots):
        update = self.updates[inputs.family]
        if update is None:
            raise ValueError(f"PeersBackend: no peer kernel for the {inputs.family} family (load_peers found none)")
        rows = torch.where(state_slots >= 0, state_slots, state.shape[0] - 1).long()  # padding -> the pad slot
        step = self._gdn if inputs.family == "gdn" else self._mamba2
        return step(update, inputs, state, rows)

    @staticmethod
    @torch.compiler.disable  # the peers' Triton wrappers run as they do in the servers: not traced
    def _gdn(update, inputs, state, rows):
        q, k, v, a, b = (t[:, None].contiguous() for t in inputs[:5])  # its kernel assumes dense (B, T, H, D)
        A_log, dt_bias = inputs.A_log, inputs.dt_bias
        o, final = update(q, k, v, g=a, beta=b,
                          initial_state=state.index_select(0, rows), output_final_state=True,
                          use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log.float(),
                          dt_bias=dt_bias.float(), use_beta_sigmoid_in_kernel=True)
        state.index_copy_(0, rows, final.to(state.dtype))  # padding rows all land in the pad slot
        return o[:, 0].to(v.dtype)

    @staticmethod
    @torch.compiler.disable
    def _mamba2(update, inputs, state, rows):
        x, dt, A_log, dt_bias, B, C, D = inputs
        H, P, N = x.shape[1], x.shape[2], B.shape[-1]
        A = -torch.exp(A_log.float())[:, None, None].expand(H, P, N)
        y = update(state.transpose(-1, -2), x, dt[..., None].expand(-1, -1, P), A, B, C,
                   D=D.float()[:, None].expand(H, P), dt_bias=dt_bias.float()[:, None].expand(H, P),
                   dt_softplus=True, state_batch_indices=rows.to(torch.int32))
        return y.to(x.dtype)

    def buffered_step(self, *args, **kwargs):
        raise ValueError("PeersBackend runs the recurrent scheme only: build the engine with mode='recurrent'")

    verify = buffered_step
