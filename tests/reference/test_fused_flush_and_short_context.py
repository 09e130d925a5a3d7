"""The flush fused into the step that fills the buffer, and requests that never need a state."""

import pytest
import torch

from tests.support.families import FAMILIES, make_family
from kvbuffer.pools import BufferPool, StatePool
from kvbuffer.reference import core


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("C", [1, 5, 8])
def test_fused_flush_matches_recurrent(family, C):
    """Rows start at different fills, so in each step some rows flush and others do not."""
    fam = make_family(family, torch.Generator().manual_seed(C))
    gen = torch.Generator().manual_seed(100 + C)
    B, steps, f64 = 5, 60, torch.float64
    states = StatePool(fam.shape, 1, B, dtype=f64)
    bufs = BufferPool(fam.shape, 1, B, entries=C, dtype=f64, log_decay_dtype=f64)
    ref = StatePool(fam.shape, 1, B, dtype=f64)
    rows = torch.arange(B, dtype=torch.int32)
    for _ in range(B):
        states.allocate(), bufs.allocate(), ref.allocate()
    # warm each row up to a different fill with plain steps
    for r in range(B):
        for _ in range(r % C):
            tok = fam.tokens(gen, 1)
            one = rows[r:r + 1]
            o = fam.ops.buffered_step(*fam.args(tok), states.layer(0), one, *bufs.layer(0).tensors(), one,
                                      bufs.batch_lengths([r]))
            bufs.accept(r, 1)
            o_ref = fam.ops.recurrent_step(*fam.args(tok), ref.layer(0), one)
            torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    worst = 0.0
    for _ in range(steps):
        tok = fam.tokens(gen, B)
        lengths = bufs.batch_lengths(list(range(B)))
        flushed = core.rows_flushed(rows, lengths, C)
        o = fam.ops.buffered_step(*fam.args(tok), states.layer(0), rows, *bufs.layer(0).tensors(), rows, lengths,
                                  flush_at=C)
        for r in range(B):
            bufs.reset(r) if bool(flushed[r]) else bufs.accept(r, 1)
        o_ref = fam.ops.recurrent_step(*fam.args(tok), ref.layer(0), rows)
        worst = max(worst, float((o - o_ref).abs().max()))
    assert worst <= 1e-12
    # rows whose buffer is empty now hold exactly the recurrent state
    for r in range(B):
        if bufs.length(r) == 0:
            torch.testing.assert_close(states.state[0, r], ref.state[0, r], rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_short_context_never_allocates_a_state(family):
    """Prompt + generated tokens below the flush size C: served from the buffer alone, S0 = 0."""
    fam = make_family(family, torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(8)
    C, f64 = 12, torch.float64
    states = StatePool(fam.shape, 1, 1, dtype=f64)
    bufs = BufferPool(fam.shape, 1, 2, entries=C, dtype=f64, log_decay_dtype=f64)
    ref = StatePool(fam.shape, 1, 1, dtype=f64)
    ref_slot, slot = ref.allocate(), bufs.allocate()
    one = torch.tensor([slot], dtype=torch.int32)
    prompt = fam.tokens(gen, 7)
    o, n = fam.ops.prefill(*fam.args(prompt), states.layer(0), -1, *bufs.layer(0).tensors(), slot, 0, C)
    bufs.accept(slot, n)
    ref_o = torch.cat([fam.ops.recurrent_step(*fam.args(fam.slice_tokens(prompt, slice(t, t + 1))), ref.layer(0),
                                              torch.tensor([ref_slot], dtype=torch.int32)) for t in range(7)])
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-12)
    for _ in range(C - 1 - 7):
        tok = fam.tokens(gen, 1)
        o = fam.ops.buffered_step(*fam.args(tok), states.layer(0), torch.tensor([-1], dtype=torch.int32),
                                  *bufs.layer(0).tensors(), one, bufs.batch_lengths([slot]), flush_at=C)
        bufs.accept(slot, 1)
        ref_o = fam.ops.recurrent_step(*fam.args(tok), ref.layer(0), torch.tensor([ref_slot], dtype=torch.int32))
        torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-12)
    assert bufs.length(slot) == C - 1
    assert states.slots.num_free == 1 and states.state.abs().sum() == 0
