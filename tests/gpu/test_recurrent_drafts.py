"""The servers' recurrent verify in one launch (tiles/recurrent_drafts.py) against the fp64 reference, on a
CUDA GPU: every token's output and the state after every token, for both families, at awkward batches,
with a row without a state (S0 = 0), two rows reading one state, a padding row (zero output, nothing
written) and the pool's state left bit-exact."""

from __future__ import annotations

import functools

import pytest
import torch

from kvbuffer.kernels.gdn import build_gdn_recurrent_drafts, gdn_recurrent_drafts
from kvbuffer.kernels.mamba2 import build_mamba2_recurrent_drafts, mamba2_recurrent_drafts
from kvbuffer.reference import core as gdn_ref
from kvbuffer.reference import mamba2 as m2_ref

from tests.support.gdn_cases import bits_equal, front64, pools, record, rel_err, tokens

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]

OUT_TOL, STATE_TOL = 1e-2, 1e-5  # bf16 outputs; fp32 states against fp64 (as the recurrent step's tests)
TILES = {"default": {}, "bv8w1": {"BV": 8, "threads": 32}, "bv64w2": {"BV": 64, "threads": 64}}
G, H, N, P = 8, 64, 128, 64  # Nemotron-3 Nano's Mamba-2 heads


@functools.cache
def gdn_op(T, tile):
    return build_gdn_recurrent_drafts(16, 32, T_new=T, **TILES[tile])


@functools.cache
def m2_op(T, tile):
    return build_mamba2_recurrent_drafts(G, H, N, P, T_new=T, has_z=True, **TILES[tile])


def _rows(B, spare, gen):
    """Distinct draft rows (a permutation of a larger pool), row 2 padding."""
    cpu = torch.Generator().manual_seed(gen.initial_seed())
    rows = torch.randperm(B + spare, generator=cpu)[:B].to(device="cuda", dtype=torch.int32)
    if B > 2:
        rows[2] = -1
    return rows


def _share_a_slot(slots):
    """Rows 4 and 5 read one state (allowed: the kernel never writes `state`)."""
    if slots.shape[0] > 5:
        slots[5] = slots[4]


def _reference(step, T, state, slots, rows, drafts):
    """(outputs (B, T, ...), the worst relative error of the drafts' states): the reference recurrent step
    run token by token on an fp64 copy of each row's state (zeros for a row without one), each token's
    state compared as it is made (a stack of T fp64 states would not fit beside a B = 257 Mamba-2 pool)."""
    B = slots.shape[0]
    scratch = torch.zeros((B,) + tuple(state.shape[1:]), dtype=torch.float64, device=state.device)
    has = slots >= 0
    scratch[has] = state[slots[has].long()].double()
    live = torch.where(rows >= 0, torch.arange(B, dtype=torch.int32, device=state.device), -1).to(torch.int32)
    real = rows >= 0
    outs, err = [], 0.0
    for t in range(T):
        outs.append(step(t, scratch, live))
        err = max(err, rel_err(drafts[rows[real].long(), t], scratch[real]))
    return torch.stack(outs, 1), err


def _check(tag, out, drafts_after, drafts_before, o64, es, rows, T):
    real = rows >= 0
    eo = rel_err(out[real], o64[real])
    record(f"{tag}/o", eo)
    record(f"{tag}/states", es)
    assert eo < OUT_TOL and es < STATE_TOL, (eo, es)
    assert bool((out[~real] == 0).all()), "a padding row must output exact zeros"
    keep = torch.ones(drafts_before.shape[0], dtype=torch.bool, device=rows.device)
    keep[rows[real].long()] = False
    assert bits_equal(drafts_before[keep], drafts_after[keep]), "rows outside the batch were written"
    assert bits_equal(drafts_before[rows[real].long(), T:], drafts_after[rows[real].long(), T:])


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("T", [1, 2, 5, 8])
@pytest.mark.parametrize("B", [1, 3, 64, 257])
def test_gdn_recurrent_drafts(B, T, tile):
    g = torch.Generator(device="cuda").manual_seed(7000 + 10 * B + T)
    Hk, Hv = 16, 32
    q, k, v, a, b, A_log, dt_bias = tokens(B, T, Hk, Hv, gen=g)
    state, slots, *_ = pools(B, Hk, Hv, cap=T + 1, fill=0, gen=g, null_state_row=1)
    _share_a_slot(slots)
    rows = _rows(B, 4, g)
    drafts = torch.full((B + 4, T + 2, Hv, 128, 128), float("nan"), device="cuda")
    before, drafts_before = state.clone(), drafts.clone()
    out = torch.full_like(v, float("nan"))
    gdn_recurrent_drafts(gdn_op(T, tile), q, k, v, a, b, A_log, dt_bias, state, slots, drafts, rows, out=out)
    q64, k64, g64, beta64 = front64(q, k, a, b, A_log, dt_bias)
    v64 = v.double()

    def step(t, scratch, live):
        return gdn_ref.recurrent_step(q64[:, t], k64[:, t], v64[:, t], g64[:, t], beta64[:, t], scratch, live)

    o64, es = _reference(step, T, before, slots, rows, drafts)
    _check(f"drafts/gdn/B{B}/T{T}/{tile}", out, drafts, drafts_before, o64, es, rows, T)
    assert bits_equal(before, state), "the pool's state must not be written"


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("T", [1, 5, 8])
@pytest.mark.parametrize("B", [1, 3, 257])
def test_mamba2_recurrent_drafts(B, T, tile):
    g = torch.Generator(device="cuda").manual_seed(8000 + 10 * B + T)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x, dt, Bm, Cm, z = (r(B, T, H, P), r(B, T, H), r(B, T, G, N), r(B, T, G, N), r(B, T, H, P))
    x, dt, Bm, Cm, z = (t.to(torch.bfloat16) for t in (x, dt, Bm, Cm, z))
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(H, generator=g, device="cuda")  # noqa: E731
    A_log, dt_bias, D = torch.log(u(1.0, 16.0)), torch.log(torch.expm1(u(0.001, 0.1))), u(0.5, 1.5)
    state, slots, *_ = pools(B, G, H, N, P, cap=T + 1, fill=0, gen=g, null_state_row=1)
    _share_a_slot(slots)
    rows = _rows(B, 3, g)
    drafts = torch.full((B + 3, T + 1, H, N, P), float("nan"), device="cuda")
    before, drafts_before = state.clone(), drafts.clone()
    out = torch.full_like(x, float("nan"))
    mamba2_recurrent_drafts(m2_op(T, tile), x, dt, A_log, dt_bias, Bm, Cm, D, state, slots, drafts, rows, z=z,
                            out=out)
    d = lambda t: t.double()  # noqa: E731

    def step(t, scratch, live):
        return m2_ref.recurrent_step(d(x[:, t]), d(dt[:, t]), A_log, dt_bias, d(Bm[:, t]), d(Cm[:, t]), D, scratch,
                                     live, z=d(z[:, t]))

    o64, es = _reference(step, T, before, slots, rows, drafts)
    _check(f"drafts/m2/B{B}/T{T}/{tile}", out, drafts, drafts_before, o64, es, rows, T)
    assert bits_equal(before, state), "the pool's state must not be written"


def test_bad_draft_pools_are_typed_errors_and_write_nothing():
    from kvbuffer.errors import ShapeError, SlotError

    g = torch.Generator(device="cuda").manual_seed(9)
    q, k, v, a, b, A_log, dt_bias = tokens(3, 5, 16, 32, gen=g)
    state, slots, *_ = pools(3, 16, 32, cap=6, fill=0, gen=g)
    op = gdn_op(5, "default")
    cases = {
        "too few tokens per row": (torch.zeros(4, 4, 32, 128, 128, device="cuda"),
                                   torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda"), ShapeError),
        "two rows, one draft row": (torch.zeros(4, 5, 32, 128, 128, device="cuda"),
                                    torch.tensor([0, 1, 1], dtype=torch.int32, device="cuda"), SlotError),
        "a draft row out of range": (torch.zeros(2, 5, 32, 128, 128, device="cuda"),
                                     torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda"), SlotError),
    }
    for name, (drafts, rows, error) in cases.items():
        before = drafts.clone()
        with pytest.raises(error):
            gdn_recurrent_drafts(op, q, k, v, a, b, A_log, dt_bias, state, slots, drafts, rows)
        assert bits_equal(before, drafts), name
