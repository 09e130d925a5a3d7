"""Extreme gates: the buffered form follows the recurrent step where a gate drives the decay to zero.

A gate input of +inf, or 3e38 on consecutive steps, makes a step's log decay -inf (or cumulative sums
that overflow fp32): the recurrence multiplies its state by exp(g) = 0 and stays finite, and the
buffered form must too (reference.core.clamp_log_decay). Runs the reference in fp64 and fp32: step by
step with the flush fused at C, and a speculative verify whose drafts hold the extreme gates.
The templates are checked at the same extremes through the SIMT emulator (test_*_simt_emulated.py).
"""

from __future__ import annotations

import pytest
import torch

from kvbuffer.reference import core, gdn

HUGE = 3e38
STEPS = 24
C = 8
# (step, gate): +inf once, then 3e38 on three consecutive steps, one of them at the fused flush
SCHEDULES = {
    "inf_once": {3: float("inf")},
    "3e38_consecutive": {6: HUGE, 7: HUGE, 8: HUGE},
    "inf_then_3e38_across_flush": {5: float("inf"), 7: HUGE, 8: HUGE, 15: float("inf")},
}
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _rel(x, ref):
    assert bool(torch.isfinite(x).all()), "non-finite output"
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _inputs(dtype, schedule, *, front: str, B=2, Hk=1, Hv=2, K=8, V=8, seed=0):
    """STEPS tokens of GDN gating-front inputs (front 'gdn': a carries the gate) or of the generic core
    (front 'core': g carries it as -gate, beta None: the decay-only form Mamba-2 uses)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q, k, v = r(STEPS, B, Hk, K), r(STEPS, B, Hk, K), r(STEPS, B, Hv, V)
    gate = r(STEPS, B, Hv)
    for step, x in schedule.items():
        gate[step, 0] = x  # row 0 only: row 1 stays ordinary
    if front == "core":
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
        g = -torch.nn.functional.softplus(gate)
        return [(q[t], k[t], v[t], g[t], None) for t in range(STEPS)]
    b = r(STEPS, B, Hv)
    A_log, dt_bias = torch.log(1 + 4 * torch.rand(Hv, generator=gen, dtype=dtype)), torch.zeros(Hv, dtype=dtype)
    return [(q[t], k[t], v[t], gate[t], b[t], A_log, dt_bias) for t in range(STEPS)]


def _pools(dtype, B=2, Hk=1, Hv=2, K=8, V=8, cap=C + 4):
    gen = torch.Generator().manual_seed(1)
    state = torch.randn(B, Hv, K, V, generator=gen, dtype=dtype)
    bufs = (torch.zeros(B, cap, Hk, K, dtype=dtype), torch.zeros(B, cap, Hv, V, dtype=dtype),
            torch.zeros(B, cap, Hv, dtype=dtype))
    slots = torch.arange(B, dtype=torch.int32)
    return state, bufs, slots


def _ops(front):
    return (gdn.recurrent_step, gdn.buffered_step) if front == "gdn" else (core.recurrent_step, core.buffered_step)


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=("fp64", "fp32"))
@pytest.mark.parametrize("front", ("gdn", "core"), ids=("gdn_gate_a", "decay_only_g"))
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_buffered_steps_follow_recurrent_at_extreme_gates(schedule, front, dtype):
    tokens = _inputs(dtype, SCHEDULES[schedule], front=front)
    rec_step, buf_step = _ops(front)
    s_rec, _, slots = _pools(dtype)
    s_buf, bufs, _ = _pools(dtype)
    lengths = torch.zeros(2, dtype=torch.int32)
    errs = []
    for tok in tokens:
        o_rec = rec_step(*tok, s_rec, slots)
        o_buf = buf_step(*tok, s_buf, slots, *bufs, slots, lengths, C)
        errs.append(_rel(o_buf, o_rec))
        lengths = torch.where(core.rows_flushed(slots, lengths, C), 0, lengths + 1).to(torch.int32)
    assert bool(torch.isfinite(bufs[2]).all()), "cumulative log decays must stay finite"
    core.flush(s_buf, slots, *bufs, slots, lengths)
    errs.append(_rel(s_buf, s_rec))
    print(f"\n[extreme] {schedule} {front} {dtype}: max rel err {max(errs):.2e}")
    assert max(errs) < TOL[dtype]


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=("fp64", "fp32"))
def test_verify_with_extreme_drafts_matches_recurrent(dtype):
    """Four drafts after a half-full buffer, an infinite gate on the second and 3e38 on the last two."""
    tokens = _inputs(dtype, {5: float("inf"), 6: HUGE, 7: HUGE}, front="gdn")
    s_rec, _, slots = _pools(dtype)
    s_buf, bufs, _ = _pools(dtype)
    lengths = torch.zeros(2, dtype=torch.int32)
    for tok in tokens[:4]:
        gdn.recurrent_step(*tok, s_rec, slots)
        gdn.buffered_step(*tok, s_buf, slots, *bufs, slots, lengths)
        lengths = lengths + 1
    o_rec = torch.stack([gdn.recurrent_step(*tok, s_rec, slots) for tok in tokens[4:8]], 1)
    drafts = [torch.stack(x, 1) for x in zip(*tokens[4:8])]
    o_buf = gdn.verify(*drafts[:5], *tokens[0][5:], s_buf, slots, *bufs, slots, lengths)
    assert _rel(o_buf, o_rec) < TOL[dtype]


def test_clamp_passes_ordinary_gates_bit_exactly():
    g = torch.tensor([0.0, -1e-30, -3.5, -127.99, core.LOG_DECAY_FLOOR, -128.01, -3e38, float("-inf")])
    out = core.clamp_log_decay(g)
    assert torch.equal(out[:5], g[:5])
    assert bool((out[5:] == core.LOG_DECAY_FLOOR).all())
    assert float(torch.exp(torch.tensor(core.LOG_DECAY_FLOOR + 1.0))) == 0.0  # exactly zero in fp32
