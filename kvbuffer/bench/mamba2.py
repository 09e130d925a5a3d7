"""Mamba-2 (Nemotron-3) decode kernels: buffered step and verify vs recurrent step vs vLLM and mamba_ssm, one GPU.

`kvbuffer bench mamba2` runs it (kvbuffer.bench.kernels says how it measures). Peers: vLLM's
ReplaySSM step (kvbuffer.bench.replayssm says how it is called), and mamba_ssm's Triton
`selective_state_update` called as vLLM and SGLang call it: dt_softplus, dt_bias, D, z, grouped
B/C, states picked by `state_batch_indices`, and A, dt, dt_bias, D expanded over the head dim by
stride-0 views. mamba_ssm is an optional peer (a source build that needs
CUDA); where it is not importable its rows are skipped and the run says so in one line.
mamba_ssm keeps a state as (P, N), kvbuffer as (N, P): the timed peer reads and writes the same
pool through a (P, N) view of the same bytes; the correctness gate gives it transposed copies.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Mapping

import torch

from . import kernels as common

NAME = "mamba2"
PEERS = {"mamba_ssm": "recurrent", "vllm_step": "buffered"}  # name -> the op of ours beside it
SHAPES = ("nemotron-3-nano", "nemotron-3-super")  # model presets (kvbuffer.presets) timed by default


def _dims(heads: Mapping) -> tuple[int, int, int, int]:
    """(G, H, N, P) from the generic head shape."""
    return heads["Hk"], heads["Hv"], heads["K"], heads["V"]


def tokens(heads: Mapping, B: int, T: int, g, device) -> tuple:
    """x (B, T, H, P), dt (B, T, H), B and C (B, T, G, N), z (B, T, H, P), bf16."""
    G, H, N, P = _dims(heads)
    r = lambda *s: torch.randn(*s, device=device, generator=g).to(torch.bfloat16)  # noqa: E731
    return r(B, T, H, P), r(B, T, H), r(B, T, G, N), r(B, T, G, N), r(B, T, H, P)


def params(heads: Mapping, g, device) -> tuple:
    """A_log, dt_bias and D (H,), fp32, in the ranges of trained checkpoints."""
    H = heads["Hv"]
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(H, device=device, generator=g)  # noqa: E731
    return torch.log(u(1, 16)), torch.log(torch.expm1(u(0.001, 0.1))), u(0.5, 1.5)


def kernel_args(toks: tuple, prm: tuple) -> tuple:
    x, dt, Bm, Cm, z = toks
    A_log, dt_bias, D = prm
    return x, dt, A_log, dt_bias, Bm, Cm, D, z


def act_bytes(heads: Mapping, T: int) -> float:
    """Activation bytes per row: x, dt, B, C, z read and y written, bf16."""
    G, H, N, P = _dims(heads)
    return T * 2 * (2 * H * P + H + 2 * G * N + H * P)


def build(heads: Mapping, *, C: int, cap: int, configs: Mapping) -> dict:
    """Compile our kernels with `configs`' tunables for "recurrent", "buffered" and "verify"
    (kernels.kernel_configs)."""
    from ..kernels import build_mamba2_buffered, build_mamba2_recurrent

    G, H, N, P = _dims(heads)
    out = {"recurrent": build_mamba2_recurrent(G, H, N, P, has_z=True, **configs["recurrent"]),
           "buffered": build_mamba2_buffered(G, H, N, P, cap=cap, T_new=1, flush_at=C, has_z=True,
                                             **configs["buffered"])}
    for T in common.VERIFY_TOKENS:
        out[f"verify{T}"] = build_mamba2_buffered(G, H, N, P, cap=cap, T_new=T, flush_at=0, has_z=True,
                                                  **configs["verify"])
    return out


def reference(kind: str, toks: tuple, prm: tuple, pools: common.Pools, s: int) -> torch.Tensor:
    """The fp64 output of `kind` (recurrent, buffered or verify) on copies of the pools."""
    from ..reference import mamba2 as ref

    x, dt, Bm, Cm, z = (t.double() if kind == "verify" else t[:, 0].double() for t in toks)
    A_log, dt_bias, D = prm
    state = pools.state.double()
    bufs = [t.clone() for t in pools.buffers(s)]
    args = (x, dt, A_log, dt_bias, Bm, Cm, D, state, pools.state_slots(s))
    if kind == "recurrent":
        return ref.recurrent_step(*args, z=z).double()
    if kind == "buffered":
        return ref.buffered_step(*args, *bufs, flush_at=pools.C, z=z).double()
    return ref.verify(*args, *bufs, z=z).double()


def import_mamba_ssm(module: str, attr: str):
    """(mamba_ssm's `module`.`attr`, a note for the peer line).

    A mamba_ssm installed without its CUDA extension (MAMBA_SKIP_CUDA_BUILD) fails to import its
    package for want of `selective_scan_cuda`, which the Triton kernels do not use; only then is
    an empty module registered under that name, and the note says so.
    """
    try:
        return getattr(importlib.import_module(module), attr), ""
    except ModuleNotFoundError as e:
        if e.name != "selective_scan_cuda":
            raise
    sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    return getattr(importlib.import_module(module), attr), " (its CUDA extension is not built; unused here)"


def load_peers() -> tuple[list, list[str]]:
    """(mamba_ssm's selective_state_update and vLLM's ReplaySSM step as Peers where importable, and one
    line per peer saying which or why not)."""
    from . import replayssm

    found, notes = load_mamba_ssm()
    step, note = replayssm.load("vllm_step")
    if step:
        found.append(replayssm.vllm_step_peer(step["selective_state_update_replayssm_output_only"]))
    return found, notes + [note]


def load_mamba_ssm() -> tuple[list, list[str]]:
    """(mamba_ssm's selective_state_update as a Peer, or none, and one line saying which)."""
    try:
        fn, extra = import_mamba_ssm("mamba_ssm.ops.triton.selective_state_update", "selective_state_update")
    except ImportError as e:
        return [], [f"mamba_ssm: not importable ({e}); its rows are skipped (an optional peer: "
                    "pip install mamba-ssm --no-build-isolation, on a machine with CUDA)"]
    import mamba_ssm

    peer = common.Peer("mamba_ssm", lambda pools, inputs: _peer_op(fn, pools, inputs),
                       lambda pools, inputs, s: _peer_output(fn, pools, inputs, s))
    return [peer], [f"mamba_ssm: {getattr(mamba_ssm, '__version__', '?')} Triton selective_state_update, "
                    f"dt_softplus, dt_bias, D, z, state_batch_indices{extra}"]


def _peer_args(heads: Mapping, inputs: common.Inputs, s: int) -> dict:
    G, H, N, P = _dims(heads)
    x, dt, Bm, Cm, z = (t[:, 0] for t in inputs.tokens[1][s % common.INPUT_SETS])
    A_log, dt_bias, D = inputs.params
    B = x.shape[0]
    return dict(x=x, dt=dt[..., None].expand(B, H, P), A=-torch.exp(A_log)[:, None, None].expand(H, P, N), B=Bm, C=Cm,
                D=D[:, None].expand(H, P), z=z, dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True)


def _heads(pools: common.Pools) -> dict:
    _, H, N, P = pools.state.shape
    return {"Hk": pools.buf_k.shape[2], "Hv": H, "K": N, "V": P}


def _peer_op(peer, pools: common.Pools, inputs: common.Inputs):
    n, H, N, P = pools.state.shape
    as_peer = pools.state.view(n, H, P, N)  # the same bytes in the peer's layout
    # built once: A = -exp(A_log) computed per call would add a kernel to every timed launch
    args = [_peer_args(_heads(pools), inputs, i) for i in range(common.INPUT_SETS)]
    return lambda s: peer(as_peer, **args[s % common.INPUT_SETS], state_batch_indices=pools.state_slots(s))


def _peer_output(peer, pools: common.Pools, inputs: common.Inputs, s: int) -> torch.Tensor:
    transposed = pools.state.transpose(-1, -2).contiguous()
    return peer(transposed, **_peer_args(_heads(pools), inputs, s), state_batch_indices=pools.state_slots(s))


def run(**kwargs) -> dict:
    """kernels.run for this family (shapes default to SHAPES)."""
    kwargs.setdefault("shapes", SHAPES)
    return common.run(sys.modules[__name__], **kwargs)
