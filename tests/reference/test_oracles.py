"""kvbuffer's reference against outside oracles that nobody here wrote.

- Gated DeltaNet: transformers' `torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule`
  (Qwen3.5, and Qwen3-Next's copies) and FLA 0.6.0's `naive_recurrent_gated_delta_rule` /
  `naive_chunk_gated_delta_rule`.
- Mamba-2: transformers' Nemotron-H `mamba2_selective_state_update` / `mamba2_chunk_scan`.
- The short conv: transformers' `causal_conv1d_update` / `causal_conv1d_fn` torch fallbacks.

Every kvbuffer path (recurrent step, buffered steps with fused flushes, speculative verify with
rejected drafts, chunked prefill cut at awkward places) runs in float64 from a nonzero initial
state, on a batch with permuted slots, garbage in unused pool slots and unfilled buffer entries;
after a final flush its states must equal the oracle's final states. Each oracle is compared in
float64 (`promote_fp64`: its own source, fp32 casts turned into fp64) and as shipped in float32.
`pytest -s` prints the measured errors.
"""

from __future__ import annotations

import random
import zlib
from functools import lru_cache

import pytest
import torch
import torch.nn.functional as F

from tests.support.families import make_family
from tests.support.oracles import HF, fla_naive
from kvbuffer.reference import conv, gating

F64 = torch.float64
MAXD = 5  # most drafts per verify
T_LONG = 63  # one short of FLA's / HF's chunk: exercises their padding
SHAPES = {  # (Hk, Hv, K, V): grouped heads 1, 2, 4 and awkward sizes
    "r1_7x7": (2, 2, 7, 7),
    "r2_7x7": (2, 4, 7, 7),
    "r4_5x9": (1, 4, 5, 9),
}
MODES = ("recurrent", "buffered", "verify", "prefill")
FP64_TOL = 1e-13  # absolute; every |output| and |state| entry here is O(1); measured <= 6e-15
FP32_REL_TOL = 1e-5  # relative to max |reference|, for the oracles as shipped (fp32)


def _report(name, errs: dict):
    line = ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
    print(f"\n[oracle] {name}: max abs err {line}")


def _err(a, b):
    return float((a.double() - b.double()).abs().max())


# ----------------------------------------------------------------------------------------------
# problems: a family from tests/support/families.py, T tokens for B rows, a nonzero initial state


@lru_cache(maxsize=None)
def _problem(family: str, shape: str, B: int = 3, T: int = T_LONG, seed: int = 0):
    Hk, Hv, K, V = SHAPES[shape]
    gen = torch.Generator().manual_seed(1000 + seed)
    fam = make_family(family, gen, Hk=Hk, Hv=Hv, K=K, V=V)
    tok = fam.tokens(gen, B, T)
    S0 = torch.randn(B, Hv, K, V, generator=gen, dtype=F64) * 0.5  # key-major, kvbuffer's layout
    junk = fam.tokens(gen, B, MAXD)  # rejected drafts
    return fam, tok, S0, junk


# ----------------------------------------------------------------------------------------------
# kvbuffer, driven through each path


def _run_ours(family: str, shape: str, mode: str, seed: int = 0):
    """Outputs (B, T, Hv, V) and final states (B, Hv, K, V) of one path, everything flushed at the end."""
    fam, tok, S0, junk = _problem(family, shape, seed=seed)
    Hk, Hv, K, V = SHAPES[shape]
    B, T = S0.shape[0], tok[next(iter(tok))].shape[1]
    rng = random.Random(zlib.crc32(f"{family}/{shape}/{mode}/{seed}".encode()))  # not hash(): salted
    gen = torch.Generator().manual_seed(7 + seed)
    ops = fam.ops
    C = {"recurrent": 1, "buffered": 5, "verify": 6, "prefill": 16}[mode]
    cap = C + MAXD

    # pools with garbage everywhere except the rows' state slots (a bug reading the wrong slot,
    # or an unfilled buffer entry, shows up)
    n_slots = B + 2
    sslots = torch.randperm(n_slots, generator=gen)[:B].to(torch.int32)
    bslots = torch.randperm(n_slots, generator=gen)[:B].to(torch.int32)
    state = torch.randn(n_slots, Hv, K, V, generator=gen, dtype=F64)
    state[sslots.long()] = S0
    buf_k = torch.randn(n_slots, cap, Hk, K, generator=gen, dtype=F64)
    buf_v = torch.randn(n_slots, cap, Hv, V, generator=gen, dtype=F64)
    buf_g = torch.randn(n_slots, cap, Hv, generator=gen, dtype=F64)
    untouched = torch.ones(n_slots, dtype=torch.bool)
    untouched[sslots.long()] = False
    state_before = state.clone()
    bufs = (buf_k, buf_v, buf_g)
    out = torch.full((B, T, Hv, V), float("nan"), dtype=F64)
    lengths = torch.zeros(B, dtype=torch.int32)

    def at(t):
        return fam.slice_tokens(tok, (slice(None), t))

    if mode == "recurrent":
        for t in range(T):
            out[:, t] = ops.recurrent_step(*fam.args(at(t)), state, sslots)
    elif mode == "buffered":
        for t in range(T):
            out[:, t] = ops.buffered_step(*fam.args(at(t)), state, sslots, *bufs, bslots, lengths, flush_at=C)
            lengths = (lengths + 1) % C  # the rows that reached C were flushed in the same call
    elif mode == "verify":
        pos = [0] * B
        for _ in range(20 * T):
            if min(pos) == T:
                break
            d = rng.randint(1, MAXD)
            acc = [min(rng.randint(0, d), T - p) for p in pos]
            drafts = {}
            for key, x in tok.items():
                rows = []
                for b in range(B):
                    kept = x[b, pos[b]:pos[b] + acc[b]]
                    rows.append(torch.cat([kept, junk[key][b, :d - acc[b]]], 0))
                drafts[key] = torch.stack(rows)
            done = torch.tensor([p == T for p in pos])
            bs = torch.where(done, -1, bslots).to(torch.int32)  # finished rows become padding
            ss = torch.where(done, -1, sslots).to(torch.int32)
            o = ops.verify(*fam.args(drafts), state, ss, *bufs, bs, lengths)
            # (padding-row outputs are checked in test_properties.py)
            for b in range(B):
                out[b, pos[b]:pos[b] + acc[b]] = o[b, :acc[b]]
                pos[b] += acc[b]
            lengths = lengths + torch.tensor(acc, dtype=torch.int32)
            full = lengths >= C
            if bool(full.any()):
                ops.flush(state, sslots, *bufs, torch.where(full, bslots, -1).to(torch.int32), lengths)
                lengths = torch.where(full, 0, lengths).to(torch.int32)
        assert min(pos) == T
    elif mode == "prefill":
        for b in range(B):
            cuts = sorted(rng.sample(range(1, T), 2))
            n = 0
            for lo, hi in zip([0] + cuts, cuts + [T]):
                piece = fam.slice_tokens(tok, (b, slice(lo, hi)))
                o, n = ops.prefill(*fam.args(piece), state, int(sslots[b]), *bufs, int(bslots[b]), n, C)
                out[b, lo:hi] = o
            lengths[b] = n
    ops.flush(state, sslots, *bufs, bslots, lengths)
    assert torch.equal(state[untouched], state_before[untouched]), "a slot of no row was written"
    assert not out.isnan().any()
    return out, state[sslots.long()].clone()


_ours = lru_cache(maxsize=None)(_run_ours)


# ----------------------------------------------------------------------------------------------
# the oracles, on the same problems


def _hf_gdn_inputs(fam, tok):
    """The gating exactly as Qwen3.5's Qwen3_5GatedDeltaNet.forward writes it (L2 norm left to the kernel)."""
    p = fam.params
    beta = tok["b"].sigmoid()
    g = -p["A_log"].exp() * F.softplus(tok["a"] + p["dt_bias"])
    return tok["q"], tok["k"], tok["v"], g, beta


def _fla_inputs(fam, tok):
    """FLA's naive functions do no L2 norm and no GQA: normalise (eps 1e-6, rsqrt form) and expand here."""
    q, k, v, g, beta = _hf_gdn_inputs(fam, tok)
    Hv = v.shape[-2]

    def prep(x):
        x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
        return x.repeat_interleave(Hv // x.shape[-2], dim=-2)

    return prep(q), prep(k), v, g, beta


def _gdn_oracle(name: str, fam, tok, S0):
    if name.startswith("fla"):
        naive = fla_naive()
        if naive is None:
            pytest.skip("fla-core is not installed (pip install fla-core==0.6.0)")
        q, k, v, g, beta = _fla_inputs(fam, tok)
        kind, prec = name.split("_")[1], name.split("_")[-1]
        if kind == "recurrent":
            fn = naive.recurrent_fp64 if prec == "fp64" else naive.recurrent_fp32
            return fn(q, k, v, beta, g, initial_state=S0, output_final_state=True)  # (.., beta, g)
        cs = int(name.split("_")[2][1:])
        fn = naive.chunk_fp64 if prec == "fp64" else naive.chunk_fp32
        return fn(q, k, v, g, beta, chunk_size=cs, initial_state=S0, output_final_state=True)  # (.., g, beta)
    q, k, v, g, beta = _hf_gdn_inputs(fam, tok)
    kw = dict(initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    table = {
        "hf_recurrent_fp64": (HF.gdn_recurrent_fp64, {}),
        "hf_recurrent_fp32": (HF.gdn_recurrent_fp32, {}),
        "hf_chunk_c64_fp64": (HF.gdn_chunk_fp64, dict(chunk_size=64)),
        "hf_chunk_c16_fp64": (HF.gdn_chunk_fp64, dict(chunk_size=16)),
        "hf_chunk_c64_fp32": (HF.gdn_chunk_fp32, dict(chunk_size=64)),
        "next_recurrent_fp64": (HF.next_gdn_recurrent_fp64, {}),
        "next_chunk_c16_fp64": (HF.next_gdn_chunk_fp64, dict(chunk_size=16)),
    }
    fn, extra = table[name]
    return fn(q, k, v, g=g, beta=beta, **kw, **extra)


def _mamba2_oracle(name: str, fam, tok, S0):
    p = fam.params
    A = -p["A_log"].exp()
    S0_hf = S0.transpose(-1, -2).contiguous()  # ours (H, N, P) -> transformers' (H, P, N)
    prec = name.split("_")[-1]
    if name.startswith("hf_update"):
        fn = HF.mamba2_update_fp64 if prec == "fp64" else HF.mamba2_update_fp32
        x, dt, Bm, Cm = tok["x"], tok["dt"], tok["B"], tok["C"]
        Bt, T, H, P = x.shape
        N = Bm.shape[-1]
        state = S0_hf.clone()
        outs = []
        for t in range(T):  # argument shapes exactly as NemotronHMamba2Mixer's decode branch builds them
            outs.append(fn(state, x[:, t], dt[:, t, :, None].expand(-1, -1, P),
                           A[:, None, None].expand(-1, P, N), Bm[:, t], Cm[:, t],
                           p["D"][:, None].expand(-1, P), z=None,
                           dt_bias=p["dt_bias"][:, None].expand(-1, P), dt_softplus=True))
        o, S = torch.stack(outs, 1), state
    else:
        cs = int(name.split("_")[2][1:])
        fn = HF.mamba2_scan_fp64 if prec == "fp64" else HF.mamba2_scan_fp32
        # dt_limit (0, inf): no dt floor, as kvbuffer (gating.mamba2_front) and HF's own decode
        o, S = fn(tok["x"], tok["dt"], A, tok["B"], tok["C"], chunk_size=cs, D=p["D"], dt_bias=p["dt_bias"],
                  initial_states=S0_hf, dt_softplus=True, dt_limit=(0.0, float("inf")), return_final_states=True)
    return o, S.transpose(-1, -2)


@lru_cache(maxsize=None)
def _oracle(family, shape, name):
    fam, tok, S0, _ = _problem(family, shape)
    fn = _gdn_oracle if family == "gdn" else _mamba2_oracle
    o, S = fn(name, fam, tok, S0.clone())
    return o.double(), S.double()


GDN_FP64 = ("hf_recurrent_fp64", "hf_chunk_c64_fp64", "hf_chunk_c16_fp64", "next_recurrent_fp64",
            "next_chunk_c16_fp64", "fla_recurrent_fp64", "fla_chunk_c64_fp64", "fla_chunk_c16_fp64")
GDN_FP32 = ("hf_recurrent_fp32", "hf_chunk_c64_fp32", "fla_recurrent_fp32", "fla_chunk_c64_fp32")
MAMBA2_FP64 = ("hf_update_fp64", "hf_scan_c64_fp64", "hf_scan_c16_fp64")
MAMBA2_FP32 = ("hf_update_fp32", "hf_scan_c64_fp32")
CASES = ([("gdn", o) for o in GDN_FP64 + GDN_FP32] + [("mamba2", o) for o in MAMBA2_FP64 + MAMBA2_FP32])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family,oracle", CASES)
def test_every_path_matches_oracle(family, oracle, shape):
    """Outputs of every kvbuffer path and its state after the final flush equal the oracle's."""
    o_ref, S_ref = _oracle(family, shape, oracle)
    errs, worst = {}, 0.0
    for mode in MODES:
        o, S = _ours(family, shape, mode)
        e_o, e_s = _err(o, o_ref), _err(S, S_ref)
        errs[f"{mode}(o)"], errs[f"{mode}(S)"] = e_o, e_s
        worst = max(worst, e_o, e_s)
    _report(f"{family} {shape} vs {oracle}", errs)
    if oracle.endswith("fp64"):
        assert worst <= FP64_TOL
    else:
        scale = max(float(o_ref.abs().max()), float(S_ref.abs().max()))
        assert worst <= FP32_REL_TOL * scale


def test_oracles_agree_with_each_other():
    """Sanity of the oracle set itself: Qwen3.5 / Qwen3-Next / FLA, recurrent / chunked agree in fp64."""
    errs = {}
    for family, names in (("gdn", GDN_FP64), ("mamba2", MAMBA2_FP64)):
        if family == "gdn" and fla_naive() is None:
            names = tuple(n for n in names if not n.startswith("fla"))
        o0, S0 = _oracle(family, "r2_7x7", names[0])
        for n in names[1:]:
            o, S = _oracle(family, "r2_7x7", n)
            errs[f"{family} {n}"] = max(_err(o, o0), _err(S, S0))
    _report(f"oracles vs {GDN_FP64[0]} / {MAMBA2_FP64[0]}", errs)
    assert max(errs.values()) <= FP64_TOL


# ----------------------------------------------------------------------------------------------
# short contexts without a state, the fronts, Mamba-2's output gate


@pytest.mark.parametrize("family", ("gdn", "mamba2"))
def test_short_context_without_state_matches_oracle_from_zero(family):
    """A prompt that never fills the buffer runs with state slot -1 (S0 = 0) and allocates nothing."""
    fam, tok, _, _ = _problem(family, "r2_7x7")
    Hk, Hv, K, V = SHAPES["r2_7x7"]
    T, C = 11, 16
    tok = fam.slice_tokens(tok, (slice(0, 1), slice(0, T)))
    zero = torch.zeros(1, Hv, K, V, dtype=F64)
    o_ref, _ = (_gdn_oracle if family == "gdn" else _mamba2_oracle)(
        "hf_recurrent_fp64" if family == "gdn" else "hf_update_fp64", fam, tok, zero)
    state = torch.randn(2, Hv, K, V, dtype=F64)
    before = state.clone()
    bufs = (torch.zeros(1, C, Hk, K, dtype=F64), torch.zeros(1, C, Hv, V, dtype=F64), torch.zeros(1, C, Hv, dtype=F64))
    o, n = fam.ops.prefill(*fam.args(fam.slice_tokens(tok, 0)), state, -1, *bufs, 0, 0, C)
    err = _err(o, o_ref[0])
    _report(f"{family} stateless prefill (T={T} < C={C}) vs zero-state oracle", {"o": err})
    assert n == T and err <= FP64_TOL and torch.equal(state, before)


def test_gdn_front_matches_transformers_gating():
    """gdn_front's q, k, g, beta equal what Qwen3.5's forward and its kernel compute."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm as hf_l2norm

    fam, tok, _, _ = _problem("gdn", "r4_5x9")
    q, k, g, beta = gating.gdn_front(tok["q"], tok["k"], tok["a"], tok["b"], fam.params["A_log"],
                                     fam.params["dt_bias"], F64)
    _, _, _, g_ref, beta_ref = _hf_gdn_inputs(fam, tok)
    K = tok["q"].shape[-1]
    errs = {"q": _err(q, hf_l2norm(tok["q"]) * K ** -0.5), "k": _err(k, hf_l2norm(tok["k"])),
            "g": _err(g, g_ref), "beta": _err(beta, beta_ref)}
    _report("gdn_front vs transformers gating", errs)
    assert max(errs.values()) <= 1e-14


def test_mamba2_recurrent_step_with_gate_z():
    """recurrent_step's optional gate y * silu(z) as in selective_state_update."""
    fam, tok, S0, _ = _problem("mamba2", "r2_7x7")
    p = fam.params
    t = fam.slice_tokens(tok, (slice(None), 0))
    z = torch.randn(t["x"].shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    state = S0.clone()
    y = fam.ops.recurrent_step(*fam.args(t), state, torch.arange(3, dtype=torch.int32), z=z)
    ref_state = S0.transpose(-1, -2).contiguous()
    P, N = t["x"].shape[-1], t["B"].shape[-1]
    y_ref = HF.mamba2_update_fp64(ref_state, t["x"], t["dt"][..., None].expand(-1, -1, P),
                                  (-p["A_log"].exp())[:, None, None].expand(-1, P, N), t["B"], t["C"],
                                  p["D"][:, None].expand(-1, P), z=z,
                                  dt_bias=p["dt_bias"][:, None].expand(-1, P), dt_softplus=True)
    errs = {"y": _err(y, y_ref), "S": _err(state, ref_state.transpose(-1, -2))}
    _report("mamba2 recurrent_step(z) vs selective_state_update(z)", errs)
    assert max(errs.values()) <= FP64_TOL


# ----------------------------------------------------------------------------------------------
# the short causal conv


def _conv_setup(seed, B=3, D=6, W=4, with_bias=True):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(D, W, generator=gen, dtype=F64)
    bias = torch.randn(D, generator=gen, dtype=F64) if with_bias else None
    n_slots = B + 2
    slots = torch.randperm(n_slots, generator=gen)[:B].to(torch.int32)
    ours = torch.randn(n_slots, D, W - 1 + MAXD, generator=gen, dtype=F64)  # garbage in pending + other slots
    hf = torch.randn(B, D, W, generator=gen, dtype=F64)  # transformers keeps the last W inputs
    ours[slots.long(), :, :W - 1] = hf[:, :, 1:]  # ... of which only the last W-1 matter
    return gen, weight, bias, slots, ours, hf


CONV_VARIANTS = [(True, "silu"), (False, "silu"), (True, None)]


@pytest.mark.parametrize("with_bias,act", CONV_VARIANTS)
def test_conv_step_matches_causal_conv1d_update(with_bias, act):
    gen, weight, bias, slots, ours, hf = _conv_setup(1, with_bias=with_bias)
    W = weight.shape[1]
    other = torch.ones(ours.shape[0], dtype=torch.bool)
    other[slots.long()] = False
    other_before = ours[other].clone()
    errs = {"o": 0.0, "hist": 0.0}
    update = HF.conv_update if with_bias else HF.nemotron_conv_update  # both models' copies
    for _ in range(9):
        x = torch.randn(3, weight.shape[0], generator=gen, dtype=F64)
        o = conv.conv_step(x, ours, slots, weight, bias, act)
        o_ref = update(x[:, :, None], hf, weight, bias, act)[:, :, 0]
        errs["o"] = max(errs["o"], _err(o, o_ref))
        errs["hist"] = max(errs["hist"], _err(ours[slots.long(), :, :W - 1], hf[:, :, 1:]))
    _report(f"conv_step vs causal_conv1d_update (bias={with_bias}, act={act})", errs)
    assert max(errs.values()) <= 1e-13
    assert torch.equal(ours[other], other_before)


@pytest.mark.parametrize("with_bias,act", CONV_VARIANTS)
def test_conv_verify_accept_rollback_matches_causal_conv1d_update(with_bias, act):
    """verify(T) outputs = HF multi-token update; accept(m) history = HF after the m accepted inputs only."""
    gen, weight, bias, slots, ours, hf = _conv_setup(2, with_bias=with_bias)
    W, D = weight.shape[1], weight.shape[0]
    rng = random.Random(2)
    errs = {"o": 0.0, "hist": 0.0}
    for _ in range(12):
        T = rng.randint(1, MAXD)
        acc = [rng.randint(0, T) for _ in range(3)]
        x = torch.randn(3, T, D, generator=gen, dtype=F64)
        o = conv.conv_verify(x, ours, slots, weight, bias, act)
        o_ref = HF.conv_update(x.transpose(1, 2), hf.clone(), weight, bias, act).transpose(1, 2)
        errs["o"] = max(errs["o"], _err(o, o_ref))
        conv.conv_accept(ours, slots, torch.tensor(acc, dtype=torch.int32), W)
        for b, m in enumerate(acc):
            if m:
                HF.conv_update(x[b:b + 1, :m].transpose(1, 2), hf[b:b + 1], weight, bias, act)
        errs["hist"] = max(errs["hist"], _err(ours[slots.long(), :, :W - 1], hf[:, :, 1:]))
    _report(f"conv_verify+accept vs causal_conv1d_update (bias={with_bias}, act={act})", errs)
    assert errs["o"] <= 1e-13 and errs["hist"] == 0.0  # the history is a copy of inputs: exact


@pytest.mark.parametrize("with_bias,act", CONV_VARIANTS)
def test_conv_prefill_matches_conv1d_prefill(with_bias, act):
    """conv_prefill = transformers' F.conv1d prefill: fresh (zero history) and after a cached history."""
    gen, weight, bias, slots, ours, hf = _conv_setup(3, with_bias=with_bias)
    W, D = weight.shape[1], weight.shape[0]
    errs = {}
    # a fresh request: no cache, causal_conv1d_fn pads with zeros
    fresh = torch.zeros(1, D, W - 1 + MAXD, dtype=F64)
    x = torch.randn(13, D, generator=gen, dtype=F64)
    o = conv.conv_prefill(x, fresh, 0, weight, bias, act)
    errs["fresh o"] = _err(o, HF.conv_fn(x.T[None], weight, bias, act)[0].T)
    errs["fresh hist"] = _err(fresh[0, :, :W - 1], x.T[:, -(W - 1):])
    # with a history: the cached prefill runs causal_conv1d_fn over [conv_state, x] and keeps the tail
    for b in range(3):
        T = (2, 1, 17)[b]
        x = torch.randn(T, D, generator=gen, dtype=F64)
        o = conv.conv_prefill(x, ours, int(slots[b]), weight, bias, act)
        window = torch.cat([hf[b], x.T], -1)[None]
        o_ref = HF.conv_fn(window, weight, bias, act)[0, :, -T:].T
        errs[f"T={T} o"] = _err(o, o_ref)
        errs[f"T={T} hist"] = _err(ours[int(slots[b]), :, :W - 1], window[0, :, -(W - 1):])
    _report(f"conv_prefill vs causal_conv1d_fn (bias={with_bias}, act={act})", errs)
    assert max(errs.values()) <= 1e-13
