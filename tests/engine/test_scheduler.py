"""The scheduler alone (no model): admission order, waiting for slots, no starvation of running requests."""

import pytest

from kvbuffer.engine.request import Request
from kvbuffer.engine.sampling import SamplingParams
from kvbuffer.engine.scheduler import Scheduler


def _req(rid, prompt_len, state=-1):
    return Request(rid, [1] * prompt_len, SamplingParams(), state_slot=state)


def _decoding(rid, state=-1):
    """A running request whose prompt is fed and whose first token is sampled."""
    return Request(rid, [1], SamplingParams(), output=[2], state_slot=state, cached=1)


def _long_prompts_need_states(req, adding):  # as mode kvbuffer with C = 8
    return req.state_slot < 0 and adding >= 8


@pytest.mark.parametrize("free_requests, free_states, admitted", [
    (3, 3, [0, 1, 2]),
    (2, 3, [0, 1]),  # out of request slots
    (3, 0, [0]),  # the long prompt (rid 1) waits for a state, and the one behind it waits too
    (3, 1, [0, 1, 2]),
], ids=["room", "no-request-slot", "no-state", "one-state"])
def test_admission_in_arrival_order(free_requests, free_states, admitted):
    s = Scheduler()
    for rid, n in enumerate([3, 20, 2]):
        s.add(_req(rid, n))
    assert [r.rid for r in s.admit(free_requests, free_states, _long_prompts_need_states)] == admitted
    assert [r.rid for r in s.waiting] == [r for r in range(3) if r not in admitted]


def test_new_arrivals_do_not_take_the_state_a_running_request_waits_for():
    s = Scheduler()
    s.running = [_decoding(0), _decoding(1, state=0)]
    s.add(_req(2, 20))
    wants = lambda r, adding: r.state_slot < 0 and (adding >= 8 or r.rid == 0)  # noqa: E731
    assert s.admit(4, 1, wants) == []  # rid 0 needs the one free state next step
    assert [r.rid for r in s.runnable(1, 1, wants)] == [0, 1]
    assert [r.rid for r in s.runnable(0, 1, wants)] == [1]  # rid 0 sits this step out; rid 1 holds a state


def test_remove_finds_waiting_and_running_requests():
    s = Scheduler()
    s.running, waiting = [_req(0, 1)], _req(1, 1)
    s.add(waiting)
    assert s.remove(1) is waiting and s.remove(0).rid == 0 and s.remove(7) is None
    assert len(s) == 0
