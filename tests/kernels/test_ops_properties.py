"""Property suite: one random argument of a random valid call of every public op
(`torch.ops.kvbuffer.*` on CPU and meta, and the `kvbuffer.reference` function it exposes) is
spoilt: another dtype, device, rank, size, stride, value or type. The call must end in a typed
kvbuffer error (or a TypeError / ValueError naming the argument) with every pool unchanged, or
give the reference's result. Bounded: a fixed number of derandomized examples."""

import math
import random

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbuffer.errors import KVBufferError
from tests.support.op_calls import OPS, POOLS, call_op, call_reference, cloned, snapshot, unchanged, valid_call

BOUNDED = settings(max_examples=1200, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow])
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.bool,
          torch.complex64)


def _resize(t, rng):
    axis = rng.randrange(t.dim())
    if t.shape[axis] > 1 and rng.random() < 0.5:
        return t.narrow(axis, 0, t.shape[axis] - 1)
    return torch.cat([t, t.narrow(axis, 0, 1)], axis) if t.shape[axis] else t


def _expand(t, rng):
    axis = rng.randrange(t.dim())
    return t.narrow(axis, 0, 1).expand_as(t) if t.shape[axis] else t


def _slot_value(t, rng):
    """One element set to an out-of-range, repeated or huge value (slots, lengths, counts, weights)."""
    t = t.clone().contiguous()
    flat = t.view(-1)
    if flat.numel() and t.dtype != torch.bool:
        flat[rng.randrange(flat.numel())] = rng.choice([-2, -100, 2 ** 20, int(flat.max()) + 1, int(flat[0])])
    return t


def _fill(value):
    return lambda t, rng: t.clone().fill_(value) if t.numel() and t.dtype.is_floating_point else t


SPOILS = {  # name -> (tensor, rng) -> what the argument becomes
    "dtype": lambda t, rng: t.to(rng.choice(DTYPES)),
    "meta": lambda t, rng: t.to("meta"),
    "drop_axis": lambda t, rng: t.select(-1, 0) if t.dim() and t.shape[-1] else t.reshape(-1),
    "add_axis": lambda t, rng: t.unsqueeze(rng.randrange(t.dim() + 1)),
    "resize": lambda t, rng: _resize(t, rng) if t.dim() else t,
    "one_element": lambda t, rng: t.reshape(-1)[:1],
    "expanded": lambda t, rng: _expand(t, rng) if t.dim() else t,
    "transposed": lambda t, rng: t.transpose(-1, -2) if t.dim() > 1 else t,
    "values": _slot_value,
    "nan": _fill(math.nan),
    "inf": _fill(-math.inf),
    "not_a_tensor": lambda t, rng: rng.choice([None, 1.5, 3, [1, 2], "x"]),
}
SCALARS = {  # a non-tensor argument -> the bad values it may get
    "flush_at": [-1, 0, 1, 2, 7, 99], "width": [-1, 0, 1, 2, 3, 4, 9], "kind": ["advance", "verify", "mode", ""],
    "silu": [True, False],
}


def _spoil(call: dict, arg: str, spoil: str, rng: random.Random) -> None:
    value = call[arg]
    if isinstance(value, torch.Tensor):
        call[arg] = SPOILS[spoil](value, rng)
    elif arg in SCALARS:
        call[arg] = rng.choice(SCALARS[arg])
    elif value is None and spoil != "not_a_tensor":  # an optional tensor (bias, z) that was left out
        call[arg] = torch.randn(rng.randint(1, 3), rng.randint(1, 3))


def _names_an_argument(e: Exception, call: dict) -> bool:
    return any(arg in str(e) for arg in call)


def _check_outcome(name: str, call: dict, via: str) -> None:
    fn = call_op if via == "op" else call_reference
    before = snapshot(call)
    reference_call = cloned(call)
    try:
        out = fn(name, call)
    except KVBufferError as e:
        event(f"{type(e).__name__}")
        assert unchanged(before, call), f"rejected ({e}) but a pool was written"
        return
    except RuntimeError as e:  # torch's own schema check: a value of the wrong type for the op's signature
        assert via == "op" and "Expected a value of type" in str(e), f"raw {type(e).__name__}: {e}"
        event("schema error")
        return
    except (TypeError, ValueError) as e:
        event(f"{type(e).__name__}")
        assert _names_an_argument(e, call), f"{type(e).__name__} names no argument: {e}"
        assert unchanged(before, call), f"rejected ({e}) but a pool was written"
        return
    event("accepted")
    real = [v for v in call.values() if isinstance(v, torch.Tensor) and v.device.type != "meta"]
    if via == "op" and real and out is not None:
        assert out.device == real[0].device, "a meta tensor among real ones reached the fake"
        expected = call_reference(name, reference_call)
        # equal up to the summation order a strided input changes; the reference advances a conv by
        # T single steps, which round the history to the pool's dtype after each (x's may differ)
        tol = 1e-2 if name == "conv1d_update" else 1e-5
        torch.testing.assert_close(out, expected, rtol=tol, atol=tol, equal_nan=True)
        for pool in POOLS:
            if pool in before:
                torch.testing.assert_close(call[pool], reference_call[pool], rtol=0, atol=0, equal_nan=True)


@BOUNDED
@given(name=st.sampled_from(OPS), seed=st.integers(0, 2 ** 31), spoil=st.sampled_from(tuple(SPOILS)),
       via=st.sampled_from(("op", "reference")), data=st.data())
def test_a_spoilt_argument_is_a_typed_error_or_the_reference_result(name, seed, spoil, via, data):
    rng = random.Random(seed)
    call = valid_call(name, rng, torch.Generator().manual_seed(seed))
    arg = data.draw(st.sampled_from(sorted(call)), label="argument")
    _spoil(call, arg, spoil, rng)
    _check_outcome(name, call, via)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(name=st.sampled_from(OPS), seed=st.integers(0, 2 ** 31))
def test_a_valid_call_equals_the_reference_on_cpu_and_has_its_shape_on_meta(name, seed):
    call = valid_call(name, random.Random(seed), torch.Generator().manual_seed(seed))
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    expected = call_reference(name, cloned(call))
    out = call_op(name, call)
    out_meta = call_op(name, meta)
    if out is None:
        assert expected is None and out_meta is None
        return
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    assert (out_meta.shape, out_meta.dtype, out_meta.device.type) == (out.shape, out.dtype, "meta")
