"""Every op that writes a pool checks all its arguments before its first write: indices in range
(negative, past the end, near 2**31 - 1 in int32, where a sum wraps), index dtypes, value dtypes
(no silent cast), shapes and devices. A refused call leaves every pool bit for bit unchanged."""

import random

import pytest
import torch

import kvbuffer.kernels.torch_ops  # noqa: F401  (registers torch.ops.kvbuffer.*)
from kvbuffer.errors import KVBufferError
from kvbuffer.runtime.mixing import put_kv_rows, put_slot_rows
from tests.support.op_calls import OPS, call_op, snapshot, unchanged, valid_call

INT32_MAX = 2 ** 31 - 1
EXTREMES = [-2, -(2 ** 31), INT32_MAX, INT32_MAX - 1, 2 ** 20]
INDICES = ("state_slots", "buffer_slots", "lengths", "slots", "draft_rows", "accepted")


def _refused(fn, call: dict, pools: tuple[str, ...]) -> Exception:
    before = {k: call[k].clone() for k in pools}
    with pytest.raises((KVBufferError, TypeError, ValueError)) as e:
        fn(**call)
    for k in pools:
        raw = lambda t: t.contiguous().view(-1).view(torch.uint8)  # noqa: E731  (the bits: NaN equals NaN)
        assert torch.equal(raw(before[k]), raw(call[k])), f"{k} changed by a refused call ({e.value})"
    return e.value


# ----------------------------------------------------------------------------------------------
# the KV cache writes of runtime.mixing


def kv_call(B=3, T=2, NS=4, L=6, Hkv=2, D=5, dtype=torch.float32, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(NS, generator=g)[:B].to(torch.int32)[:, None].expand(B, T).contiguous()
    pos = torch.stack([torch.randperm(L, generator=g)[:T] for _ in range(B)]).to(torch.int32)
    return dict(k_cache=torch.randn(NS, L, Hkv, D, generator=g).to(dtype),
                v_cache=torch.randn(NS, L, Hkv, D, generator=g).to(dtype), rows=rows, pos=pos,
                k=torch.randn(B, T, Hkv, D, generator=g).to(dtype), v=torch.randn(B, T, Hkv, D, generator=g).to(dtype))


def _set(name, value):
    def spoil(call):
        call[name] = call[name].clone()
        call[name].view(-1)[-1] = value
    return spoil


def _replace(name, fn):
    def spoil(call):
        call[name] = fn(call[name])
    return spoil


KV_SPOILS = {
    **{f"rows={v}": _set("rows", v) for v in (-1, -2, 4, INT32_MAX)},
    **{f"pos={v}": _set("pos", v) for v in (-1, 6, INT32_MAX, -(2 ** 31))},
    "pos int64 past 2**32": _replace("pos", lambda t: t.long().index_fill_(1, torch.tensor([0]), 2 ** 32 + 1)),
    "rows float": _replace("rows", lambda t: t.float()),
    "rows int16": _replace("rows", lambda t: t.to(torch.int16)),
    "pos bool": _replace("pos", lambda t: t.bool()),
    "pos other shape": _replace("pos", lambda t: t[:, :1]),
    "k bf16": _replace("k", lambda t: t.to(torch.bfloat16)),
    "v float64": _replace("v", lambda t: t.double()),
    "v other shape": _replace("v", lambda t: t[..., :-1]),
    "v_cache other dtype": _replace("v_cache", lambda t: t.double()),
    "v_cache fewer slots": _replace("v_cache", lambda t: t[:-1].clone()),
    "v_cache expanded": _replace("v_cache", lambda t: t[:1].expand_as(t)),
    "k on meta": _replace("k", lambda t: t.to("meta")),
    "v_cache on meta": _replace("v_cache", lambda t: t.to("meta")),
    "k_cache 3-d": _replace("k_cache", lambda t: t[:, :, 0].clone()),
}


@pytest.mark.parametrize("spoil", KV_SPOILS, ids=list(KV_SPOILS))
def test_put_kv_rows_refuses_before_writing(spoil):
    call = kv_call()
    KV_SPOILS[spoil](call)
    _refused(put_kv_rows, call, tuple(k for k in ("k_cache", "v_cache") if call[k].device.type != "meta"))


def test_put_kv_rows_writes_what_indexing_writes():
    call = kv_call(B=4, T=3, NS=5, L=7, seed=3)
    want_k, want_v = call["k_cache"].clone(), call["v_cache"].clone()
    want_k[call["rows"].long(), call["pos"].long()] = call["k"]
    want_v[call["rows"].long(), call["pos"].long()] = call["v"]
    put_kv_rows(**call)
    assert torch.equal(call["k_cache"], want_k) and torch.equal(call["v_cache"], want_v)


def slot_call(seed=0) -> dict:
    kv = kv_call(seed=seed)
    real = torch.tensor([True, False, True])
    return dict(dst=kv["k_cache"], rows=kv["rows"], pos=kv["pos"], values=kv["k"], real=real)


SLOT_SPOILS = {
    **{f"rows={v}": _set("rows", v) for v in (-1, 4, INT32_MAX)},
    **{f"pos={v}": _set("pos", v) for v in (-1, 6, INT32_MAX)},
    "values bf16": _replace("values", lambda t: t.to(torch.bfloat16)),
    "values other shape": _replace("values", lambda t: t[:, :, :1]),
    "real int": _replace("real", lambda t: t.int()),
    "real other length": _replace("real", lambda t: t[:2]),
    "rows on meta": _replace("rows", lambda t: t.to("meta")),
    "dst expanded": _replace("dst", lambda t: t[:, :1].expand_as(t)),
}


@pytest.mark.parametrize("spoil", SLOT_SPOILS, ids=list(SLOT_SPOILS))
def test_put_slot_rows_refuses_before_writing(spoil):
    call = slot_call()
    SLOT_SPOILS[spoil](call)
    _refused(put_slot_rows, call, ("dst",) if call["dst"].device.type != "meta" else ())


def test_put_slot_rows_ignores_the_padding_rows_indices():
    call = slot_call(seed=1)
    call["rows"][1], call["pos"][1] = -1, INT32_MAX  # a padding row's indices are never used
    want = call["dst"].clone()
    keep = call["real"]
    want[call["rows"][keep].long(), call["pos"][keep].long()] = call["values"][keep]
    put_slot_rows(**call)
    assert torch.equal(call["dst"], want)


# ----------------------------------------------------------------------------------------------
# the kernel ops: extreme index values in int32


def _with_index(name: str, arg: str):
    """A valid call of op `name` with at least one row, whose `arg` is an index tensor."""
    for s in range(500):
        call = valid_call(name, random.Random(s), torch.Generator().manual_seed(s))
        if isinstance(call.get(arg), torch.Tensor) and call[arg].numel():
            return call
    return None


CASES = [(op, arg, v) for op in OPS for arg in INDICES if _with_index(op, arg) is not None for v in EXTREMES]


@pytest.mark.parametrize("name,arg,value", CASES, ids=[f"{o}-{a}={v}" for o, a, v in CASES])
def test_an_index_out_of_range_is_refused_and_writes_nothing(name, arg, value):
    call = _with_index(name, arg)
    t = call[arg].clone()
    t.view(-1)[0] = value
    call[arg] = t
    before = snapshot(call)
    with pytest.raises(KVBufferError):
        call_op(name, call)
    assert unchanged(before, call), "a refused call wrote into a pool"


def test_attention_decode_refuses_cached_that_wraps_in_int32():
    """cached + T computed in int32 wrapped negative for cached near 2**31 - 1 and passed the range check."""
    q, kc, vc = torch.randn(2, 3, 4, 8), torch.randn(3, 16, 2, 8), torch.randn(3, 16, 2, 8)
    slots = torch.tensor([0, 2], dtype=torch.int32)
    for bad in (INT32_MAX, INT32_MAX - 1, INT32_MAX - 2, -1, 14):
        cached = torch.tensor([1, bad], dtype=torch.int32)
        with pytest.raises(KVBufferError, match="cached"):
            torch.ops.kvbuffer.attention_decode(q, kc, vc, slots, cached, 0.5)
    ok = torch.ops.kvbuffer.attention_decode(q, kc, vc, slots, torch.tensor([1, 13], dtype=torch.int32), 0.5)
    assert ok.shape == q.shape


PREFILL = {"cu_seqlens": [[0, INT32_MAX, 5], [0, -(2 ** 31) + 3, 5], [0, 6, 5], [1, 2, 5]],
           "state_slots": [[0, INT32_MAX], [0, -2], [0, 3], [1, 1]]}


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
@pytest.mark.parametrize("arg,value", [(a, v) for a, vs in PREFILL.items() for v in vs],
                         ids=[f"{a}={v}" for a, vs in PREFILL.items() for v in vs])
def test_a_chunk_prefill_index_out_of_range_is_refused_and_writes_nothing(family, arg, value):
    N, Hk, K, Hv, V = 5, 1, 4, 2, 4
    call = dict(cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32), state=torch.randn(3, Hv, K, V),
                state_slots=torch.tensor([0, 1], dtype=torch.int32))
    call[arg] = torch.tensor(value, dtype=torch.int32)
    if family == "gdn":
        op = torch.ops.kvbuffer.gdn_chunk_prefill
        call.update(q=torch.randn(N, Hk, K), k=torch.randn(N, Hk, K), v=torch.randn(N, Hv, V),
                    g=-torch.rand(N, Hv), beta=torch.rand(N, Hv))
    else:
        op = torch.ops.kvbuffer.mamba2_chunk_prefill
        call.update(x=torch.randn(N, Hv, V), dt=torch.randn(N, Hv), A_log=torch.zeros(Hv), dt_bias=torch.zeros(Hv),
                    B=torch.randn(N, Hk, K), C=torch.randn(N, Hk, K), D=torch.ones(Hv))
    before = call["state"].clone()
    with pytest.raises(KVBufferError):
        op(**call)
    assert torch.equal(call["state"], before)
