"""Pools: fixed capacity, null-slot convention, no leakage between requests that reuse a slot."""

import pytest
import torch

from tests.support.families import make_family
from kvbuffer import (BufferOverflowError, BufferPool, ConvPool, LinearLayerShape, PoolExhaustedError,
                      SlotAllocator, SlotError, StatePool)
from kvbuffer.reference import core

SHAPE = LinearLayerShape(2, 4, 8, 6)


def test_allocator_hands_out_lowest_free_slot_and_rejects_misuse():
    a = SlotAllocator(3)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(PoolExhaustedError, match="all 3 slots"):
        a.allocate()
    a.free(1)
    with pytest.raises(SlotError, match="not allocated"):
        a.free(1)
    with pytest.raises(SlotError, match="outside"):
        a.free(7)
    assert a.allocate() == 1


def test_layer_shape_rejects_bad_grouping():
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        LinearLayerShape(3, 4, 8, 8)


def test_reused_slots_start_empty():
    """A request that gets a freed slot sees a zero state, an empty buffer and a zero conv history."""
    states, bufs = StatePool(SHAPE, 2, 2), BufferPool(SHAPE, 2, 2, entries=4)
    conv = ConvPool(conv_dim=5, width=4, num_layers=2, capacity=2)
    s, b, c = states.allocate(), bufs.allocate(), conv.allocate()
    states.state[:, s] = 1.0
    bufs.keys[:, b] = 1.0
    bufs.values[:, b] = 1.0
    bufs.log_decay[:, b] = -1.0
    bufs.accept(b, 3)
    conv.state[:, c] = 1.0
    states.free(s), bufs.free(b), conv.free(c)
    s2, b2, c2 = states.allocate(), bufs.allocate(), conv.allocate()
    assert (s2, b2, c2) == (s, b, c)
    assert states.state[:, s2].abs().sum() == 0
    assert bufs.keys[:, b2].abs().sum() == 0 and bufs.values[:, b2].abs().sum() == 0
    assert bufs.log_decay[:, b2].abs().sum() == 0
    assert bufs.length(b2) == 0 and int(bufs.lengths[b2]) == 0
    assert conv.state[:, c2].abs().sum() == 0


def test_buffer_lengths_track_accept_and_reset():
    bufs = BufferPool(SHAPE, 1, 3, entries=5)
    b = bufs.allocate()
    bufs.accept(b, 2)
    bufs.accept(b, 3)
    assert bufs.length(b) == 5 and bufs.lengths.tolist()[b] == 5
    with pytest.raises(BufferOverflowError, match="do not fit"):
        bufs.accept(b, 1)
    assert bufs.length(b) == 5  # a refused accept changes nothing
    bufs.reset(b)
    assert bufs.length(b) == 0
    assert bufs.batch_lengths([b, -1]).tolist() == [0, 0]


def test_padding_rows_and_stateless_rows():
    """Buffer slot -1 = padding (zero output, nothing written); state slot -1 = no state yet (S0 = 0)."""
    fam = make_family("gdn", torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    states = StatePool(fam.shape, 1, 2, dtype=torch.float64)
    bufs = BufferPool(fam.shape, 1, 3, entries=4, dtype=torch.float64, log_decay_dtype=torch.float64)
    s0, b0, b1 = states.allocate(), bufs.allocate(), bufs.allocate()
    states.state[0, s0].normal_(generator=gen)
    before = [t.clone() for t in (states.state, bufs.keys, bufs.values, bufs.log_decay)]
    tok = fam.tokens(gen, 3)
    sslots = torch.tensor([s0, -1, -1], dtype=torch.int32)
    bslots = torch.tensor([b0, -1, b1], dtype=torch.int32)
    o = fam.ops.buffered_step(*fam.args(tok), states.layer(0), sslots, *bufs.layer(0).tensors(), bslots,
                              torch.zeros(3, dtype=torch.int32))
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    assert torch.equal(states.state, before[0])  # a buffered step writes no state
    # the stateless row equals a recurrent step from a zero state
    ref_state = torch.zeros(1, 4, 8, 6, dtype=torch.float64)
    ref = fam.ops.recurrent_step(*fam.args(fam.slice_tokens(tok, slice(2, 3))), ref_state,
                                 torch.zeros(1, dtype=torch.int32))
    torch.testing.assert_close(o[2:3], ref, rtol=0, atol=1e-13)
    # the two real buffer slots got an entry at position 0; the unused slot 2 got nothing
    assert bufs.keys[0, b0, 0].abs().sum() > 0 and bufs.keys[0, b1, 0].abs().sum() > 0
    assert torch.equal(bufs.keys[0, 2], before[1][0, 2])


def test_flush_without_state_slot_is_refused():
    states = StatePool(SHAPE, 1, 1)
    bufs = BufferPool(SHAPE, 1, 1, entries=2)
    b = bufs.allocate()
    with pytest.raises(SlotError, match="allocate a state"):
        core.flush(states.layer(0), torch.tensor([-1], dtype=torch.int32), *bufs.layer(0).tensors(),
                   torch.tensor([b], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))


def test_garbage_past_the_fill_is_never_read():
    """Stale or NaN entries beyond a row's fill (rejected drafts, say) cannot leak into outputs."""
    fam = make_family("gdn", torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(5)
    f64 = torch.float64
    outs = []
    for poison in (0.0, float("nan")):
        states = StatePool(fam.shape, 1, 1, dtype=f64)
        bufs = BufferPool(fam.shape, 1, 1, entries=6, dtype=f64, log_decay_dtype=f64)
        s, b = states.allocate(), bufs.allocate()
        for t in (bufs.keys, bufs.values, bufs.log_decay):
            t[0, b, 2:] = poison
        one = torch.tensor([b], dtype=torch.int32)
        g = torch.Generator().manual_seed(6)
        states.state[0, s].normal_(generator=g)
        tok = fam.tokens(torch.Generator().manual_seed(7), 1, 3)
        o = fam.ops.verify(*fam.args(tok), states.layer(0), one, *bufs.layer(0).tensors(), one,
                           torch.tensor([2], dtype=torch.int32))
        outs.append(o)
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1])
    del gen
