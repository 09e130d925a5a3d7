"""torch.ops.kvbuffer.gdn_chunk_prefill / mamba2_chunk_prefill on the CPU (their reference implementation)
against the plain recurrence of kvbuffer.reference.core, token by token, in float64; their fakes; their checks.

Packed batches of awkward lengths, empty sequences among them, one of 10,007 tokens; pools with garbage
in the slots no sequence names (which must come back bit-exact) and a sequence on slot -1 (starts from
zero, writes nothing; Mamba-2's is a padding row: zero outputs). Mamba-2's op takes the layer's raw x and
dt (its front: softplus, the dt limits, A's decay, the D skip, inside), GDN's the front's outputs.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import kvbuffer.kernels  # noqa: F401  (registers torch.ops.kvbuffer.*)
from kvbuffer.errors import DTypeError, ShapeError, SlotError
from kvbuffer.reference import core, gating

F64 = torch.float64
TOL = 1e-10
OPS = {"gdn": "gdn_chunk_prefill", "mamba2": "mamba2_chunk_prefill"}
SHAPES = {"gdn": (2, 4, 7, 5), "mamba2": (2, 8, 16, 6)}  # Hk, Hv, K, V: grouped heads, awkward head dims
LENGTHS = {"one": [1], "63": [63], "64": [64], "65": [65], "1000": [1000],
           "mixed": [65, 1, 0, 130, 64, 63, 7], "empty_only": [0, 0], "trailing_empty": [5, 0]}


def inputs(family: str, lengths, slots, n_slots: int, seed: str, dtype=F64):
    """Packed tokens, cu_seqlens, a state pool and the sequences' slots: GDN's (q, k, v, g, beta), Mamba-2's
    (x, dt, A_log, dt_bias, B, C, D) raw."""
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    Hk, Hv, K, V = SHAPES[family]
    N = sum(lengths)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q, k = F.normalize(r(N, Hk, K), dim=-1) * K ** -0.5, F.normalize(r(N, Hk, K), dim=-1)
    v = r(N, Hv, V)
    g = -F.softplus(r(N, Hv)) * torch.logspace(-2, 0.5, Hv, dtype=F64)
    beta = torch.sigmoid(r(N, Hv)) if family == "gdn" else None
    cu = torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    state = r(n_slots, Hv, K, V)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    if family == "mamba2":  # dt raw (softplus(dt + bias) spans small to large steps), A_log over the heads
        tokens = (v, r(N, Hv) - 1.0, torch.linspace(-2.0, 1.0, Hv, dtype=F64), 0.5 * r(Hv), k, q, r(Hv))
        return tuple(cast(t) for t in tokens), cu, state, torch.tensor(slots, dtype=torch.int32)
    return (cast(q), cast(k), cast(v), cast(g), cast(beta)), cu, state, torch.tensor(slots, dtype=torch.int32)


def recurrence(tokens, cu, state, slots, dt_limits=None):
    """core.recurrent_step token by token, each sequence from its slot (a zero scratch slot for -1):
    outputs, and the pool as the op must leave it. Mamba-2: its front first (gating.mamba2_front), then
    y = o + D x, a sequence on slot -1 all zeros."""
    if len(tokens) == 7:
        x, dt, A_log, dt_bias, B, C, D = (t.to(F64) for t in tokens)
        value, g, _ = gating.mamba2_front(x, dt, A_log, dt_bias, F64, dt_limits)
        o, pool = recurrence((C, B, value, g, None), cu, state, slots)
        y = o + D[:, None] * x
        for i, slot in enumerate(slots.tolist()):
            if slot < 0:
                y[int(cu[i]):int(cu[i + 1])] = 0
        return y, pool
    q, k, v, g, beta = (None if t is None else t.to(F64) for t in tokens)
    pool = torch.cat([state, torch.zeros_like(state[:1])])
    o = torch.zeros(v.shape, dtype=F64)
    for i, slot in enumerate(slots.tolist()):
        at = torch.tensor([slot if slot >= 0 else pool.shape[0] - 1], dtype=torch.int32)
        if slot < 0:
            pool[-1] = 0
        for t in range(int(cu[i]), int(cu[i + 1])):
            one = lambda x: None if x is None else x[t:t + 1]  # noqa: E731
            o[t] = core.recurrent_step(one(q), one(k), one(v), one(g), one(beta), pool, at)[0]
    return o, pool[:-1]


def call(family, tokens, cu, state, slots, **limits):
    return getattr(torch.ops.kvbuffer, OPS[family])(*tokens, cu, state, slots, **limits)


def value_of(family, tokens):
    """The input the output is shaped like (v; Mamba-2's x)."""
    return tokens[2] if family == "gdn" else tokens[0]


def check(family, lengths, seed, dtype=F64, tol=TOL, dt_limits=None):
    B = len(lengths)
    slots = [2 * i + 1 for i in range(B)]
    slots[B // 2] = -1  # one sequence starts from zero and writes nothing
    tokens, cu, state, slot_t = inputs(family, lengths, slots, 2 * B + 2, seed, dtype)
    before = state.clone()
    o_ref, state_ref = recurrence(tokens, cu, before, slot_t, dt_limits)
    limits = {} if dt_limits is None else dict(dt_min=dt_limits[0], dt_max=dt_limits[1])
    o = call(family, tokens, cu, state, slot_t, **limits)
    assert o.dtype == value_of(family, tokens).dtype and o.shape == value_of(family, tokens).shape
    torch.testing.assert_close(o.to(F64), o_ref, rtol=0, atol=tol)
    torch.testing.assert_close(state, state_ref, rtol=0, atol=tol)
    untouched = [s for s in range(state.shape[0]) if s not in slots]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("family", OPS)
@pytest.mark.parametrize("case", LENGTHS)
def test_op_matches_the_plain_recurrence(family, case):
    check(family, LENGTHS[case], f"{family}/{case}")


@pytest.mark.parametrize("family", OPS)
def test_op_over_10007_tokens(family):
    check(family, [10007], f"{family}/long")


@pytest.mark.parametrize("limits", [(0.0, 0.5), (0.3, 1e9), (0.2, 0.2)])
def test_mamba2_dt_limits_clamp_after_the_softplus(limits):
    """dt_min / dt_max clamp softplus(dt + dt_bias) before the decay and the values (mamba_ssm's dt_limit)."""
    check("mamba2", [65, 1, 130], f"limits/{limits}", dt_limits=limits)


@pytest.mark.parametrize("limits, match", [((-0.1, None), "dt_min"), ((0.5, 0.1), "dt_max"),
                                           ((0.0, float("nan")), "dt_max"), ((float("inf"), None), "dt_min")])
def test_mamba2_bad_dt_limits_are_refused_before_any_write(limits, match):
    tokens, cu, state, slots = inputs("mamba2", [5, 9], [0, 1], 3, "bad-limits")
    before = state.clone()
    with pytest.raises(ValueError, match=match):
        call("mamba2", tokens, cu, state, slots, dt_min=limits[0], dt_max=limits[1])
    assert torch.equal(state, before)


def test_mamba2_op_matches_the_engine_reference_path():
    """The op's y equals the reference prompt path's (reference.chunked_ops.mamba2_prefill, every token folded)
    on the same raw inputs, padding row (slot -1) included."""
    from kvbuffer.reference import chunked_ops

    lengths = [63, 64, 1, 1000]
    slots = [3, -1, 0, 5]
    tokens, cu, state, slot_t = inputs("mamba2", lengths, slots, 6, "engine")
    x, dt, A_log, dt_bias, B, C, D = tokens
    pool = state.clone()
    y = call("mamba2", tokens, cu, pool, slot_t)
    n = len(lengths)
    bufs = (torch.zeros(n, 1, *B.shape[1:], dtype=F64), torch.zeros(n, 1, *x.shape[1:], dtype=F64),
            torch.zeros(n, 1, x.shape[1], dtype=F64))
    buffer_slots = torch.tensor([i if s >= 0 else -1 for i, s in enumerate(slots)], dtype=torch.int32)
    want, _ = chunked_ops.mamba2_prefill(x, dt, A_log, dt_bias, B, C, D, cu, state, slot_t, *bufs, buffer_slots,
                                         torch.zeros(n, dtype=torch.int64), flush_at=1)
    torch.testing.assert_close(y, want, rtol=0, atol=TOL)
    torch.testing.assert_close(pool, state, rtol=0, atol=TOL)


def test_op_in_fp32_activations_and_state():
    """fp32 tokens and state (as the engine's CPU runs): the same recurrence within fp32 rounding."""
    lengths = [200, 0, 70]
    tokens, cu, state, slots = inputs("gdn", lengths, [0, 1, 2], 3, "fp32", torch.float32)
    state = state.float()
    o_ref, state_ref = recurrence(tokens, cu, state.double(), slots)
    o = call("gdn", tokens, cu, state, slots)
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(state.double(), state_ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", OPS)
def test_fake_gives_the_output_shape(family):
    """Under FakeTensorMode the op checks shapes and returns (N, Hv, V) like the values, writing nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tokens, cu, state, slots = inputs(family, [5, 9], [0, 1], 2, "fake")
    with FakeTensorMode() as mode:
        fake = [None if t is None else mode.from_tensor(t) for t in tokens]
        o = call(family, fake, mode.from_tensor(cu), mode.from_tensor(state), mode.from_tensor(slots))
    assert o.shape == value_of(family, tokens).shape and o.dtype == value_of(family, tokens).dtype


BAD = {
    "short_k": (lambda a: a.update(k=a["k"][:-1]), ShapeError, "k must have shape"),
    "int_g": (lambda a: a.update(g=a["g"].long()), DTypeError, "g must have dtype"),
    "heads": (lambda a: a.update(q=a["q"][:, :1].repeat(1, 3, 1), k=a["k"][:, :1].repeat(1, 3, 1)), ShapeError,
              "multiple of key heads"),
    "falling_offsets": (lambda a: a.update(cu=a["cu"].flip(0).contiguous()), ShapeError, "cu_seqlens must rise"),
    "short_offsets": (lambda a: a.update(cu=a["cu"][:1]), ShapeError, "B \\+ 1 >= 2"),
    "slot_range": (lambda a: a.update(slots=a["slots"] + 5), SlotError, "state_slots"),
    "shared_slot": (lambda a: a.update(slots=torch.zeros_like(a["slots"])), (ValueError, IndexError), "state_slots"),
}


@pytest.mark.parametrize("bad", BAD)
def test_bad_calls_raise_typed_errors_and_write_nothing(bad):
    tokens, cu, state, slots = inputs("gdn", [5, 9], [0, 1], 3, "bad")
    a = dict(zip(("q", "k", "v", "g", "beta"), tokens), cu=cu, slots=slots)
    spoil, error, match = BAD[bad]
    spoil(a)
    before = state.clone()
    with pytest.raises(error, match=match):
        torch.ops.kvbuffer.gdn_chunk_prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu"], state, a["slots"])
    assert torch.equal(state, before)



@pytest.mark.parametrize("family", OPS)
def test_a_pipelined_pass_refuses_tensors_tma_cannot_load(family, monkeypatch):
    """The compiled op with a pipelined state pass (TMA loads) refuses, before any launch, a tensor it
    loads by TMA that starts off a 16-byte boundary (a view at an odd element offset), naming it; the
    plain pass takes it. (The launchers' checks run on the CPU here, with no kernel behind them.)"""
    from kvbuffer.kernels import prefill
    from kvbuffer.kernels.compiled import CompiledOp

    monkeypatch.setattr(prefill, "check_on_cuda", lambda name, device: None)
    Hk, Hv, K, V, N = 2, 4, 16, 16, 14
    bf, f32 = torch.bfloat16, torch.float32
    shapes = {"q": ((N, Hk, K), bf), "k": ((N, Hk, K), bf), "v": ((N, Hv, V), bf), "g": ((N, Hv), f32),
              "beta": ((N, Hv), f32)} if family == "gdn" else \
        {"x": ((N, Hv, V), bf), "dt": ((N, Hv), f32), "A_log": ((Hv,), f32), "dt_bias": ((Hv,), f32),
         "B": ((N, Hk, K), bf), "C": ((N, Hk, K), bf), "D": ((Hv,), f32)}
    args = {name: -0.1 * torch.rand(shape).to(dtype) for name, (shape, dtype) in shapes.items()}
    cu, slots = torch.tensor([0, 5, N], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    state = torch.zeros(2, Hv, K, V)
    loaded = "k" if family == "gdn" else "dt"
    shifted = torch.empty(args[loaded].numel() + 1, dtype=args[loaded].dtype)[1:].view(args[loaded].shape)
    shifted.copy_(args[loaded])
    assert shifted.data_ptr() % prefill.TMA_ALIGNMENT
    args[loaded] = shifted
    run = prefill.chunk_prefill if family == "gdn" else prefill.mamba2_chunk_prefill
    params = dict(Hk=Hk, Hv=Hv, K=K, V=V, delta_rule=family == "gdn")
    calls = []
    parts = {p: (lambda *a, p=p: calls.append(p)) for p in ("chunks", "prep", "states", "output")}
    with pytest.raises(ShapeError, match=f"{loaded} starts at an address"):
        run(CompiledOp(parts, "chunk_prefill", dict(params, states_stages=2)), *args.values(), cu, state, slots)
    assert calls == []
    run(CompiledOp(parts, "chunk_prefill", dict(params, states_stages=0)), *args.values(), cu, state, slots)
    assert "states" in calls
