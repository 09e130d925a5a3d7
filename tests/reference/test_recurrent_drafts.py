"""The servers' speculative verify on the recurrence (reference.*.recurrent_drafts, and the CPU custom ops):
token t's output and the state after it are the recurrent step's after t + 1 steps from the row's state;
the pool's state is only read, padding rows write nothing and output zeros, a row without a state starts
from zero, and bad draft pools are typed errors."""

import pytest
import torch

import kvbuffer.kernels  # noqa: F401  (registers torch.ops.kvbuffer)
from kvbuffer.errors import ShapeError, SlotError
from kvbuffer.reference import gdn, mamba2

B, T, HK, HV, K, V = 4, 3, 2, 4, 8, 8


def _gdn_inputs(g):
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return [r(B, T, HK, K), r(B, T, HK, K), r(B, T, HV, V), r(B, T, HV), r(B, T, HV), r(HV).abs(), r(HV)]


def _m2_inputs(g):
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x, dt, Bm, Cm = r(B, T, HV, V), r(B, T, HV), r(B, T, HK, K), r(B, T, HK, K)
    return [x, dt, r(HV).abs(), r(HV), Bm, Cm, r(HV)]


FAMILIES = {
    "gdn": (_gdn_inputs, gdn.recurrent_drafts, gdn.recurrent_step, torch.ops.kvbuffer.gdn_recurrent_drafts),
    "mamba2": (_m2_inputs, mamba2.recurrent_drafts, mamba2.recurrent_step, torch.ops.kvbuffer.mamba2_recurrent_drafts),
}


def _step_inputs(family, inputs, t):
    """Token t of the per-token inputs (the parameters A_log, dt_bias, D are shared)."""
    shared = {"gdn": (5, 6), "mamba2": (2, 3, 6)}[family]
    return [x if i in shared else x[:, t] for i, x in enumerate(inputs)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("via", ["reference", "op"])
def test_each_token_is_the_recurrent_step_after_it(family, via):
    make, drafts_fn, step_fn, op = FAMILIES[family]
    g = torch.Generator().manual_seed(3)
    inputs = make(g)
    state = torch.randn(6, HV, K, V, generator=g, dtype=torch.float64)
    slots = torch.tensor([4, -1, 0, 2], dtype=torch.int32)       # row 1 has no state yet
    rows = torch.tensor([2, 0, -1, 5], dtype=torch.int32)        # row 2 is padding
    pool = torch.full((7, T + 1, HV, K, V), float("nan"), dtype=torch.float64)
    before_state, before_pool = state.clone(), pool.clone()
    out = (drafts_fn if via == "reference" else op)(*inputs, state, slots, pool, rows)
    assert torch.equal(state, before_state), "the pool's state is only read"
    scratch = torch.zeros(B, HV, K, V, dtype=torch.float64)
    scratch[slots >= 0] = state[slots[slots >= 0].long()]
    live = torch.where(rows >= 0, torch.arange(B, dtype=torch.int32), torch.full_like(rows, -1))
    for t in range(T):
        want = step_fn(*_step_inputs(family, inputs, t), scratch, live)
        assert torch.allclose(out[:, t], want, rtol=1e-12, atol=1e-12), t
        assert torch.allclose(pool[rows[rows >= 0].long(), t], scratch[rows >= 0], rtol=1e-12, atol=1e-12), t
    assert bool((out[2] == 0).all()), "a padding row outputs zeros"
    untouched = torch.ones(7, dtype=torch.bool)
    untouched[rows[rows >= 0].long()] = False
    assert torch.equal(pool[untouched].isnan(), before_pool[untouched].isnan())
    assert bool(pool[rows[rows >= 0].long(), T:].isnan().all()), "tokens past T are not written"


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_draft_pools_are_typed_errors(family):
    make, drafts_fn, _, _ = FAMILIES[family]
    inputs = make(torch.Generator().manual_seed(4))
    state = torch.zeros(6, HV, K, V, dtype=torch.float64)
    slots = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    rows = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    with pytest.raises(ShapeError, match="tokens per row"):
        drafts_fn(*inputs, state, slots, torch.zeros(4, T - 1, HV, K, V, dtype=torch.float64), rows)
    with pytest.raises(SlotError, match="repeats"):
        drafts_fn(*inputs, state, slots, torch.zeros(4, T, HV, K, V, dtype=torch.float64),
                  torch.tensor([0, 1, 1, 3], dtype=torch.int32))
    with pytest.raises(SlotError, match="outside"):
        drafts_fn(*inputs, state, slots, torch.zeros(3, T, HV, K, V, dtype=torch.float64), rows)
