"""Gated DeltaNet decode kernels: buffered step and verify vs recurrent step vs SGLang and FLA, one GPU.

`kvbuffer bench gdn` runs it (kvbuffer.bench.kernels says how it measures). Peers: SGLang's
ReplaySSM step (fp32 and bf16 rings) and verify of 1 + 4 drafts (alone, and with its commit and
fold), as kvbuffer.bench.replayssm says; and two FLA kernels (fla-core 0.6.0) with the gate
(-exp(A_log) * softplus(a + dt_bias)), the sigmoid of beta and the L2 norm of q and k inside the
kernel, as vLLM and SGLang call it:

- "fla": `fused_recurrent_gated_delta_rule`. It takes no state indices, so each launch gets one
  window of B states as a view of the pool and writes the final states to a fresh tensor (the same
  bytes as an indexed in-place update, one dependent load fewer: no slot to wait for).
- "fla_indexed": FLA's indexed in-place recurrent kernel, the form the servers' copies of the GDN
  kernel take (`ssm_state_indices`, the final state written over the initial one):
  kvbuffer.bench.peers.fla_indexed_update, gate inputs broadcast over K beforehand (untimed).
"""

from __future__ import annotations

from typing import Mapping

import torch

from . import kernels as common

NAME = "gdn"
PEERS = {"fla": "recurrent", "fla_indexed": "recurrent", "sglang_step": "buffered", "sglang_step_bf16": "buffered",
         "sglang_verify5": "verify5", "sglang_verify5_commit": "verify5"}  # name -> the op of ours beside it
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


def load_peers() -> tuple[list, list[str]]:
    """(the Peer of each kernel found, one line per peer module saying which or why not)."""
    found, notes = load_fla_peers()
    found_r, notes_r = load_replayssm_peers()
    return found + found_r, notes + notes_r


def load_replayssm_peers() -> tuple[list, list[str]]:
    """SGLang's ReplaySSM step (both ring dtypes) and verify (alone, with its commit), where importable."""
    from . import replayssm

    step, note_step = replayssm.load("sglang_step")
    spec, note_spec = replayssm.load("sglang_spec")
    found = []
    if step:
        fn = step["fused_recurrent_linear_replayssm_decode"]
        found += [replayssm.sglang_step_peer("sglang_step", fn, torch.float32),
                  replayssm.sglang_step_peer("sglang_step_bf16", fn, torch.bfloat16)]
    if spec:
        found += [replayssm.sglang_verify_peer("sglang_verify5", spec, commit=False),
                  replayssm.sglang_verify_peer("sglang_verify5_commit", spec, commit=True)]
    return found, [note_step, note_spec]


def load_fla_peers() -> tuple[list, list[str]]:
    """(the Peer of each FLA kernel found, one line per peer saying which)."""
    from .peers import load_fla_indexed

    try:
        import fla
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError as e:
        return [], [f"fla: not importable ({e}); its rows are skipped (pip install fla-core)"]
    version = getattr(fla, "__version__", "?")
    found = [contiguous_peer(fused_recurrent_gated_delta_rule)]
    notes = [f"fla: fla-core {version} fused_recurrent_gated_delta_rule, gate, beta sigmoid and q/k L2 norm in "
             "the kernel, states by contiguous window"]
    fwd, why = load_fla_indexed()
    if fwd is None:
        notes.append(f"fla_indexed: {why}; its rows are skipped")
    else:
        found.append(indexed_peer(fwd))
        notes.append(f"fla_indexed: fla-core {version} {why}")
    return found, notes


def contiguous_peer(fn) -> common.Peer:
    """The "fla" Peer on `fn`, a function with fused_recurrent_gated_delta_rule's signature."""
    return common.Peer("fla", lambda pools, inputs: lambda s: _call_fla(fn, pools, inputs, s),
                       lambda pools, inputs, s: _call_fla(fn, pools, inputs, s)[:, 0])


def _call_fla(fn, pools: common.Pools, inputs: common.Inputs, s: int) -> torch.Tensor:
    q, k, v, a, b = inputs.tokens[1][s % common.INPUT_SETS]
    A_log, dt_bias = inputs.params
    o, _ = fn(q, k, v, g=a, beta=b, initial_state=pools.state_window(s), output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              use_beta_sigmoid_in_kernel=True)
    return o


def indexed_peer(fwd) -> common.Peer:
    """The "fla_indexed" Peer on `fwd`, a function with fused_recurrent_kda_fwd's signature."""
    return common.Peer("fla_indexed", lambda pools, inputs: _indexed_op(fwd, pools, inputs),
                       lambda pools, inputs, s: _indexed_op(fwd, pools, inputs, copy=True)(s))


def _indexed_op(fwd, pools: common.Pools, inputs: common.Inputs, copy: bool = False):
    """fla_indexed on set s, in place on the pool (copy: on a copy of it, for the gate); the gates
    broadcast per key channel and the output buffers are made once, before any timing."""
    from .peers import fla_indexed_update, gate_per_channel

    A_log, dt_bias = inputs.params
    sets = [(q, k, v, *gate_per_channel(a, dt_bias, q.shape[-1]), b) for q, k, v, a, b in inputs.tokens[1]]
    out = torch.empty_like(inputs.tokens[1][0][2])
    state = pools.state.clone() if copy else pools.state

    def run(s):
        q, k, v, g, dt_k, b = sets[s % common.INPUT_SETS]
        fla_indexed_update(fwd, q, k, v, g, b, A_log, dt_k, state, pools.state_slots(s), out)
        return out[:, 0]
    return run


def run(**kwargs) -> dict:
    """kernels.run for this family (shapes default to SHAPES)."""
    import sys

    kwargs.setdefault("shapes", SHAPES)
    return common.run(sys.modules[__name__], **kwargs)
