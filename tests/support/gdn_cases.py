"""Random inputs, pools and error metrics shared by the GDN kernel tests and the benchmark."""

from __future__ import annotations

import json
import os

import torch

from kvbuffer.reference.gating import gdn_front


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in fp64; NaN anywhere gives inf (never passes)."""
    x, ref = x.double(), ref.double()
    if not bool(torch.isfinite(x).all()):
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def record(name: str, value: float) -> None:
    """Append one error figure to $KVB_ERROR_LOG (JSON lines) when set."""
    path = os.environ.get("KVB_ERROR_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, "value": value}) + "\n")


def tokens(B, T, Hk, Hv, K=128, V=128, *, gen, device="cuda", dtype=torch.bfloat16):
    """Raw Qwen3.5 GDN inputs (q, k, v, a, b) of shape (B, T, ...) plus A_log, dt_bias (Hv,)."""
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q, k = r(B, T, Hk, K).to(dtype), r(B, T, Hk, K).to(dtype)
    v = r(B, T, Hv, V).to(dtype)
    a, b = r(B, T, Hv).to(dtype), r(B, T, Hv).to(dtype)
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(Hv, generator=gen, device=device)  # noqa: E731
    A_log = torch.log(u(1.0, 16.0))
    dt_bias = torch.log(torch.expm1(u(0.001, 0.1)))
    return q, k, v, a, b, A_log, dt_bias


def front64(q, k, a, b, A_log, dt_bias):
    """The exact gating in fp64 (reference.gating.gdn_front)."""
    return gdn_front(q, k, a, b, A_log, dt_bias, dtype=torch.float64)


def pools(B, Hk, Hv, K=128, V=128, *, cap, fill, gen, device="cuda", buf_dtype=torch.bfloat16,
          null_state_row=None, pad_row=None, spare=5):
    """State and buffer pools with `fill` real entries per row and NaN beyond them (never to be read).

    Slots are a random permutation (rows do not map to slots in order); `spare` extra slots are
    never used by the batch and must come back bit-exact.
    """
    ns = nb = B + spare
    state = 0.5 * torch.randn(ns, Hv, K, V, generator=gen, device=device)
    buf_k = torch.full((nb, cap, Hk, K), float("nan"), device=device, dtype=buf_dtype)
    buf_v = torch.full((nb, cap, Hv, V), float("nan"), device=device, dtype=buf_dtype)
    buf_g = torch.full((nb, cap, Hv), float("nan"), device=device)
    if fill:
        kk = torch.randn(nb, fill, Hk, K, generator=gen, device=device)
        buf_k[:, :fill] = torch.nn.functional.normalize(kk, dim=-1).to(buf_dtype)
        buf_v[:, :fill] = (0.5 * torch.randn(nb, fill, Hv, V, generator=gen, device=device)).to(buf_dtype)
        steps = -(0.02 + 0.5 * torch.rand(nb, fill, Hv, generator=gen, device=device))
        buf_g[:, :fill] = torch.cumsum(steps, dim=1)
    cpu = torch.Generator().manual_seed(gen.initial_seed() + fill)
    state_slots = torch.randperm(ns, generator=cpu)[:B].to(device=device, dtype=torch.int32)
    buffer_slots = torch.randperm(nb, generator=cpu)[:B].to(device=device, dtype=torch.int32)
    if null_state_row is not None and B > null_state_row:
        state_slots[null_state_row] = -1
    if pad_row is not None and B > pad_row:
        buffer_slots[pad_row] = -1
    lengths = torch.full((B,), fill, dtype=torch.int32, device=device)
    return state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths


def bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit-exact equality, NaN payloads included."""
    idt = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.dtype == y.dtype and torch.equal(x.view(idt), y.view(idt))


FP32_CASE = dict(Hk=1, Hv=2, K=64, V=64, cap=16, T_new=5, flush_at=0, BV=32, threads=32)  # fill 6, B = 2


def fp32_accuracy_case(in_dtype: str, device="cpu") -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A verify of FP32_CASE with fp32 buffer entries, so the new deltas are stored unrounded and their
    error against fp64 is the S0 products' own: (the kernel's named arguments, the fp64 output, the
    fp64 new deltas (B, T, Hv, V)). Activations in `in_dtype`."""
    from kvbuffer.reference import core as ref

    c = FP32_CASE
    Hk, Hv, K, V, T, cap, fill, B = c["Hk"], c["Hv"], c["K"], c["V"], c["T_new"], c["cap"], 6, 2
    g = torch.Generator().manual_seed(7)
    dt = getattr(torch, in_dtype)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v, a, b = (t.to(dt) for t in (r(B, T, Hk, K), r(B, T, Hk, K), r(B, T, Hv, V), r(B, T, Hv), r(B, T, Hv)))
    A_log = torch.log(1 + 15 * torch.rand(Hv, generator=g))
    dt_bias = torch.log(torch.expm1(0.001 + 0.1 * torch.rand(Hv, generator=g)))
    state = r(B, Hv, K, V)
    bk = torch.nn.functional.normalize(r(B, cap, Hk, K), dim=-1)
    bv, bg = 0.5 * r(B, cap, Hv, V), torch.cumsum(-(0.02 + 0.5 * torch.rand(B, cap, Hv, generator=g)), dim=1)
    slots, ln = torch.arange(B, dtype=torch.int32), torch.full((B,), fill, dtype=torch.int32)
    rv = bv.double()
    q64, k64, g64, beta64 = gdn_front(q, k, a, b, A_log, dt_bias, dtype=torch.float64)
    want = ref.verify(q64, k64, v.double(), g64, beta64, state.double(), slots.long(), bk.double(), rv,
                      bg.double(), slots.long(), ln.long())
    args = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state, state_slots=slots, buf_k=bk,
                buf_v=bv, buf_g=bg, buffer_slots=slots, lengths=ln, o=torch.full_like(v, float("nan")))
    return {n: t.to(device) for n, t in args.items()}, want, rv[:, fill:fill + T]
