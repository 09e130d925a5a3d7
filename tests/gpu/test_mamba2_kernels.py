"""Mamba-2 (Nemotron-3) TileLang kernels against the fp64 reference (kvbuffer.reference.mamba2), on a CUDA GPU.

Mirrors test_gdn_kernels: fresh random inputs per case, NaN-poisoned outputs, NaN beyond each row's
fill in the buffer (a kernel reading past lengths[b] fails), pool slots outside the batch bit-exact.
Shapes: Nemotron-3 Nano (8 groups, 64 heads x P 64, N 128) and Super (8 groups, 128 heads).
The buffered kernels run in both variants of tiles/mamba2.py: "simt" (tiles/mamba2_simt.py, the
thread-level template and the default, two heads of a group per block; results recorded under m2simt/...)
and "reduce" (the generic template).
"""

from __future__ import annotations

import functools

import pytest
import torch

from kvbuffer.kernels import (
    build_mamba2_buffered,
    build_mamba2_flush,
    build_mamba2_recurrent,
    mamba2_buffered_step,
    mamba2_flush,
    mamba2_prefill,
    mamba2_recurrent_step,
    mamba2_verify,
)
from kvbuffer.reference import core as core_ref
from kvbuffer.reference import mamba2 as ref

from tests.support.gdn_cases import bits_equal, pools, record, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]

SHAPES = {"nano": (8, 64), "super": (8, 128)}  # (groups G, heads H); N = 128, P = 64
N, P = 128, 64
C, CAP = 16, 24
OUT_TOL = 1e-2       # bf16 outputs (rounding alone ~2e-3; TF32 products ~1e-3)
ENTRY_TOL = 1e-2
STATE_TOL = 1e-5     # fp32 state against fp64
# a fused flush weighs S0 by exp(G_C) with G the fp32 cumulative log decay; Mamba-2's |G| reaches ~50
# here (A up to 16), so G carries ~1e-5 absolute error: measured 1.03e-5 max (H200, 2026-11-30, Super B=257)
FUSED_FLUSH_STATE_TOL = 3e-5
BATCHES = [1, 3, 64, 257]
VARIANTS = ["reduce", "simt"]  # mamba2_buffered(variant=...): the generic template and the thread-level one


def _tag(variant: str) -> str:
    return "m2" if variant == "reduce" else f"m2{variant}"


# the recurrent step's value tiles: the default, the H200 tuner's winners (B = 1, B <= 16, B >= 64;
# tiles.linear_decode.RECURRENT_FIRST) and a two-warp small tile
RECURRENT_TILES = {"default": (), "bv8w1": (("BV", 8), ("threads", 32)), "bv32w1": (("BV", 32), ("threads", 32)),
                   "bv64w2": (("BV", 64), ("threads", 64)), "bv16w2": (("BV", 16), ("threads", 64))}


@functools.cache
def recurrent_op(G, H, has_z=True, tile=()):
    return build_mamba2_recurrent(G, H, N, P, has_z=has_z, **dict(tile))


@functools.cache
def buffered_op(G, H, T_new=1, flush_at=C, has_z=True, variant="reduce"):
    """The generic template's kernel, or the thread-level one with the untuned default (two heads per block)."""
    from kvbuffer.tiles.mamba2 import default_buffered_tunables

    extra = ({"variant": "reduce", "threads": 128, "blocks": 0, "heads": 1} if variant == "reduce"
             else default_buffered_tunables(N, P, T_new, H // G))
    return build_mamba2_buffered(G, H, N, P, cap=CAP, T_new=T_new, flush_at=flush_at, has_z=has_z, **extra)


@functools.cache
def flush_op(G, H):
    return build_mamba2_flush(G, H, N, P, cap=CAP)


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def tokens(Bt, T, G, H, *, gen, dtype=torch.bfloat16):
    """Raw Nemotron-H mixer inputs: x, dt (raw), B, C, z (Bt, T, ...) and A_log, dt_bias, D (H,)."""
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    x, dt = r(Bt, T, H, P).to(dtype), r(Bt, T, H).to(dtype)
    Bm, Cm, z = r(Bt, T, G, N).to(dtype), r(Bt, T, G, N).to(dtype), r(Bt, T, H, P).to(dtype)
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(H, generator=gen, device="cuda")  # noqa: E731
    A_log, dt_bias, D = torch.log(u(1.0, 16.0)), torch.log(torch.expm1(u(0.001, 0.1))), u(0.5, 1.5)
    return x, dt, Bm, Cm, z, A_log, dt_bias, D


def _clean(t):
    return torch.nan_to_num(t.clone(), nan=0.0)


def _untouched(before, after, used):
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    keep[used[used >= 0].long()] = False
    return bits_equal(before[keep], after[keep])


def _d(*ts):
    """fp64 copies for the reference (its outputs come back in the inputs' dtype)."""
    return [None if t is None else t.double() for t in ts]


@pytest.mark.parametrize("tile", RECURRENT_TILES)
@pytest.mark.parametrize("has_z", [True, False], ids=["z", "noz"])
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("shape", SHAPES)
def test_recurrent_step(shape, B, has_z, tile):
    G, H = SHAPES[shape]
    g = _gen(100 + B + has_z)
    x, dt, Bm, Cm, z, A_log, dt_bias, D = (t[:, 0] if t.dim() > 1 else t for t in tokens(B, 1, G, H, gen=g))
    z = z if has_z else None
    state, ss, *_ = pools(B, G, H, N, P, cap=CAP, fill=0, gen=g, null_state_row=1)
    before = state.clone()
    out = torch.full_like(x, float("nan"))
    mamba2_recurrent_step(recurrent_op(G, H, has_z, RECURRENT_TILES[tile]), x, dt, A_log, dt_bias, Bm, Cm, D,
                          state, ss, z=z, out=out)
    s64 = before.double()
    x64, dt64, B64, C64, z64 = _d(x, dt, Bm, Cm, z)
    y64 = ref.recurrent_step(x64, dt64, A_log, dt_bias, B64, C64, D, s64, ss, z=z64)
    ey, es = rel_err(out, y64), rel_err(state, s64)
    record(f"m2/recurrent/{shape}/B{B}/{has_z}/{tile}/y", ey)
    record(f"m2/recurrent/{shape}/B{B}/{has_z}/{tile}/state", es)
    assert ey < OUT_TOL and es < STATE_TOL, (ey, es)
    assert _untouched(before, state, ss)
    if B > 1:
        assert bool((out[1] == 0).all()), "a row without state must output exact zeros"


def _run_pair(op, G, H, B, T, fill, seed, *, flush_at, has_z=True):
    g = _gen(seed)
    x, dt, Bm, Cm, z, A_log, dt_bias, D = tokens(B, T, G, H, gen=g)
    z = z if has_z else None
    null_row = 1 if (not flush_at or fill + T < flush_at) else None
    state, ss, bk, bv, bg, bs, ln = pools(B, G, H, N, P, cap=CAP, fill=fill, gen=g, null_state_row=null_row, pad_row=2)
    refs = [t.clone() for t in (state, bk, bv, bg)]
    rk, rv, rg = (_clean(t) for t in (bk, bv, bg))
    out = torch.full_like(x, float("nan"))
    if op["T_new"] == 1 and T == 1:
        mamba2_buffered_step(op, x[:, 0], dt[:, 0], A_log, dt_bias, Bm[:, 0], Cm[:, 0], D, state, ss, bk, bv, bg,
                             bs, ln, z=None if z is None else z[:, 0], out=out[:, 0])
    else:
        mamba2_verify(op, x, dt, A_log, dt_bias, Bm, Cm, D, state, ss, bk, bv, bg, bs, ln, z=z, out=out)
    s64 = refs[0].double()
    x64, dt64, B64, C64, z64 = _d(x, dt, Bm, Cm, z)
    y64 = ref.verify(x64, dt64, A_log, dt_bias, B64, C64, D, s64, ss, rk, rv, rg, bs, ln, z=z64)
    if flush_at:
        full = (bs >= 0) & (ln + T == flush_at)
        if bool(full.any()):
            ref.flush(s64, ss, rk, rv, rg, torch.where(full, bs, torch.full_like(bs, -1)), ln + T)
    return dict(out=out, y64=y64, state=state, s64=s64, before=refs[0], bk=bk, rk=rk, bv=bv, rv=rv, bg=bg, rg=rg,
                ss=ss, bs=bs, ln=ln, bk0=refs[1], bv0=refs[2], bg0=refs[3])


def _check_entries(r, T, tag):
    bs, ln = r["bs"], r["ln"]
    written = torch.zeros(r["bk"].shape[:2], dtype=torch.bool, device=bs.device)
    for row in torch.nonzero(bs >= 0).flatten().tolist():
        written[int(bs[row]), int(ln[row]):int(ln[row]) + T] = True
    ek, ev, eg = (rel_err(r[a][written], r[b][written]) for a, b in (("bk", "rk"), ("bv", "rv"), ("bg", "rg")))
    for name, e in (("buf_k", ek), ("buf_v", ev), ("buf_g", eg)):
        record(f"{tag}/{name}", e)
    assert ek < ENTRY_TOL and ev < ENTRY_TOL and eg < 1e-5, (ek, ev, eg)
    for name in ("bk", "bv", "bg"):
        assert bits_equal(r[name][~written], r[name + "0"][~written]), f"{name} changed outside the new entries"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fill", [0, 1, C - 2, C - 1])
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("shape", SHAPES)
def test_buffered_step(shape, B, fill, variant):
    G, H = SHAPES[shape]
    r = _run_pair(buffered_op(G, H, variant=variant), G, H, B, 1, fill, 2000 + 7 * B + fill, flush_at=C)
    tag = f"{_tag(variant)}/buffered/{shape}/B{B}/n{fill}"
    ey, es = rel_err(r["out"], r["y64"]), rel_err(r["state"], r["s64"])
    record(f"{tag}/y", ey)
    record(f"{tag}/state", es)
    assert ey < OUT_TOL and es < (FUSED_FLUSH_STATE_TOL if fill + 1 == C else STATE_TOL), (ey, es)
    if fill + 1 < C:
        assert bits_equal(r["state"], r["before"]), "a step that does not fill the buffer wrote state"
    else:
        assert _untouched(r["before"], r["state"], torch.where(r["bs"] >= 0, r["ss"], -1))
    if B > 2:
        assert bool((r["out"][2] == 0).all()), "a padding row must output exact zeros"
    _check_entries(r, 1, tag)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", range(1, 9))
@pytest.mark.parametrize("fill", [0, 1, C - 1, C])
@pytest.mark.parametrize("B", [3, 64])
def test_verify(B, fill, T, variant):
    G, H = SHAPES["nano"]
    r = _run_pair(buffered_op(G, H, T, 0, variant=variant), G, H, B, T, fill, 3000 + 11 * T + fill, flush_at=0)
    tag = f"{_tag(variant)}/verify/T{T}/B{B}/n{fill}"
    ey = rel_err(r["out"], r["y64"])
    record(f"{tag}/y", ey)
    assert ey < OUT_TOL
    assert bits_equal(r["state"], r["before"]), "verify wrote state"
    _check_entries(r, T, tag)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [2, 4, 8])
def test_verify_super_noz(T, variant):
    G, H = SHAPES["super"]
    r = _run_pair(buffered_op(G, H, T, 0, False, variant), G, H, 257, T, 5, 3500 + T, flush_at=0, has_z=False)
    ey = rel_err(r["out"], r["y64"])
    record(f"{_tag(variant)}/verify/super/T{T}/B257/y", ey)
    assert ey < OUT_TOL
    _check_entries(r, T, f"{_tag(variant)}/verify/super/T{T}/B257")


@pytest.mark.parametrize("T", [1, 2, 4, 8])
@pytest.mark.parametrize("B", [1, 5, 257])
def test_simt_prefill_chunk_fused_flush(B, T):
    """The thread-level variant's T-token chunk that fills the buffer (n = C - T): outputs, entries, state."""
    G, H = SHAPES["super"]
    r = _run_pair(buffered_op(G, H, T, C, variant="simt"), G, H, B, T, C - T, 3700 + 13 * T + B, flush_at=C)
    tag = f"m2simt/chunk/super/T{T}/B{B}"
    ey, es = rel_err(r["out"], r["y64"]), rel_err(r["state"], r["s64"])
    record(f"{tag}/y", ey)
    record(f"{tag}/state", es)
    assert ey < OUT_TOL and es < FUSED_FLUSH_STATE_TOL, (ey, es)
    assert _untouched(r["before"], r["state"], torch.where(r["bs"] >= 0, r["ss"], -1))
    if B > 2:
        assert bool((r["out"][2] == 0).all()), "a padding row must output exact zeros"
    _check_entries(r, T, tag)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m", range(0, 5))
def test_verify_accept_then_step(m, variant):
    """Verify 4 drafts, accept m (lengths += m), then decode one token: matches the reference path."""
    G, H = SHAPES["nano"]
    T, B, fill = 4, 5, 3
    g = _gen(4000 + m)
    state, ss, bk, bv, bg, bs, ln = pools(B, G, H, N, P, cap=CAP, fill=fill, gen=g)
    x, dt, Bm, Cm, z, A_log, dt_bias, D = tokens(B, T + 1, G, H, gen=g)
    rs, rk, rv, rg = state.double(), _clean(bk), _clean(bv), _clean(bg)
    d = lambda t: t[:, :T].contiguous()  # noqa: E731
    mamba2_verify(buffered_op(G, H, T, 0, variant=variant), d(x), d(dt), A_log, dt_bias, d(Bm), d(Cm), D, state, ss, bk, bv, bg,
                  bs, ln, z=d(z))
    x64, dt64, B64, C64, z64 = _d(x, dt, Bm, Cm, z)
    ref.verify(x64[:, :T], dt64[:, :T], A_log, dt_bias, B64[:, :T], C64[:, :T], D, rs, ss, rk, rv, rg, bs, ln,
               z=z64[:, :T])
    ln2 = ln + m
    e = lambda t: t[:, T].contiguous()  # noqa: E731
    out = torch.full_like(x[:, T], float("nan"))
    mamba2_buffered_step(buffered_op(G, H, variant=variant), e(x), e(dt), A_log, dt_bias, e(Bm), e(Cm), D, state, ss, bk, bv, bg,
                         bs, ln2, z=e(z), out=out)
    y64 = ref.buffered_step(x64[:, T], dt64[:, T], A_log, dt_bias, B64[:, T], C64[:, T], D, rs, ss, rk, rv, rg,
                            bs, ln2, flush_at=C, z=z64[:, T])
    ey = rel_err(out, y64)
    record(f"{_tag(variant)}/accept/m{m}/y", ey)
    assert ey < OUT_TOL


@pytest.mark.parametrize("fill", [0, 1, C - 1, C])
@pytest.mark.parametrize("B", BATCHES)
def test_flush(B, fill):
    G, H = SHAPES["nano"]
    g = _gen(5000 + B + fill)
    state, ss, bk, bv, bg, bs, ln = pools(B, G, H, N, P, cap=CAP, fill=fill, gen=g, pad_row=2)
    before, s64 = state.clone(), state.double()
    mamba2_flush(flush_op(G, H), state, ss, bk, bv, bg, bs, ln)
    core_ref.flush(s64, ss, _clean(bk), _clean(bv), _clean(bg), bs, ln)
    es = rel_err(state, s64)
    record(f"m2/flush/B{B}/n{fill}/state", es)
    assert es < STATE_TOL
    assert _untouched(before, state, torch.where((bs >= 0) & (ln > 0), ss, -1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_chunks(variant):
    """Prefill of a 53-token prompt after 3 buffered entries: verify chunks (8/4/2/1) with fused flushes."""
    G, H = SHAPES["nano"]
    g = _gen(6000)
    state, ss, bk, bv, bg, bs, ln = pools(1, G, H, N, P, cap=CAP, fill=3, gen=g)
    x, dt, Bm, Cm, z, A_log, dt_bias, D = (t[0] if t.dim() > 1 else t for t in tokens(1, 53, G, H, gen=g))
    rs, rk, rv, rg = state.double(), _clean(bk), _clean(bv), _clean(bg)
    ops = {t: buffered_op(G, H, t, C, variant=variant) for t in (8, 4, 2, 1)}
    y, n = mamba2_prefill(ops, x, dt, A_log, dt_bias, Bm, Cm, D, state, int(ss[0]), bk, bv, bg, int(bs[0]), 3, z=z)
    x64, dt64, B64, C64, z64 = _d(x, dt, Bm, Cm, z)
    y64, n64 = ref.prefill(x64, dt64, A_log, dt_bias, B64, C64, D, rs, int(ss[0]), rk, rv, rg, int(bs[0]), 3, C,
                           z=z64)
    ey, es = rel_err(y, y64), rel_err(state, rs)
    record(f"{_tag(variant)}/prefill/T53/y", ey)
    record(f"{_tag(variant)}/prefill/T53/state", es)
    assert n == n64 and ey < OUT_TOL and es < STATE_TOL, (ey, es)


def _run_steps(variant, steps, seed, A_log_of=None):
    """`steps` buffered steps (fused flushes) and recurrent-kernel steps against the fp64 recurrence;
    `A_log_of` {head: value} overrides the layer's A_log. Returns the worst output errors (buffered,
    recurrent kernel), the state errors after a final flush, and the buffer's log decays."""
    G, H = SHAPES["nano"]
    B = 3
    g = _gen(seed)
    state, ss, bk, bv, bg, bs, ln = pools(B, G, H, N, P, cap=CAP, fill=0, gen=g, spare=0)
    s_rec, s64 = state.clone(), state.double()
    op, rop = buffered_op(G, H, variant=variant), recurrent_op(G, H)
    worst_buf = worst_rec = 0.0
    for _ in range(steps):
        x, dt, Bm, Cm, z, A_log, dt_bias, D = (t[:, 0] if t.dim() > 1 else t for t in tokens(B, 1, G, H, gen=g))
        for head, value in (A_log_of or {}).items():
            A_log[head] = value
        y = mamba2_buffered_step(op, x, dt, A_log, dt_bias, Bm, Cm, D, state, ss, bk, bv, bg, bs, ln, z=z)
        y_rec = mamba2_recurrent_step(rop, x, dt, A_log, dt_bias, Bm, Cm, D, s_rec, ss, z=z)
        x64, dt64, B64, C64, z64 = _d(x, dt, Bm, Cm, z)
        y64 = ref.recurrent_step(x64, dt64, A_log, dt_bias, B64, C64, D, s64, ss, z=z64)
        worst_buf, worst_rec = max(worst_buf, rel_err(y, y64)), max(worst_rec, rel_err(y_rec, y64))
        ln += 1
        ln[ln == C] = 0
    mamba2_flush(flush_op(G, H), state, ss, bk, bv, bg, bs, ln)
    return worst_buf, worst_rec, rel_err(state, s64), rel_err(s_rec, s64), bg


@pytest.mark.parametrize("variant", VARIANTS)
def test_long_run_with_flushes(variant):
    """1,000 buffered steps (62 fused flushes) against the fp64 recurrence and our recurrent kernel."""
    worst_buf, worst_rec, es, es_rec, _ = _run_steps(variant, 1000, 7000)
    for name, v in (("buffered/y_max", worst_buf), ("recurrent/y_max", worst_rec),
                    ("buffered/state", es), ("recurrent/state", es_rec)):
        record(f"{_tag(variant)}/long/{name}", v)
    assert worst_buf < 2e-2 and es < 1e-2, (worst_buf, es)
    assert worst_rec < OUT_TOL and es_rec < 1e-4, (worst_rec, es_rec)


def _small_batch_configs():
    from kvbuffer.tiles.mamba2_simt import SMALL_BATCH_CONFIGS

    return [pytest.param(dict(BV=bv, threads=th), id=f"BV{bv}-threads{th}") for bv, th, _ in SMALL_BATCH_CONFIGS]


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("B", [1, 3, 4, 16, 64, 257])
@pytest.mark.parametrize("cfg", _small_batch_configs())
def test_small_batch_configs(cfg, B, T):
    """The narrow value tiles meant for B <= 16 (thread-level variant): a filling step and a 5-token verify."""
    G, H = SHAPES["nano"]
    fill, flush_at = (C - 1, C) if T == 1 else (C - 5, 0)
    op = build_mamba2_buffered(G, H, N, P, cap=CAP, T_new=T, flush_at=flush_at, has_z=True, variant="simt",
                               blocks=0, heads=1, **cfg)
    r = _run_pair(op, G, H, B, T, fill, 3800 + 13 * B + T + cfg["BV"], flush_at=flush_at)
    tag = f"m2simt/small_batch/BV{cfg['BV']}-threads{cfg['threads']}/B{B}/T{T}"
    ey, es = rel_err(r["out"], r["y64"]), rel_err(r["state"], r["s64"])
    record(f"{tag}/y", ey)
    record(f"{tag}/state", es)
    assert ey < OUT_TOL and es < FUSED_FLUSH_STATE_TOL, (ey, es)
    _check_entries(r, T, tag)


@pytest.mark.parametrize("variant", VARIANTS)
def test_extreme_gates_follow_recurrent(variant):
    """Decays at the extremes on every step: head 0 with A_log = +inf (g = -inf), head 1 with A_log = 88
    (g ~ -1e38, whose sums overflow fp32). The buffered kernels stay finite and follow the fp64 recurrence
    across fused flushes (G is clamped, reference.core.clamp_log_decay)."""
    worst_buf, worst_rec, es, _, bg = _run_steps(variant, 48, 7500, {0: float("inf"), 1: 88.0})
    assert bool(torch.isfinite(bg[:, :C]).all()), "cumulative log decays must stay finite"  # entries >= C: never written (NaN-poisoned)
    record(f"{_tag(variant)}/extreme/buffered/y_max", worst_buf)
    record(f"{_tag(variant)}/extreme/buffered/state", es)
    assert worst_buf < 2e-2 and es < 1e-2 and worst_rec < OUT_TOL, (worst_buf, es, worst_rec)
