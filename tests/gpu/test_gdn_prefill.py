"""The chunked GDN prefill (kvbuffer.kernels.prefill) against the fp64 recurrence, on a CUDA GPU.

Awkward lengths (1, 63, 64, 65, 1000, 10007 and packed batches of mixed lengths, an empty prompt among
them), random non-zero starting states, decays from slow to fast across the heads. Outputs are poisoned
with NaN before the kernel runs; pool slots outside the batch must come back bit-exact; a slot -1
sequence starts from zero and writes no state. FLA's naive recurrence checks the fp64 reference itself.
The decay-only form (Mamba-2, its front and D skip inside: raw x and dt in, dt limits) runs at Nemotron-3
Nano's shape and a small one against its fp64 reference (kvbuffer.kernels.prefill.mamba2_chunk_prefill_reference,
itself checked against the recurrence on the CPU), a slot -1 sequence a padding row (zero outputs); the
custom ops launch both.
Errors are relative Frobenius norms (tests.support.gdn_cases.rel_err), recorded by gdn_cases.record.
"""

from __future__ import annotations

import functools
import zlib

import pytest
import torch

from kvbuffer.kernels.prefill import (
    build_gdn_chunk_prefill,
    chunk_prefill,
    mamba2_chunk_prefill,
    mamba2_chunk_prefill_reference,
)
from kvbuffer.reference.core import clamp_log_decay

from tests.support.gdn_cases import bits_equal, record, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]

# bf16 tensor-core operands (k, v, q; Tinv, w, u, the chunk states and the deltas rounded to bf16) with fp32
# accumulation and an fp32 state passed from chunk to chunk: errors of FLA's chunked kernel's order; the
# measured errors behind these bounds are in docs/results.md, "Prefill"
OUT_TOL = 1e-2
STATE_TOL = 1e-2
HEADS = {"qwen35_9b": (16, 32), "ratio1": (4, 4)}
LENGTHS = {"len1": [1], "len63": [63], "len64": [64], "len65": [65], "len1000": [1000], "len10007": [10007],
           "mixed": [65, 1, 0, 1000, 64, 63, 130, 7], "mixed_long": [3000, 129, 4097]}


@functools.cache
def prefill_op(Hk: int, Hv: int, K: int = 128, V: int = 128, **tunables):
    return build_gdn_chunk_prefill(Hk, Hv, K, V, **tunables)


def inputs(lengths, Hk, Hv, K=128, V=128, *, slots, num_slots, gen, delta_rule=True):
    """Packed q, k, v, g, beta, cu_seqlens, a state pool and the rows' slots (fresh random values)."""
    N = sum(lengths)
    dev = "cuda"
    rn = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = torch.nn.functional.normalize(rn(N, Hk, K), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(rn(N, Hk, K), dim=-1)
    v = rn(N, Hv, V)
    rate = torch.logspace(-2.5, 0.5, Hv, device=dev)  # slow to fast decay across the heads
    g = -torch.nn.functional.softplus(rn(N, Hv)) * rate
    beta = torch.sigmoid(rn(N, Hv)) if delta_rule else None
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    state = rn(num_slots, Hv, K, V) * 0.1
    return (q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, cu, state,
            torch.tensor(slots, dtype=torch.int32, device=dev))


def recurrence64(q, k, v, g, beta, cu, state, slots):
    """The plain recurrence in fp64 (reference.core's order; beta None: decay-only): outputs and the final
    state of each sequence."""
    Hv = v.shape[1]
    r = Hv // k.shape[1]
    q, k = (x.double().repeat_interleave(r, dim=1) for x in (q, k))
    v, g = v.double(), clamp_log_decay(g.double())
    beta = None if beta is None else beta.double()
    o = torch.zeros_like(v)
    finals = []
    for i, slot in enumerate(slots.tolist()):
        S = state[slot].double() if slot >= 0 else torch.zeros(state.shape[1:], dtype=torch.float64, device=v.device)
        for t in range(int(cu[i]), int(cu[i + 1])):
            S = S * g[t].exp()[:, None, None]
            delta = v[t] if beta is None else beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t][:, :, None] * delta[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", S, q[t])
        finals.append(S)
    return o, finals


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", LENGTHS)
def test_prefill_matches_fp64_recurrence(case, heads):
    Hk, Hv = HEADS[heads]
    lengths = LENGTHS[case]
    B = len(lengths)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{case}/{heads}".encode()))
    # rows take every other slot of a pool twice their number, the last row of a batch starts from zero
    slots = [2 * i + 1 for i in range(B)]
    if B > 1:
        slots[-1] = -1
    q, k, v, g, beta, cu, state, slot_t = inputs(lengths, Hk, Hv, slots=slots, num_slots=2 * B + 1, gen=gen)
    before = state.clone()
    o_ref, finals = recurrence64(q, k, v, g, beta, cu, before, slot_t)
    out = torch.full_like(v, float("nan"))
    o = chunk_prefill(prefill_op(Hk, Hv), q, k, v, g, beta, cu, state, slot_t, out=out)
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    err = rel_err(o, o_ref)
    record(f"gdn_prefill/{case}/{heads}/o", err)
    assert err < OUT_TOL, f"output rel err {err:.2e}"
    for i, slot in enumerate(slots):
        if slot >= 0:
            s_err = rel_err(state[slot], finals[i])
            record(f"gdn_prefill/{case}/{heads}/state{i}", s_err)
            assert s_err < STATE_TOL, f"sequence {i}: state rel err {s_err:.2e}"
    untouched = [s for s in range(state.shape[0]) if s not in slots]
    assert bits_equal(state[untouched], before[untouched]), "a slot outside the batch changed"


DECAY_ONLY_HEADS = {"nano": (8, 64, 128, 64), "small": (2, 4, 64, 32)}  # Nemotron-3 Nano's G, H, N, P; a small one
DECAY_ONLY_LENGTHS = {**{c: LENGTHS[c] for c in ("len1", "len63", "len64", "len65", "len1000", "len10007")},
                      "three": [1000, 63, 65], "mixed": LENGTHS["mixed"]}


def mamba2_inputs(lengths, G, H, N, P, *, slots, num_slots, gen):
    """Packed raw x, dt, A_log, dt_bias, B, C, D (the layer's, as the engine hands them over), cu_seqlens, a
    state pool and the rows' slots."""
    T = sum(lengths)
    dev = "cuda"
    rn = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    x, Bm, Cm = (0.5 * rn(T, H, P)).bfloat16(), (0.3 * rn(T, G, N)).bfloat16(), (0.3 * rn(T, G, N)).bfloat16()
    A_log = torch.linspace(-2.0, 2.5, H, device=dev)  # slow to fast decay across the heads
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    return ((x, rn(T, H) - 1.0, A_log, 0.5 * rn(H), Bm, Cm, rn(H)), cu, rn(num_slots, H, N, P) * 0.1,
            torch.tensor(slots, dtype=torch.int32, device=dev))


@pytest.mark.parametrize("stages", [0, 2], ids=["plain", "pipelined"])
@pytest.mark.parametrize("start", ["existing", "fresh"])
@pytest.mark.parametrize("heads", DECAY_ONLY_HEADS)
@pytest.mark.parametrize("case", DECAY_ONLY_LENGTHS)
def test_decay_only_prefill_matches_fp64_reference(case, heads, start, stages):
    """The decay-only form (Mamba-2's SSD) from the layer's raw inputs: from existing states, or from zeroed
    ones (a fresh request), the last sequence of a packed batch on slot -1 (a padding row: zeros); the
    state pass plain and pipelined (TMA loads; rows past a sequence read and selected out)."""
    G, H, N, P = DECAY_ONLY_HEADS[heads]
    lengths = DECAY_ONLY_LENGTHS[case]
    B = len(lengths)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"decay/{case}/{heads}/{start}".encode()))
    op = prefill_op(G, H, N, P, delta_rule=False, states_stages=stages)
    slots = list(range(B))
    if B > 1:
        slots[-1] = -1
    tokens, cu, state, slot_t = mamba2_inputs(lengths, G, H, N, P, slots=slots, num_slots=B + 1, gen=gen)
    if start == "fresh":
        state[:B] = 0
    before = state.clone()
    state64 = state.double()
    y_ref = mamba2_chunk_prefill_reference(*(t.double() for t in tokens), cu, state64, slot_t)
    out = torch.full_like(tokens[0], float("nan"))
    y = mamba2_chunk_prefill(op, *tokens, cu, state, slot_t, out=out)
    err = rel_err(y, y_ref)
    record(f"gdn_prefill/decay_only/{case}/{heads}/{start}/{stages}/o", err)
    assert err < OUT_TOL, f"output rel err {err:.2e}"
    if B > 1:
        assert bits_equal(y[int(cu[-2]):], torch.zeros_like(y[int(cu[-2]):])), "a padding row's outputs"
    real = [i for i in slots if i >= 0]
    if real:
        s_err = max(rel_err(state[i], state64[i]) for i in real)
        record(f"gdn_prefill/decay_only/{case}/{heads}/{start}/{stages}/state", s_err)
        assert s_err < STATE_TOL, f"state rel err {s_err:.2e}"
    untouched = [s for s in range(state.shape[0]) if s not in real]
    assert bits_equal(state[untouched], before[untouched]), "a slot outside the batch changed"


@pytest.mark.parametrize("tunables", [{"states_BV": 16}, {"states_BV": 64, "output_BV": 64}, {"states_stages": 2},
                                      {"states_BV": 32, "states_stages": 2}, {"states_BV": 64, "states_stages": 3},
                                      {"heads_inner": 1}, {"states_stages": 2, "heads_inner": 1},
                                      {"staged_stores": 1}], ids=str)
def test_decay_only_tunables_agree(tunables):
    G, H, N, P = DECAY_ONLY_HEADS["nano"]
    gen = torch.Generator(device="cuda").manual_seed(29)
    tokens, cu, state, slots = mamba2_inputs([200, 64, 1, 1000, 63], G, H, N, P, slots=[0, 1, 2, 3, -1],
                                             num_slots=4, gen=gen)
    state64 = state.double()
    y_ref = mamba2_chunk_prefill_reference(*(t.double() for t in tokens), cu, state64, slots)
    y = mamba2_chunk_prefill(prefill_op(G, H, N, P, delta_rule=False, **tunables), *tokens, cu, state, slots)
    assert rel_err(y, y_ref) < OUT_TOL
    assert rel_err(state, state64) < STATE_TOL


@pytest.mark.parametrize("limits", [(0.0, 0.3), (0.05, None)], ids=str)
def test_decay_only_dt_limits(limits):
    """dt_min / dt_max clamp the softplus inside the state pass (the output pass reads the clamped dt)."""
    G, H, N, P = DECAY_ONLY_HEADS["nano"]
    gen = torch.Generator(device="cuda").manual_seed(23)
    tokens, cu, state, slots = mamba2_inputs([300, 65], G, H, N, P, slots=[1, 0], num_slots=2, gen=gen)
    state64 = state.double()
    y_ref = mamba2_chunk_prefill_reference(*(t.double() for t in tokens), cu, state64, slots, *limits)
    y = mamba2_chunk_prefill(prefill_op(G, H, N, P, delta_rule=False), *tokens, cu, state, slots, *limits)
    assert rel_err(y, y_ref) < OUT_TOL
    assert rel_err(state, state64) < STATE_TOL


@pytest.mark.parametrize("stages", [0, 2], ids=["plain", "pipelined"])
@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_a_sequence_is_untouched_by_its_neighbours_nan(family, stages):
    """Packed [70, 50]: the first sequence's last chunk is 6 rows, so a whole-tile load of it also reads
    the second's first 58 keys. With NaN in every key and value of the second sequence, the first's
    outputs and final state are bit-identical to a run with the second clean (the second's own are NaN)."""
    lengths, slots = [70, 50], [0, 1]
    gen = torch.Generator(device="cuda").manual_seed(41)
    if family == "gdn":
        Hk, Hv = HEADS["qwen35_9b"]
        op = prefill_op(Hk, Hv, states_stages=stages)
        q, k, v, g, beta, cu, state, slot_t = inputs(lengths, Hk, Hv, slots=slots, num_slots=2, gen=gen)
    else:
        G, H, N, P = DECAY_ONLY_HEADS["nano"]
        op = prefill_op(G, H, N, P, delta_rule=False, states_stages=stages)
        (v, dt, A_log, dt_bias, k, C, D), cu, state, slot_t = mamba2_inputs(lengths, G, H, N, P, slots=slots,
                                                                            num_slots=2, gen=gen)

    def run(keys, values):
        pool = state.clone()
        if family == "gdn":
            return chunk_prefill(op, q, keys, values, g, beta, cu, pool, slot_t), pool
        return mamba2_chunk_prefill(op, values, dt, A_log, dt_bias, keys, C, D, cu, pool, slot_t), pool

    clean_o, clean_s = run(k, v)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[70:], poisoned_v[70:] = float("nan"), float("nan")
    o, s = run(poisoned_k, poisoned_v)
    assert bits_equal(o[:70], clean_o[:70]) and bool(torch.isfinite(o[:70]).all())
    assert bits_equal(s[0], clean_s[0]) and bool(torch.isfinite(s[0]).all())


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_custom_ops_launch_the_kernels(family):
    """torch.ops.kvbuffer.<family>_chunk_prefill on CUDA (the JIT builds the spec) agrees with its CPU
    implementation run in fp64 on the same inputs."""
    from kvbuffer import ops

    gen = torch.Generator(device="cuda").manual_seed(11)
    if family == "gdn":
        q, k, v, g, beta, cu, state, slots = inputs([300, 0, 65], 16, 32, slots=[2, 0, -1], num_slots=3, gen=gen)
        tokens = (q, k, v, g, beta)
    else:
        tokens, cu, state, slots = mamba2_inputs([300, 0, 65], *DECAY_ONLY_HEADS["nano"], slots=[2, 0, -1],
                                                 num_slots=3, gen=gen)
    state64 = state.double().cpu()
    op = getattr(torch.ops.kvbuffer, f"{family}_chunk_prefill")
    o_ref = op(*(t.double().cpu() for t in tokens), cu.cpu(), state64, slots.cpu())
    ops.allow_jit(True)
    try:
        o = op(*tokens, cu, state, slots)
    finally:
        ops.allow_jit(None)
    assert rel_err(o.cpu(), o_ref) < OUT_TOL
    assert rel_err(state.cpu(), state64) < STATE_TOL


@pytest.mark.parametrize("tunables", [{"states_BV": 64, "output_BV": 64}, {"states_BV": 16},
                                      {"states_stages": 0}, {"states_BV": 64, "states_stages": 0},
                                      {"states_stages": 2}, {"states_BV": 64, "states_stages": 2},
                                      {"prep_solve": "blockwise"},
                                      {"states_BV": 64, "states_stages": 2, "prep_solve": "blockwise"},
                                      {"heads_inner": 1}, {"states_stages": 0, "heads_inner": 1},
                                      {"staged_stores": 1}, {"prep_solve": "blockwise", "staged_stores": 1}], ids=str)
def test_prefill_tunables_agree(tunables):
    """Other value tiles of the state pass and the output, the plain and the pipelined state pass (the
    defaults on sm_90a pipeline it), the blockwise prep solve and the staged prep give the same results
    within rounding."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    args = inputs([200, 64, 1, 1000, 63], 16, 32, slots=[0, 1, 2, 3, 4], num_slots=5, gen=gen)
    state0 = args[6].clone()
    o_ref, finals = recurrence64(*args[:6], state0, args[7])
    o = chunk_prefill(prefill_op(16, 32, **tunables), *args)
    assert rel_err(o, o_ref) < OUT_TOL
    assert max(rel_err(args[6][i], finals[i]) for i in range(5)) < STATE_TOL


def test_reference_matches_fla_naive():
    """The fp64 recurrence above agrees with FLA's naive recurrent GDN (an outside oracle; it runs in fp32)."""
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, g, beta, cu, state, slots = inputs([300], 16, 32, slots=[0], num_slots=1, gen=gen)
    o_ref, finals = recurrence64(q, k, v, g, beta, cu, state, slots)
    r = 2
    o_fla, s_fla = naive.naive_recurrent_gated_delta_rule(
        q.double().repeat_interleave(r, 1)[None], k.double().repeat_interleave(r, 1)[None], v.double()[None],
        beta.double()[None], g.double()[None], scale=1.0, initial_state=state.double(), output_final_state=True)
    assert rel_err(o_fla[0], o_ref) < 1e-4
    assert rel_err(s_fla[0], finals[0]) < 1e-4


def test_prefill_rejects_bad_offsets():
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, g, beta, cu, state, slots = inputs([10, 20], 16, 32, slots=[0, 1], num_slots=2, gen=gen)
    before = state.clone()
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_prefill(prefill_op(16, 32), q, k, v, g, beta, cu.flip(0).contiguous(), state, slots)
    with pytest.raises(IndexError, match="state_slots"):
        chunk_prefill(prefill_op(16, 32), q, k, v, g, beta, cu, state, slots + 5)
    with pytest.raises(TypeError, match="beta"):
        chunk_prefill(prefill_op(16, 32), q, k, v, g, beta.bfloat16(), cu, state, slots)
    assert bits_equal(state, before)
