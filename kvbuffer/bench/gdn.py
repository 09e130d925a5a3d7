"""Gated DeltaNet decode kernels: buffered step and verify vs recurrent step vs FLA, one GPU.

`kvbuffer bench gdn` runs it (kvbuffer.bench.kernels says how it measures). The peer is FLA's
`fused_recurrent_gated_delta_rule` (fla-core 0.6.0) called as vLLM and SGLang call it: the gate
(-exp(A_log) * softplus(a + dt_bias)), the sigmoid of beta and the L2 norm of q and k inside the
kernel. FLA 0.6.0 takes no state indices, so each launch gets one window of B states as a view of
the pool and writes the final states to a fresh tensor (the same bytes as an indexed in-place
update).
"""

from __future__ import annotations

from typing import Mapping

import torch

from . import kernels as common

NAME = "gdn"
PEER = "fla"
SHAPES = ("qwen3.5-9b", "qwen3.5-27b")  # model presets (kvbuffer.presets) timed by default


def tokens(heads: Mapping, B: int, T: int, g, device) -> tuple:
    """q, k (B, T, Hk, K), v (B, T, Hv, V), a, b (B, T, Hv): the raw projections, bf16."""
    Hk, Hv, K, V = heads["Hk"], heads["Hv"], heads["K"], heads["V"]
    r = lambda *s: torch.randn(*s, device=device, generator=g).to(torch.bfloat16)  # noqa: E731
    return r(B, T, Hk, K), r(B, T, Hk, K), r(B, T, Hv, V), r(B, T, Hv), r(B, T, Hv)


def params(heads: Mapping, g, device) -> tuple:
    """A_log and dt_bias (Hv,), fp32, in the ranges of trained checkpoints."""
    Hv = heads["Hv"]
    A_log = torch.log(1 + 15 * torch.rand(Hv, device=device, generator=g))
    dt_bias = torch.log(torch.expm1(0.001 + 0.1 * torch.rand(Hv, device=device, generator=g)))
    return A_log, dt_bias


def kernel_args(toks: tuple, prm: tuple) -> tuple:
    return (*toks, *prm)


def act_bytes(heads: Mapping, T: int) -> float:
    """Activation bytes per row: q, k, v, a, b read and o written, bf16."""
    Hk, Hv, K, V = heads["Hk"], heads["Hv"], heads["K"], heads["V"]
    return T * 2 * (2 * Hk * K + Hv * V + 2 * Hv + Hv * V)


def build(heads: Mapping, *, C: int, cap: int, configs: Mapping) -> dict:
    """Compile our kernels with `configs`' tunables for "recurrent", "buffered" and "verify"
    (kernels.kernel_configs)."""
    from ..kernels import build_gdn_buffered, build_gdn_recurrent

    Hk, Hv, K, V = heads["Hk"], heads["Hv"], heads["K"], heads["V"]
    out = {"recurrent": build_gdn_recurrent(Hk, Hv, K, V, **configs["recurrent"]),
           "buffered": build_gdn_buffered(Hk, Hv, K, V, cap=cap, T_new=1, flush_at=C, **configs["buffered"])}
    for T in common.VERIFY_TOKENS:
        out[f"verify{T}"] = build_gdn_buffered(Hk, Hv, K, V, cap=cap, T_new=T, flush_at=0, **configs["verify"])
    return out


def reference(kind: str, toks: tuple, prm: tuple, pools: common.Pools, s: int) -> torch.Tensor:
    """The fp64 output of `kind` (recurrent, buffered or verify) on copies of the pools."""
    from ..reference import gdn as ref

    q, k, v, a, b = toks if kind == "verify" else (t[:, 0] for t in toks)  # single-token ops: no time axis
    args = (q, k, v.double(), a, b, *prm, pools.state.double(), pools.state_slots(s))
    bufs = [t.clone() for t in pools.buffers(s)]
    if kind == "recurrent":
        return ref.recurrent_step(*args)
    if kind == "buffered":
        return ref.buffered_step(*args, *bufs, flush_at=pools.C)
    return ref.verify(*args, *bufs)


def load_peer():
    """(FLA's fused recurrent GDN update or None, one line saying which)."""
    try:
        import fla
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError as e:
        return None, f"fla: not importable ({e}); its rows are skipped (pip install fla-core)"
    return fused_recurrent_gated_delta_rule, (
        f"fla: fla-core {getattr(fla, '__version__', '?')} fused_recurrent_gated_delta_rule, gate, beta sigmoid and "
        "q/k L2 norm in the kernel, states by contiguous window")


def _call_peer(peer, pools: common.Pools, inputs: common.Inputs, s: int) -> torch.Tensor:
    q, k, v, a, b = inputs.tokens[1][s % common.INPUT_SETS]
    A_log, dt_bias = inputs.params
    o, _ = peer(q, k, v, g=a, beta=b, initial_state=pools.state_window(s), output_final_state=True,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=True)
    return o


def peer_op(peer, pools: common.Pools, inputs: common.Inputs):
    return lambda s: _call_peer(peer, pools, inputs, s)


def peer_output(peer, pools: common.Pools, inputs: common.Inputs, s: int) -> torch.Tensor:
    return _call_peer(peer, pools, inputs, s)[:, 0]


def run(**kwargs) -> dict:
    """kernels.run for this family (shapes default to SHAPES)."""
    import sys

    kwargs.setdefault("shapes", SHAPES)
    return common.run(sys.modules[__name__], **kwargs)
