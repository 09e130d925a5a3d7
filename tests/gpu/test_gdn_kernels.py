"""Gated DeltaNet TileLang kernels against the fp64 reference (kvbuffer.reference), on a CUDA GPU.

Each case draws fresh random inputs, poisons the outputs with NaN, fills unused buffer positions
with NaN (a kernel that reads past lengths[b] fails), and checks that pool slots outside the batch
come back bit-exact. Error figures go to $KVB_ERROR_LOG when set.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kvbuffer.reference import core as ref
from kvbuffer.kernels import (
    build_gdn_buffered,
    build_gdn_flush,
    build_gdn_recurrent,
    gdn_buffered_step,
    gdn_flush,
    gdn_prefill,
    gdn_recurrent_step,
    gdn_verify,
)

from tests.support.gdn_cases import (FP32_CASE, bits_equal, fp32_accuracy_case, front64, pools, record, rel_err,
                                     tokens)

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]

HEADS = {"ratio1": (16, 16), "ratio2": (16, 32), "ratio4": (8, 32)}  # (Hk, Hv)
C, CAP = 16, 24      # flush_at, buffer capacity (room for 8 drafts after C-1 entries)
OUT_TOL = 1e-2       # bf16 outputs: rounding alone is ~2e-3
ENTRY_TOL = 1e-2     # bf16 buffer entries
STATE_TOL = 1e-5     # fp32 state against fp64
FUSED_FLUSH_STATE_TOL = 3e-5  # a step that folds its buffer: fp32 rank-C update of every config (as Mamba-2's)
BATCHES = [1, 3, 64, 257]
# the S0 products on CUDA cores (the template's defaults) or on tensor cores (tiles.simt_parts.mma_products)
PRODUCTS = {"simt": {}, "tensor_cores": {"BV": 128, "threads": 128, "blocks": 3, "tensor_cores": 1}}
# verifies also run `lean` (two tokens or more; an untuned verify's default below the tensor-core width)
VERIFY_PRODUCTS = {**PRODUCTS, "lean": {"BV": 128, "threads": 128, "blocks": 3, "lean": 1}}
VERIFY_CASES = [(T, p) for T in range(1, 9) for p in VERIFY_PRODUCTS if T > 1 or p != "lean"]


def step_tunables(products: str) -> dict:
    """The step a verify of `products` is followed by: the same tile (a step has no lean form)."""
    return {k: v for k, v in VERIFY_PRODUCTS[products].items() if k != "lean"}


# the recurrent step's value tiles: the default, the H200 tuner's winners (B = 1, B <= 16, B >= 64;
# tiles.linear_decode.RECURRENT_FIRST) and a two-warp small tile
RECURRENT_TILES = {"default": (), "bv8w1": (("BV", 8), ("threads", 32)), "bv32w1": (("BV", 32), ("threads", 32)),
                   "bv64w2": (("BV", 64), ("threads", 64)), "bv16w2": (("BV", 16), ("threads", 64))}


@functools.cache
def recurrent_op(Hk, Hv, tile=()):
    return build_gdn_recurrent(Hk, Hv, **dict(tile))


@functools.cache
def buffered_op(Hk, Hv, T_new=1, flush_at=C, **tunables):
    return build_gdn_buffered(Hk, Hv, cap=CAP, T_new=T_new, flush_at=flush_at, **tunables)


@functools.cache
def flush_op(Hk, Hv):
    return build_gdn_flush(Hk, Hv, cap=CAP)


def _clean(t):
    """The reference reads every buffer position and masks by weight (0 * NaN = NaN), so it gets a
    copy with the NaN poison beyond lengths zeroed; the kernels get the poisoned pools."""
    return torch.nan_to_num(t.clone(), nan=0.0)


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _untouched(before, after, used):
    """Pool slots not in `used` are bit-exact."""
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    keep[used[used >= 0].long()] = False
    return bits_equal(before[keep], after[keep])


@pytest.mark.parametrize("tile", RECURRENT_TILES)
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("heads", HEADS)
def test_recurrent_step(heads, B, tile):
    Hk, Hv = HEADS[heads]
    g = _gen(1000 + B)
    q, k, v, a, b, A_log, dt_bias = (t[:, 0] if t.dim() > 1 else t for t in tokens(B, 1, Hk, Hv, gen=g))
    state, slots, *_ = pools(B, Hk, Hv, cap=CAP, fill=0, gen=g, null_state_row=1)
    before = state.clone()
    out = torch.full_like(v, float("nan"))
    gdn_recurrent_step(recurrent_op(Hk, Hv, RECURRENT_TILES[tile]), q, k, v, a, b, A_log, dt_bias, state, slots,
                       out=out)
    q64, k64, g64, beta64 = front64(q, k, a, b, A_log, dt_bias)
    s64 = before.double()
    o64 = ref.recurrent_step(q64, k64, v.double(), g64, beta64, s64, slots)
    eo, es = rel_err(out, o64), rel_err(state, s64)
    record(f"recurrent/{heads}/B{B}/{tile}/o", eo)
    record(f"recurrent/{heads}/B{B}/{tile}/state", es)
    assert eo < OUT_TOL and es < STATE_TOL
    assert _untouched(before, state, slots)


def _run_buffered_pair(op, Hk, Hv, B, T, fill, seed, *, flush_at):
    g = _gen(seed)
    q, k, v, a, b, A_log, dt_bias = tokens(B, T, Hk, Hv, gen=g)
    null_row = 1 if (not flush_at or fill + T < flush_at) else None  # a short context: no state yet
    state, ss, bk, bv, bg, bs, ln = pools(B, Hk, Hv, cap=CAP, fill=fill, gen=g, null_state_row=null_row, pad_row=2)
    refs = [t.clone() for t in (state, bk, bv, bg)]
    clean = [_clean(t) for t in (bk, bv, bg)]
    out = torch.full_like(v, float("nan"))
    if T == 1 and op["T_new"] == 1:
        gdn_buffered_step(op, q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], A_log, dt_bias, state, ss,
                          bk, bv, bg, bs, ln, out=out[:, 0])
    else:
        gdn_verify(op, q, k, v, a, b, A_log, dt_bias, state, ss, bk, bv, bg, bs, ln, out=out)
    q64, k64, g64, beta64 = front64(q, k, a, b, A_log, dt_bias)
    s64 = refs[0].double()
    rk, rv, rg = clean
    o64 = ref.verify(q64, k64, v.double(), g64, beta64, s64, ss, rk, rv, rg, bs, ln)
    if flush_at:
        full = (bs >= 0) & (ln + T == flush_at)
        if bool(full.any()):
            keep = torch.where(full, bs, torch.full_like(bs, -1))
            ref.flush(s64, ss, rk, rv, rg, keep, ln + T)
    return dict(out=out, o64=o64, state=state, s64=s64, before=refs[0], bk=bk, rk=rk, bv=bv, rv=rv,
                bg=bg, rg=rg, ss=ss, bs=bs, ln=ln, bk0=refs[1], bv0=refs[2], bg0=refs[3])


def _check_entries(r, T, tag):
    """New entries at n..n+T-1 match; every other buffer position is bit-exact (NaN stays NaN)."""
    bs, ln = r["bs"], r["ln"]
    rows = bs >= 0
    written = torch.zeros(r["bk"].shape[:2], dtype=torch.bool, device=bs.device)
    for row in torch.nonzero(rows).flatten().tolist():
        n = int(ln[row])
        written[int(bs[row]), n:n + T] = True
    ek = rel_err(r["bk"][written], r["rk"][written])
    ev = rel_err(r["bv"][written], r["rv"][written])
    eg = rel_err(r["bg"][written], r["rg"][written])
    record(f"{tag}/buf_k", ek)
    record(f"{tag}/buf_v", ev)
    record(f"{tag}/buf_g", eg)
    assert ek < ENTRY_TOL and ev < ENTRY_TOL and eg < 1e-5, (ek, ev, eg)
    for name in ("bk", "bv", "bg"):
        assert bits_equal(r[name][~written], r[name + "0"][~written]), f"{name} changed outside the new entries"


@pytest.mark.parametrize("fill", [0, 1, C - 2, C - 1])
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("heads", HEADS)
def test_buffered_step(heads, B, fill):
    Hk, Hv = HEADS[heads]
    r = _run_buffered_pair(buffered_op(Hk, Hv), Hk, Hv, B, 1, fill, 2000 + 7 * B + fill, flush_at=C)
    tag = f"buffered/{heads}/B{B}/n{fill}"
    eo = rel_err(r["out"], r["o64"])
    record(f"{tag}/o", eo)
    assert eo < OUT_TOL
    es = rel_err(r["state"], r["s64"])
    record(f"{tag}/state", es)
    assert es < (FUSED_FLUSH_STATE_TOL if fill + 1 == C else STATE_TOL)  # the same bound as test_buffered_configs'
    if fill + 1 < C:
        assert bits_equal(r["state"], r["before"]), "a step that does not fill the buffer wrote state"
    else:
        assert _untouched(r["before"], r["state"], torch.where(r["bs"] >= 0, r["ss"], -1))
    _check_entries(r, 1, tag)


@pytest.mark.parametrize("T,products", VERIFY_CASES)
@pytest.mark.parametrize("fill", [0, 1, C - 1, C])
@pytest.mark.parametrize("B", [1, 3, 4, 16, 64, 257])
def test_verify(B, fill, T, products):
    Hk, Hv = HEADS["ratio2"]
    op = buffered_op(Hk, Hv, T, 0, **VERIFY_PRODUCTS[products])
    r = _run_buffered_pair(op, Hk, Hv, B, T, fill, 3000 + 11 * T + fill, flush_at=0)
    tag = f"verify/{products}/T{T}/B{B}/n{fill}"
    eo = rel_err(r["out"], r["o64"])
    record(f"{tag}/o", eo)
    assert eo < OUT_TOL
    assert bits_equal(r["state"], r["before"]), "verify wrote state"
    _check_entries(r, T, tag)


def _config_cases():
    """(config, T) for a filling step (T = 1) and a 4-draft verify, as the tuner offers them: `lean`
    needs two tokens or more."""
    from kvbuffer.tiles.gdn import get_buffered_configs

    return [pytest.param(c, T, id="-".join(f"{k}{v}" for k, v in c.items()) + f"-{T}")
            for T in (1, 4) for c in get_buffered_configs() if T > 1 or not c.get("lean")]


@pytest.mark.parametrize("B", [1, 3, 4, 16, 64, 257])
@pytest.mark.parametrize("cfg,T", _config_cases())
def test_buffered_configs(cfg, T, B):
    """Every tunable config the tuner may pick (the small-batch ones included, hence B down to 1): a filling
    step (fused flush) and a 4-draft verify."""
    Hk, Hv = HEADS["ratio2"]
    fill, flush_at = (C - 1, C) if T == 1 else (5, 0)
    op = buffered_op(Hk, Hv, T, flush_at, **cfg)
    r = _run_buffered_pair(op, Hk, Hv, B, T, fill, 3700 + T + B + cfg["BV"] + cfg["threads"], flush_at=flush_at)
    tag = "configs/" + "-".join(f"{k}{v}" for k, v in cfg.items()) + f"/T{T}/B{B}"
    eo, es = rel_err(r["out"], r["o64"]), rel_err(r["state"], r["s64"])
    record(f"{tag}/o", eo)
    record(f"{tag}/state", es)
    assert eo < OUT_TOL and es < (FUSED_FLUSH_STATE_TOL if flush_at else STATE_TOL)
    _check_entries(r, T, tag)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("T", [2, 4, 8])
def test_verify_heads(heads, T):
    Hk, Hv = HEADS[heads]
    r = _run_buffered_pair(buffered_op(Hk, Hv, T, 0), Hk, Hv, 257, T, 5, 3500 + T, flush_at=0)
    eo = rel_err(r["out"], r["o64"])
    record(f"verify/{heads}/T{T}/B257/o", eo)
    assert eo < OUT_TOL
    _check_entries(r, T, f"verify/{heads}/T{T}/B257")


@pytest.mark.parametrize("products", VERIFY_PRODUCTS)
@pytest.mark.parametrize("m", range(0, 5))
def test_verify_accept_then_step(m, products):
    """Verify 4 drafts, accept m (lengths += m), then decode one token: matches the reference path."""
    Hk, Hv = HEADS["ratio2"]
    T, B, fill = 4, 5, 3
    g = _gen(4000 + m)
    state, ss, bk, bv, bg, bs, ln = pools(B, Hk, Hv, cap=CAP, fill=fill, gen=g)
    q, k, v, a, b, A_log, dt_bias = tokens(B, T + 1, Hk, Hv, gen=g)
    rs, rk, rv, rg = state.double(), _clean(bk), _clean(bv), _clean(bg)
    d = lambda t: t[:, :T].contiguous()  # noqa: E731
    gdn_verify(buffered_op(Hk, Hv, T, 0, **VERIFY_PRODUCTS[products]), d(q), d(k), d(v), d(a), d(b), A_log, dt_bias,
               state, ss, bk, bv, bg, bs, ln)
    q64, k64, g64, beta64 = front64(q, k, a, b, A_log, dt_bias)
    ref.verify(q64[:, :T], k64[:, :T], v[:, :T].double(), g64[:, :T], beta64[:, :T], rs, ss, rk, rv, rg, bs, ln)
    ln2 = ln + m
    out = torch.full_like(v[:, T], float("nan"))
    e = lambda t: t[:, T].contiguous()  # noqa: E731
    step = buffered_op(Hk, Hv, 1, C, **step_tunables(products))
    gdn_buffered_step(step, e(q), e(k), e(v), e(a), e(b), A_log, dt_bias,
                      state, ss, bk, bv, bg, bs, ln2, out=out)
    o64 = ref.buffered_step(q64[:, T], k64[:, T], v[:, T].double(), g64[:, T], beta64[:, T], rs, ss,
                            rk, rv, rg, bs, ln2, flush_at=C)
    eo = rel_err(out, o64)
    record(f"accept/{products}/m{m}/o", eo)
    assert eo < OUT_TOL


@pytest.mark.parametrize("fill", [0, 1, C - 1, C])
@pytest.mark.parametrize("B", BATCHES)
def test_flush(B, fill):
    Hk, Hv = HEADS["ratio2"]
    g = _gen(5000 + B + fill)
    state, ss, bk, bv, bg, bs, ln = pools(B, Hk, Hv, cap=CAP, fill=fill, gen=g, pad_row=2)
    before, s64 = state.clone(), state.double()
    gdn_flush(flush_op(Hk, Hv), state, ss, bk, bv, bg, bs, ln)
    ref.flush(s64, ss, _clean(bk), _clean(bv), _clean(bg), bs, ln)
    es = rel_err(state, s64)
    record(f"flush/B{B}/n{fill}/state", es)
    assert es < STATE_TOL
    touched = torch.where((bs >= 0) & (ln > 0), ss, -1)
    assert _untouched(before, state, touched)


def test_prefill_chunks():
    """Prefill of a 53-token prompt after 3 buffered entries: verify chunks (8/4/2/1) with fused flushes."""
    Hk, Hv = HEADS["ratio2"]
    g = _gen(6000)
    state, ss, bk, bv, bg, bs, ln = pools(1, Hk, Hv, cap=CAP, fill=3, gen=g)
    q, k, v, a, b, A_log, dt_bias = (t[0] if t.dim() > 1 else t for t in tokens(1, 53, Hk, Hv, gen=g))
    rs, rk, rv, rg = state.double(), _clean(bk), _clean(bv), _clean(bg)
    ops = {t: buffered_op(Hk, Hv, t, C) for t in (8, 4, 2, 1)}
    o, n = gdn_prefill(ops, q, k, v, a, b, A_log, dt_bias, state, int(ss[0]), bk, bv, bg, int(bs[0]), 3)
    q64, k64, g64, beta64 = front64(q, k, a, b, A_log, dt_bias)
    o64, n64 = ref.prefill(q64, k64, v.double(), g64, beta64, rs, int(ss[0]), rk, rv, rg, int(bs[0]), 3, C)
    eo, es = rel_err(o, o64), rel_err(state, rs)
    record("prefill/T53/o", eo)
    record("prefill/T53/state", es)
    # 3 flushes of bf16 entries: a 1-ulp bf16 rounding difference (fp32 vs fp64 delta) moves the state
    # by ~4e-5 (measured on H200, 2026-11-30), hence a looser bound than one flush
    assert n == n64 and eo < OUT_TOL and es < 1e-4


def _run_steps(steps, seed, gates=None, tunables=None):
    """`steps` buffered steps (fused flushes) and recurrent-kernel steps against the fp64 *recurrent* form;
    `gates` {step: value} overrides row 0's gate input a. Returns the worst output errors (buffered,
    recurrent kernel), the state errors after a final flush, and the buffer's log decays. `tunables`: the
    buffered kernel's (default: the template's)."""
    Hk, Hv = HEADS["ratio2"]
    B = 3
    g = _gen(seed)
    state, ss, bk, bv, bg, bs, ln = pools(B, Hk, Hv, cap=CAP, fill=0, gen=g, spare=0)
    s_rec, s64 = state.clone(), state.double()
    op, rop = buffered_op(Hk, Hv, 1, C, **(tunables or {})), recurrent_op(Hk, Hv)
    worst_buf, worst_rec = 0.0, 0.0
    for t in range(steps):
        q, k, v, a, b, A_log, dt_bias = (x[:, 0] if x.dim() > 1 else x for x in tokens(B, 1, Hk, Hv, gen=g))
        if gates and t in gates:
            a[0] = gates[t]
        o = gdn_buffered_step(op, q, k, v, a, b, A_log, dt_bias, state, ss, bk, bv, bg, bs, ln)
        o_rec = gdn_recurrent_step(rop, q, k, v, a, b, A_log, dt_bias, s_rec, ss)
        q64, k64, g64, beta64 = front64(q, k, a, b, A_log, dt_bias)
        o64 = ref.recurrent_step(q64, k64, v.double(), g64, beta64, s64, ss)
        worst_buf = max(worst_buf, rel_err(o, o64))
        worst_rec = max(worst_rec, rel_err(o_rec, o64))
        ln += 1
        ln[ln == C] = 0  # the fused flush emptied those rows
    gdn_flush(flush_op(Hk, Hv), state, ss, bk, bv, bg, bs, ln)
    return worst_buf, worst_rec, rel_err(state, s64), rel_err(s_rec, s64), bg


@pytest.mark.parametrize("products", PRODUCTS)
def test_long_run_with_flushes(products):
    """2,000 buffered steps (125 fused flushes) against the fp64 *recurrent* form, and our recurrent kernel."""
    worst_buf, worst_rec, es, es_rec, _ = _run_steps(2000, 7000, tunables=PRODUCTS[products])
    record(f"long/buffered/{products}/o_max", worst_buf)
    record("long/recurrent/o_max", worst_rec)
    record(f"long/buffered/{products}/state", es)
    record("long/recurrent/state", es_rec)
    assert worst_buf < 2e-2 and es < 1e-2, (worst_buf, es)
    assert worst_rec < OUT_TOL and es_rec < 1e-4


EXTREME_GATES = {5: float("inf"), 14: 3e38, 15: 3e38, 16: 3e38, 40: float("inf")}  # step: gate input a


def test_extreme_gates_follow_recurrent():
    """Gate inputs of +inf, and 3e38 on consecutive steps across a fused flush, on row 0: the buffered
    kernel stays finite and follows the fp64 recurrent form (G is clamped, reference.core.clamp_log_decay)."""
    worst_buf, worst_rec, es, _, bg = _run_steps(64, 7500, EXTREME_GATES)
    assert bool(torch.isfinite(bg[:, :C]).all()), "cumulative log decays must stay finite"  # entries >= C: never written (NaN-poisoned)
    record("extreme/buffered/o_max", worst_buf)
    record("extreme/buffered/state", es)
    assert worst_buf < 2e-2 and es < 1e-2 and worst_rec < OUT_TOL, (worst_buf, es, worst_rec)


@pytest.mark.parametrize("products", VERIFY_PRODUCTS)
def test_extreme_gates_in_drafts(products):
    """A 4-draft verify whose drafts carry gate inputs +inf and 3e38: matches the fp64 reference verify."""
    Hk, Hv = HEADS["ratio2"]
    T, B = 4, 5
    g = _gen(7600)
    state, ss, bk, bv, bg, bs, ln = pools(B, Hk, Hv, cap=CAP, fill=7, gen=g)
    q, k, v, a, b, A_log, dt_bias = tokens(B, T, Hk, Hv, gen=g)
    a[0, 1], a[1, 2:] = float("inf"), 3e38
    rs, rk, rv, rg = state.double(), _clean(bk), _clean(bv), _clean(bg)
    out = torch.full_like(v, float("nan"))
    gdn_verify(buffered_op(Hk, Hv, T, 0, **VERIFY_PRODUCTS[products]), q, k, v, a, b, A_log, dt_bias, state, ss, bk, bv, bg, bs,
               ln, out=out)
    q64, k64, g64, beta64 = front64(q, k, a, b, A_log, dt_bias)
    o64 = ref.verify(q64, k64, v.double(), g64, beta64, rs, ss, rk, rv, rg, bs, ln)
    eo = rel_err(out, o64)
    record(f"extreme/verify/{products}/o", eo)
    assert eo < OUT_TOL


@pytest.mark.parametrize("tensor_cores,in_dtype", [(0, "bfloat16"), (1, "bfloat16"), (1, "float32")])
def test_s0_products_keep_fp32_accuracy_on_the_device(tensor_cores, in_dtype):
    """The CPU emulator's fp32-accuracy case on the GPU's tensor cores, whose accumulation order the emulator
    does not model: the new deltas (stored as fp32) within 5e-6 of fp64, where one TF32 product leaves ~7e-5."""
    params = {k: v for k, v in FP32_CASE.items() if k not in ("Hk", "Hv", "K", "V")}
    op = build_gdn_buffered(FP32_CASE["Hk"], FP32_CASE["Hv"], FP32_CASE["K"], FP32_CASE["V"], **params,
                            tensor_cores=tensor_cores, in_dtype=in_dtype, buf_dtype="float32")
    args, want, deltas = fp32_accuracy_case(in_dtype, device="cuda")
    fill, T = int(args["lengths"][0]), FP32_CASE["T_new"]
    op.fn(*args.values())
    ed = rel_err(args["buf_v"][:, fill:fill + T], deltas.cuda())
    record(f"fp32_accuracy/tc{tensor_cores}/{in_dtype}/deltas", ed)
    assert ed < 5e-6
    if in_dtype == "float32":
        assert rel_err(args["o"], want.cuda()) < 5e-6
