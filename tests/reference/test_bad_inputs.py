"""Bad inputs raise a typed error that names the problem, and leave every pool unchanged."""

import pytest
import torch

from tests.support.families import make_family
from kvbuffer import BufferOverflowError, DTypeError, ShapeError, SlotError
from kvbuffer.pools import BufferPool, StatePool
from kvbuffer.reference import conv, core


@pytest.fixture
def setup():
    fam = make_family("gdn", torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    states = StatePool(fam.shape, 1, 3)
    bufs = BufferPool(fam.shape, 1, 3, entries=4)
    for _ in range(2):
        states.allocate(), bufs.allocate()
    states.state.normal_(generator=gen)
    bufs.keys.normal_(generator=gen)
    return fam, gen, states, bufs


def _snapshot(states, bufs):
    return [t.clone() for t in (states.state, bufs.keys, bufs.values, bufs.log_decay, bufs.lengths)]


def _step(fam, states, bufs, tok, sslots=None, bslots=None, lengths=None, dtype=torch.float32):
    B = tok["q"].shape[0]
    sslots = torch.arange(B, dtype=torch.int32) if sslots is None else sslots
    bslots = torch.arange(B, dtype=torch.int32) if bslots is None else bslots
    lengths = torch.zeros(B, dtype=torch.int32) if lengths is None else lengths
    return fam.ops.buffered_step(*fam.args(tok, dtype), states.layer(0), sslots, *bufs.layer(0).tensors(),
                                 bslots, lengths)


CASES = {
    "wrong k shape": (lambda t: t.update(k=t["k"][:, :, :5]), ShapeError, "k must have shape"),
    "wrong v heads": (lambda t: t.update(v=t["v"][:, :3]), ShapeError, "v must have shape"),
    "integer q": (lambda t: t.update(q=t["q"].long()), DTypeError, "q must have dtype"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_token_tensors(setup, case):
    fam, gen, states, bufs = setup
    mutate, err, msg = CASES[case]
    tok = fam.tokens(gen, 2, dtype=torch.float32)
    mutate(tok)
    before = _snapshot(states, bufs)
    with pytest.raises(err, match=msg):
        fam.ops.buffered_step(tok["q"], tok["k"], tok["v"], tok["a"], tok["b"], fam.params["A_log"].float(),
                              fam.params["dt_bias"].float(), states.layer(0), torch.arange(2, dtype=torch.int32),
                              *bufs.layer(0).tensors(), torch.arange(2, dtype=torch.int32),
                              torch.zeros(2, dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(states, bufs)))


@pytest.mark.parametrize("slots, msg", [
    ([0, 3], "outside"), ([0, -2], "outside"), ([1, 1], "repeats a slot"),
], ids=["past-end", "below-null", "duplicate"])
def test_bad_slots(setup, slots, msg):
    fam, gen, states, bufs = setup
    before = _snapshot(states, bufs)
    with pytest.raises(SlotError, match=msg):
        _step(fam, states, bufs, fam.tokens(gen, 2), bslots=torch.tensor(slots, dtype=torch.int32))
    with pytest.raises(SlotError, match=msg):
        _step(fam, states, bufs, fam.tokens(gen, 2), sslots=torch.tensor(slots, dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(states, bufs)))


def test_float_slots_are_rejected(setup):
    fam, gen, states, bufs = setup
    with pytest.raises(DTypeError, match="buffer_slots must have dtype"):
        _step(fam, states, bufs, fam.tokens(gen, 2), bslots=torch.tensor([0.0, 1.0]))


def test_overflowing_buffer_is_refused(setup):
    fam, gen, states, bufs = setup
    before = _snapshot(states, bufs)
    with pytest.raises(BufferOverflowError, match="capacity is 4"):
        _step(fam, states, bufs, fam.tokens(gen, 2), lengths=torch.tensor([1, 4], dtype=torch.int32))
    with pytest.raises(BufferOverflowError, match="would add 3"):
        tok = fam.tokens(gen, 2, 3, dtype=torch.float32)
        fam.ops.verify(*fam.args(tok, torch.float32), states.layer(0), torch.arange(2, dtype=torch.int32),
                       *bufs.layer(0).tensors(), torch.arange(2, dtype=torch.int32),
                       torch.tensor([0, 2], dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(states, bufs)))


def test_flush_at_beyond_capacity(setup):
    fam, gen, states, bufs = setup
    with pytest.raises(ShapeError, match="exceeds the buffer capacity"):
        fam.ops.buffered_step(*fam.args(fam.tokens(gen, 1), torch.float32), states.layer(0),
                              torch.zeros(1, dtype=torch.int32), *bufs.layer(0).tensors(),
                              torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), flush_at=9)


def test_state_dtype_and_device_checks(setup):
    fam, gen, states, bufs = setup
    with pytest.raises(DTypeError, match="state must have dtype"):
        core.recurrent_step(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.zeros(1, 4, 6), torch.zeros(1, 4),
                            torch.zeros(1, 4), states.layer(0).half(), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        core.recurrent_step([1.0], torch.zeros(1, 2, 8), torch.zeros(1, 4, 6), torch.zeros(1, 4),
                            torch.zeros(1, 4), states.layer(0), torch.zeros(1, dtype=torch.int32))


def test_prefill_that_fills_buffer_needs_a_state(setup):
    fam, gen, states, bufs = setup
    tok = fam.tokens(gen, 5, dtype=torch.float32)
    before = _snapshot(states, bufs)
    with pytest.raises(SlotError, match="allocate a state slot first"):
        fam.ops.prefill(*fam.args(tok, torch.float32), states.layer(0), -1, *bufs.layer(0).tensors(), 0, 0, 4)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(states, bufs)))


def test_conv_rejects_too_many_drafts_and_bad_accept():
    state = torch.zeros(2, 5, 3 + 2)
    w = torch.randn(5, 4)
    with pytest.raises(BufferOverflowError, match="do not fit"):
        conv.conv_verify(torch.randn(1, 3, 5), state, torch.zeros(1, dtype=torch.int32), w)
    with pytest.raises(ShapeError, match="accepted counts"):
        conv.conv_accept(state, torch.zeros(1, dtype=torch.int32), torch.tensor([3]), 4)
    with pytest.raises(ShapeError, match="x must have shape"):
        conv.conv_step(torch.randn(1, 6), state, torch.zeros(1, dtype=torch.int32), w)
