"""The chunked prefill of packed prompts (kvbuffer.reference.chunked) against core.prefill, request by
request, and against outside oracles from a fresh state.

Everything runs in float64. Pools hold garbage in unused slots (which must come back bit-exact) and
NaN past each row's fill (which must never be read); padding rows' tokens are NaN.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbuffer.errors import DTypeError, ShapeError, SlotError
from kvbuffer.reference import chunked, chunked_ops, core
from kvbuffer.reference.gating import gdn_front, mamba2_front
from tests.support.families import FAMILIES, make_family

F64 = torch.float64
TOL = 1e-12  # absolute; outputs and states are O(1), measured errors ~1e-15
C = 16
CAP = C + 3  # a buffer also holds drafts past C
SHAPES = {"gdn": dict(Hk=2, Hv=4, K=7, V=5),        # value heads grouped by 2, awkward head dims
          "mamba2": dict(Hk=2, Hv=8, K=16, V=6)}    # groups of 4 heads, state size 16, head dim 6

# rows of a packed call: (prompt tokens P, fill f, has a state slot, is padding)
CASES = {
    "P1": [(1, 0, True, False)],
    "C-1": [(C - 1, 0, False, False)],
    "C": [(C, 0, True, False)],
    "C+1": [(C + 1, 0, True, False)],
    "63_64_65": [(63, 3, True, False), (64, 0, True, False), (65, C - 1, True, False)],
    "1000": [(1000, 7, True, False)],
    "every_fill": [(21 + f % 5, f, True, False) for f in range(C)],
    "short_contexts": [(3, 0, False, False), (5, 10, False, False), (C - 4, 3, False, False), (40, 2, True, False)],
    "fold_exactly": [(C - 5, 5, True, False), (2 * C - 3, 3, True, False), (C, 0, True, False)],
    "padding_and_empty": [(9, 4, True, True), (30, 1, True, False), (0, 6, False, False), (7, 0, False, True),
                          (0, 0, True, False), (C - 2, 2, True, False)],
}


def _family(name):
    return make_family(name, torch.Generator().manual_seed(11), **SHAPES[name])


def _core_inputs(fam, tok):
    """(q, k, v, g, beta) for the core, from the family's raw per-token inputs."""
    p = fam.params
    if fam.name == "gdn":
        q, k, g, beta = gdn_front(tok["q"], tok["k"], tok["a"], tok["b"], p["A_log"], p["dt_bias"], F64)
        return q, k, tok["v"], g, beta
    value, g, _ = mamba2_front(tok["x"], tok["dt"], p["A_log"], p["dt_bias"], F64)
    return tok["C"], tok["B"], value, g, None


class Problem:
    """Packed rows with permuted slots over pools with garbage, and the same pools kept for core."""

    def __init__(self, fam, rows, seed=0):
        gen = torch.Generator().manual_seed(100 + seed)
        s = fam.shape
        B, n_slots = len(rows), len(rows) + 3
        Ps = [r[0] for r in rows]
        self.cu = torch.tensor([0] + torch.tensor(Ps).cumsum(0).tolist(), dtype=torch.int32)
        self.tok = fam.tokens(gen, sum(Ps))
        self.state = torch.randn(n_slots, s.num_v_heads, s.head_k_dim, s.head_v_dim, generator=gen, dtype=F64)
        self.buf_k = torch.randn(n_slots, CAP, s.num_k_heads, s.head_k_dim, generator=gen, dtype=F64)
        self.buf_v = torch.randn(n_slots, CAP, s.num_v_heads, s.head_v_dim, generator=gen, dtype=F64)
        self.buf_g = -torch.rand(n_slots, CAP, s.num_v_heads, generator=gen, dtype=F64).cumsum(1)
        state_perm = torch.randperm(n_slots, generator=gen).tolist()
        buf_perm = torch.randperm(n_slots, generator=gen).tolist()
        self.state_slots = torch.tensor([state_perm[i] if r[2] else -1 for i, r in enumerate(rows)], dtype=torch.int32)
        self.buffer_slots = torch.tensor([-1 if r[3] else buf_perm[i] for i, r in enumerate(rows)], dtype=torch.int32)
        self.lengths = torch.tensor([r[1] for r in rows], dtype=torch.int32)
        for i, r in enumerate(rows):
            b = int(self.buffer_slots[i])
            if b >= 0:  # past the fill: never read
                for t in (self.buf_k, self.buf_v, self.buf_g):
                    t[b, r[1]:] = float("nan")
            if r[3]:  # a padding row's tokens: never read
                for t in self.tok.values():
                    t[self.cu[i]:self.cu[i + 1]] = float("nan")
        self.B = B

    def pools(self):
        return self.state, self.buf_k, self.buf_v, self.buf_g

    def clone_pools(self):
        return tuple(t.clone() for t in self.pools())


def _same_bits(a, b):
    return torch.equal(torch.nan_to_num(a, nan=7.5), torch.nan_to_num(b, nan=7.5)) and \
        torch.equal(a.isnan(), b.isnan())


def _run_core(fam, pb: Problem, pools, flush_at=C):
    """core.prefill request by request on `pools`: o (N, Hv, V) and the new fills."""
    q, k, v, g, beta = _core_inputs(fam, pb.tok)
    state, bk, bv, bg = pools
    o = torch.zeros(v.shape, dtype=F64)
    fills = pb.lengths.clone()
    for i in range(pb.B):
        if int(pb.buffer_slots[i]) < 0:
            continue
        s, e = int(pb.cu[i]), int(pb.cu[i + 1])
        part = lambda t: None if t is None else t[s:e]  # noqa: E731
        o[s:e], fills[i] = core.prefill(part(q), part(k), part(v), part(g), part(beta), state, int(pb.state_slots[i]),
                                        bk, bv, bg, int(pb.buffer_slots[i]), int(pb.lengths[i]), flush_at)
    return o, fills


def _check_against_core(fam, pb: Problem, chunk_size: int, flush_at: int = C):
    before = pb.clone_pools()
    ref_pools = pb.clone_pools()
    o_ref, fills_ref = _run_core(fam, pb, ref_pools, flush_at)
    o, fills = chunked.prefill(*_core_inputs(fam, pb.tok), pb.cu, pb.state, pb.state_slots, pb.buf_k, pb.buf_v,
                               pb.buf_g, pb.buffer_slots, pb.lengths, flush_at, chunk_size)
    assert torch.equal(fills, fills_ref)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=TOL)
    real = pb.buffer_slots >= 0
    padding = torch.repeat_interleave(~real, pb.cu.diff().long())
    assert torch.equal(o[padding], torch.zeros_like(o[padding]))  # exactly zero, not NaN
    # the state pool: touched slots as core left them, every other slot bit-exact
    for slot in range(pb.state.shape[0]):
        if _same_bits(ref_pools[0][slot], before[0][slot]):
            assert _same_bits(pb.state[slot], before[0][slot]), f"state slot {slot} was written"
        else:
            torch.testing.assert_close(pb.state[slot], ref_pools[0][slot], rtol=0, atol=TOL)
    # the buffers up to the new fill; untouched slots bit-exact
    used = {int(pb.buffer_slots[i]): int(fills[i]) for i in range(pb.B) if bool(real[i])}
    for ours, ref, old in zip(pb.pools()[1:], ref_pools[1:], before[1:]):
        for slot in range(ours.shape[0]):
            if slot in used:
                torch.testing.assert_close(ours[slot, :used[slot]], ref[slot, :used[slot]], rtol=0, atol=TOL)
            else:
                assert _same_bits(ours[slot], old[slot]), f"buffer slot {slot} was written"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_equals_core_prefill(family, case):
    """Packed rows of awkward lengths and fills: outputs, fills, states and entries equal core.prefill's."""
    fam = _family(family)
    _check_against_core(fam, Problem(fam, CASES[case], seed=len(case)), chunked.CHUNK_SIZE)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 24, 100])
def test_chunk_size_changes_nothing(family, chunk_size):
    """Chunks shorter than, equal to, across and longer than C: the same results."""
    fam = _family(family)
    rows = [(70, 5, True, False), (C + 3, 0, True, False), (C - 6, 4, False, False), (11, 2, True, True)]
    _check_against_core(fam, Problem(fam, rows, seed=chunk_size), chunk_size)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("flush_at", [1, 5, CAP])
def test_other_flush_sizes(family, flush_at):
    """C = 1 (every token folds), a C that divides no chunk, C = the whole buffer."""
    fam = _family(family)
    rows = [(50, 0, True, False), (flush_at, flush_at - 1, True, False), (flush_at + 2, flush_at // 2, True, False)]
    if flush_at > 1:
        rows.append((flush_at - 1, 0, False, False))
    _check_against_core(fam, Problem(fam, rows, seed=flush_at), 7, flush_at)


def test_long_prompt():
    """A 10,007-token prompt after a partial buffer, packed with a short one: the long row against
    transformers' chunk function from the state its buffer folds into (core.prefill would take a
    minute), the short row against core.prefill; each row's tail flushed at the end."""
    from tests.support.oracles import HF

    fam = _family("gdn")
    P = 10_007
    pb = Problem(fam, [(P, 9, True, False), (C + 5, C - 1, True, False)], seed=3)
    s0, b0 = pb.state_slots[:1], pb.buffer_slots[:1]
    start = pb.clone_pools()
    core.flush(*start[:1], s0, *start[1:], b0, pb.lengths[:1])  # S_f of the long row
    ref = pb.clone_pools()
    o_short, fill_short = _run_core(fam, _only_row(pb, 1), ref)
    o, fills = chunked_ops.gdn_prefill(*fam.args(pb.tok), pb.cu, pb.state, pb.state_slots, pb.buf_k, pb.buf_v,
                                       pb.buf_g, pb.buffer_slots, pb.lengths, C)
    assert fills.tolist() == [(9 + P) % C, int(fill_short[1])]
    torch.testing.assert_close(o[P:], o_short[P:], rtol=0, atol=TOL)
    p = fam.params
    long_tok = fam.slice_tokens(pb.tok, slice(0, P))
    g = -p["A_log"].exp() * F.softplus(long_tok["a"] + p["dt_bias"])
    o_ref, S_ref = HF.gdn_chunk_fp64(long_tok["q"][None], long_tok["k"][None], long_tok["v"][None], g=g[None],
                                     beta=long_tok["b"].sigmoid()[None], chunk_size=64,
                                     initial_state=start[0][s0.long()], output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o[:P], o_ref[0], rtol=0, atol=TOL)
    core.flush(pb.state, pb.state_slots, pb.buf_k, pb.buf_v, pb.buf_g, pb.buffer_slots, fills)
    core.flush(ref[0], pb.state_slots, *ref[1:], pb.buffer_slots, fill_short)
    torch.testing.assert_close(pb.state[s0.long()], S_ref, rtol=0, atol=TOL)
    s1 = int(pb.state_slots[1])
    torch.testing.assert_close(pb.state[s1], ref[0][s1], rtol=0, atol=TOL)


def _only_row(pb: Problem, keep: int) -> Problem:
    """The same problem with every other row made padding (for core.prefill on one row)."""
    view = object.__new__(Problem)
    view.__dict__.update(pb.__dict__)
    view.buffer_slots = torch.where(torch.arange(pb.B) == keep, pb.buffer_slots, torch.full_like(pb.buffer_slots, -1))
    return view


# ----------------------------------------------------------------------------------------------
# outside oracles, from a fresh (zero) state: the prompt's last entries flushed at the end


def _chunked_from_fresh(fam, tok, P):
    s = fam.shape
    state = torch.zeros(2, s.num_v_heads, s.head_k_dim, s.head_v_dim, dtype=F64)
    bk = torch.zeros(2, CAP, s.num_k_heads, s.head_k_dim, dtype=F64)
    bv = torch.zeros(2, CAP, s.num_v_heads, s.head_v_dim, dtype=F64)
    bg = torch.zeros(2, CAP, s.num_v_heads, dtype=F64)
    one, zero = torch.tensor([1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    cu = torch.tensor([0, P], dtype=torch.int32)
    op = chunked_ops.gdn_prefill if fam.name == "gdn" else chunked_ops.mamba2_prefill
    o, fill = op(*fam.args(tok), cu, state, one, bk, bv, bg, zero, zero, C)
    core.flush(state, one, bk, bv, bg, zero, fill)
    return o, state[1]


def _recurrent(fam, tok, P):
    s = fam.shape
    state = torch.zeros(1, s.num_v_heads, s.head_k_dim, s.head_v_dim, dtype=F64)
    zero = torch.tensor([0], dtype=torch.int32)
    outs = [fam.ops.recurrent_step(*fam.args(fam.slice_tokens(tok, slice(t, t + 1))), state, zero)
            for t in range(P)]
    return torch.cat(outs), state[0]


def _hf_or_fla(fam, tok, which):
    from tests.support.oracles import HF, fla_naive

    p = fam.params
    if fam.name == "mamba2":  # transformers' Nemotron-H chunk scan, no dt floor; state (H, P, N)
        o, S = HF.mamba2_scan_fp64(tok["x"][None], tok["dt"][None], -p["A_log"].exp(), tok["B"][None],
                                   tok["C"][None], chunk_size=64, D=p["D"], dt_bias=p["dt_bias"], initial_states=None,
                                   dt_softplus=True, dt_limit=(0.0, float("inf")), return_final_states=True)
        return o[0], S[0].transpose(-1, -2)
    g = -p["A_log"].exp() * F.softplus(tok["a"] + p["dt_bias"])
    beta = tok["b"].sigmoid()
    if which == "hf":
        o, S = HF.gdn_chunk_fp64(tok["q"][None], tok["k"][None], tok["v"][None], g=g[None], beta=beta[None],
                                 chunk_size=64, initial_state=None, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
        return o[0], S[0]
    naive = fla_naive()
    if naive is None:
        pytest.skip("fla-core is not installed (pip install fla-core==0.6.0)")
    Hv = tok["v"].shape[-2]
    prep = lambda x: (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(  # noqa: E731
        Hv // x.shape[-2], dim=-2)[None]
    o, S = naive.chunk_fp64(prep(tok["q"]), prep(tok["k"]), tok["v"][None], g[None], beta[None], chunk_size=64,
                            output_final_state=True)
    return o[0], S[0]


@pytest.mark.parametrize("family,oracle", [("gdn", "recurrent"), ("gdn", "hf"), ("gdn", "fla"),
                                           ("mamba2", "recurrent"), ("mamba2", "hf")])
def test_matches_outside_oracles(family, oracle):
    fam = _family(family)
    P = 203
    tok = fam.tokens(torch.Generator().manual_seed(5), P)
    o, S = _chunked_from_fresh(fam, tok, P)
    o_ref, S_ref = _recurrent(fam, tok, P) if oracle == "recurrent" else _hf_or_fla(fam, tok, oracle)
    torch.testing.assert_close(o, o_ref.to(F64), rtol=0, atol=TOL)
    torch.testing.assert_close(S, S_ref.to(F64), rtol=0, atol=TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_close_to_fp64(family):
    """The op in fp32 (the CPU fast path) with a bf16 buffer stays within fp32 / bf16 rounding of fp64."""
    fam = _family(family)
    rows = [(300, 5, True, False), (C - 7, 3, False, False)]
    pb = Problem(fam, rows, seed=9)
    args = [t.float() if t is not None else None for t in _core_inputs(fam, pb.tok)]
    state32, bk16, bv16, bg32 = (pb.state.float(), torch.nan_to_num(pb.buf_k).bfloat16(),
                                 torch.nan_to_num(pb.buf_v).bfloat16(), torch.nan_to_num(pb.buf_g).float())
    bk64, bv64, bg64 = bk16.double(), bv16.double(), bg32.double()
    state64 = pb.state.clone()
    o64, _ = chunked.prefill(*_core_inputs(fam, pb.tok), pb.cu, state64, pb.state_slots, bk64, bv64, bg64,
                             pb.buffer_slots, pb.lengths, C)
    o32, _ = chunked.prefill(*args, pb.cu, state32, pb.state_slots, bk16, bv16, bg32, pb.buffer_slots, pb.lengths, C)
    scale = float(o64.abs().max())
    assert float((o32.double() - o64).abs().max()) <= 1e-4 * scale
    assert float((state32.double() - state64).abs().max()) <= 1e-4 * float(state64.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_family_wrappers_equal_family_prefill(family):
    """chunked_ops' gating front + chunked prefill: each family's own prefill, request by request."""
    fam = _family(family)
    rows = [(40, 3, True, False), (5, 0, False, False), (C, 0, True, False)]
    pb = Problem(fam, rows, seed=4)
    ref = pb.clone_pools()
    op = chunked_ops.gdn_prefill if family == "gdn" else chunked_ops.mamba2_prefill
    o, fills = op(*fam.args(pb.tok), pb.cu, pb.state, pb.state_slots, pb.buf_k, pb.buf_v, pb.buf_g, pb.buffer_slots,
                  pb.lengths, C)
    for i in range(pb.B):
        s, e = int(pb.cu[i]), int(pb.cu[i + 1])
        o_ref, n = fam.ops.prefill(*fam.args(fam.slice_tokens(pb.tok, slice(s, e))), ref[0], int(pb.state_slots[i]),
                                   *ref[1:], int(pb.buffer_slots[i]), int(pb.lengths[i]), C)
        assert n == int(fills[i])
        torch.testing.assert_close(o[s:e], o_ref, rtol=0, atol=TOL)
    torch.testing.assert_close(pb.state, ref[0], rtol=0, atol=TOL)


# ----------------------------------------------------------------------------------------------
# validation: a bad call raises a typed error naming the problem, and writes nothing


def _bad_calls():
    def cu_short(a):
        a["cu_seqlens"] = a["cu_seqlens"].clone()
        a["cu_seqlens"][-1] -= 1

    def cu_falls(a):
        a["cu_seqlens"] = torch.tensor([0, 30, 20, 47], dtype=torch.int32)

    def no_state(a):
        a["state_slots"] = torch.tensor([-1, 0, 1], dtype=torch.int32)

    def fill_at_C(a):
        a["lengths"] = torch.tensor([C, 0, 0], dtype=torch.int32)

    def repeated_slot(a):
        a["buffer_slots"] = torch.tensor([2, 2, 0], dtype=torch.int32)

    def slot_out_of_range(a):
        a["state_slots"] = torch.tensor([0, 1, 9], dtype=torch.int32)

    def flush_past_cap(a):
        a["flush_at"] = CAP + 1

    def chunk_zero(a):
        a["chunk_size"] = 0

    def v_dtype(a):
        a["v"] = a["v"].to(torch.int64)

    def g_shape(a):
        a["g"] = a["g"][:, :1]

    def lengths_shape(a):
        a["lengths"] = a["lengths"][:2]

    return {"cu_short": (cu_short, ShapeError), "cu_falls": (cu_falls, ShapeError), "no_state": (no_state, SlotError),
            "fill_at_C": (fill_at_C, ShapeError), "repeated_slot": (repeated_slot, SlotError),
            "slot_out_of_range": (slot_out_of_range, SlotError), "flush_past_cap": (flush_past_cap, ShapeError),
            "chunk_zero": (chunk_zero, ShapeError), "v_dtype": (v_dtype, DTypeError), "g_shape": (g_shape, ShapeError),
            "lengths_shape": (lengths_shape, ShapeError)}


BAD = _bad_calls()


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
def test_bad_call_writes_nothing(bad):
    fam = _family("gdn")
    pb = Problem(fam, [(30, 5, True, False), (C - 3, 0, True, False), (4, 1, True, False)], seed=1)
    q, k, v, g, beta = _core_inputs(fam, pb.tok)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=pb.cu, state=pb.state, state_slots=pb.state_slots,
                buf_k=pb.buf_k, buf_v=pb.buf_v, buf_g=pb.buf_g, buffer_slots=pb.buffer_slots, lengths=pb.lengths,
                flush_at=C, chunk_size=chunked.CHUNK_SIZE)
    before = pb.clone_pools()
    change, error = BAD[bad]
    change(args)
    with pytest.raises(error):
        chunked.prefill(**args)
    assert all(_same_bits(a, b) for a, b in zip(pb.pools(), before))
