"""The chunked prefill's tuner template per linear family (kvbuffer.kernels.specs' GDN_CHUNK_PREFILL and
MAMBA2_CHUNK_PREFILL), one kernel of several launches.

Built once per shape for every chunk size (the op folds whole prompts, C plays no part) and stored as one
artifact per launch. Its inputs are a packed prefill of about PREFILL_TOKENS tokens spread over the batch's
sequences (awkward lengths), each from a state slot of its own (GDN's after its front, Mamba-2's the raw
layer inputs); it is checked against the op's reference (kvbuffer.kernels.prefill.chunk_prefill_reference,
mamba2_chunk_prefill_reference) in fp64: outputs and final states.
"""

from __future__ import annotations

from typing import Mapping

from kvbuffer.kernels.keys import KernelKey, linear_dims
from kvbuffer.kernels.prefill import fits
from kvbuffer.kernels.specs import SPECS, TILES

from .template import Template, from_spec

PREFILL_TOKENS = 4096  # tokens of the tuned prefill, shared out among the batch's sequences
TOKENS = {"gdn": ("q", "k", "v", "g", "beta"), "mamba2": ("x", "dt", "A_log", "dt_bias", "B", "C", "D")}
OUTPUT = {"gdn": "o", "mamba2": "y"}


def _key(shape: Mapping, chunk_size: int, drafts: int) -> KernelKey:
    dims = linear_dims(shape["family"], shape["Hk"], shape["Hv"], shape["K"], shape["V"])
    return KernelKey(shape["family"], "chunk_prefill", dims, "bfloat16")


def _lengths(batch: int) -> list[int]:
    """About PREFILL_TOKENS // batch tokens a sequence, give or take one (at least one)."""
    per = max(2, PREFILL_TOKENS // max(batch, 1))
    return [per - 1 + i % 3 for i in range(batch)]


def _inputs(shape, batch, chunk_size, device, gen) -> dict:
    import torch
    import torch.nn.functional as F

    Hk, Hv, K, V = (shape[k] for k in ("Hk", "Hv", "K", "V"))
    lengths = _lengths(batch)
    N = sum(lengths)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q = (F.normalize(r(N, Hk, K), dim=-1) * K ** -0.5).bfloat16()
    k = F.normalize(r(N, Hk, K), dim=-1).bfloat16()
    g = -F.softplus(r(N, Hv)) * torch.logspace(-2.5, 0.5, Hv, device=device)  # slow to fast decay
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    state = 0.1 * r(batch, Hv, K, V)
    slots = torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)
    out = torch.empty(N, Hv, V, device=device).bfloat16()
    pools = dict(cu_seqlens=cu, state=state, state_slots=slots)
    if shape["family"] == "gdn":
        return dict(q=q, k=k, v=r(N, Hv, V).bfloat16(), g=g, beta=torch.sigmoid(r(N, Hv)), o=out, **pools)
    A_log = torch.linspace(-2.0, 1.0, Hv, device=device)  # slow to fast decay, as g above
    return dict(x=(0.3 * r(N, Hv, V)).bfloat16(), dt=r(N, Hv) - 1.0, A_log=A_log, dt_bias=0.5 * r(Hv), B=k, C=q,
                D=r(Hv), y=out, **pools)


def _reference(shape, chunk_size, args: Mapping) -> dict:
    from kvbuffer.kernels import prefill

    family = shape["family"]
    tokens = [args[n].double() for n in TOKENS[family]]
    fn = prefill.chunk_prefill_reference if family == "gdn" else prefill.mamba2_chunk_prefill_reference
    state = args["state"].double()
    o = fn(*tokens, args["cu_seqlens"], state, args["state_slots"])
    return {OUTPUT[family]: o, "state": state}


def _launch(family: str):
    def launch(op, args: list) -> None:
        from kvbuffer.kernels import prefill

        named = dict(zip(SPECS[(family, "chunk_prefill")].args, args))
        fn = prefill.chunk_prefill if family == "gdn" else prefill.mamba2_chunk_prefill
        rows = [named[n] for n in ("cu_seqlens", "state", "state_slots")]
        fn(op, *(named[n] for n in TOKENS[family]), *rows, out=named[OUTPUT[family]], check_values=False)
    return launch


def prefill_template(family: str, package: str = TILES) -> Template:
    """The chunked prefill of `family` ("gdn" or "mamba2"), from `package`'s kernel templates."""
    of = lambda fn: lambda shape, *a, **kw: fn({**shape, "family": family}, *a, **kw)  # noqa: E731
    return from_spec(SPECS[(family, "chunk_prefill")], f"{family}_chunk_prefill", family, of(_key), of(_inputs),
                     of(_reference), package=package, uses_chunk=False, launch=_launch(family),
                     takes=lambda shape: fits(shape["K"], shape["V"]))
