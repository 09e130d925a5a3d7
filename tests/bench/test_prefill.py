"""`kvbuffer bench prefill` on the CPU: the FLOP count, the packed inputs and the fp64 reference, the gate
with stand-ins that have the peers' signatures and semantics, the table and JSON, and the end-to-end
harness on tiny presets. The kernel timings themselves need CUDA (tests/gpu/test_bench_prefill.py)."""

import json

import pytest
import torch
import torch.nn.functional as F

from kvbuffer.bench import kernels as common
from kvbuffer.bench import prefill
from kvbuffer.reference import chunked
from kvbuffer.reference.core import clamp_log_decay
from kvbuffer.reference.gating import l2norm

HEADS = {"gdn": dict(Hk=2, Hv=4, K=16, V=16), "mamba2": dict(Hk=2, Hv=4, K=16, V=8)}
CASES = {"packed": (40, 1, 63, 64, 65, 7), "single": (130,)}


@pytest.mark.parametrize("delta_rule", [True, False], ids=["delta", "decay_only"])
@pytest.mark.parametrize("Hv, K, V, C", [(32, 128, 128, 64), (64, 128, 64, 64), (3, 48, 80, 16)])
def test_chunk_flops_count_every_product_of_a_chunk(delta_rule, Hv, K, V, C):
    """2 m n k per (m x k) @ (k x n) product of one chunk of C tokens, per value head."""
    products = [(C, C, K), (C, K, V), (C, V, K), (C, C, V)]  # Q K^T; Q S; K^T U (the state update); (Q K^T) U
    if delta_rule:
        products += [(C, C, K), (C, C, K), (C, C, V), (C, K, V)]  # K K^T; T (beta K) = W; T (beta V); W S
    per_chunk = sum(2 * m * n * k for m, n, k in products)
    tokens = 5 * C
    assert prefill.chunk_flops(delta_rule, tokens, Hv, K, V, C) == Hv * 5 * per_chunk


@pytest.mark.parametrize("lengths, kw", [((512, 131072), dict(lo=512, hi=131072)), ((1, 7), {})])
def test_check_lengths_accepts(lengths, kw):
    assert prefill.check_lengths(lengths, **kw) == lengths


@pytest.mark.parametrize("lengths, kw", [((511,), dict(lo=512)), ((131073,), dict(lo=512, hi=131072)), ((), {}),
                                         ((0,), {}), ((4.0,), {}), ((True,), {})],
                         ids=["short", "long", "none", "zero", "float", "bool"])
def test_check_lengths_rejects_naming_the_option(lengths, kw):
    with pytest.raises(ValueError, match="--prompt-lens"):
        prefill.check_lengths(lengths, **kw)


def _recurrence(q, k, v, g, beta, state):
    """The plain recurrence of one sequence, fp64: outputs and the final state."""
    r = v.shape[1] // k.shape[1]
    q, k = (x.double().repeat_interleave(r, dim=1) for x in (q, k))
    S, outs = state.double().clone(), []
    for t in range(v.shape[0]):
        S = S * clamp_log_decay(g[t].double()).exp()[:, None, None]
        u = v[t].double() if beta is None else beta[t].double()[:, None] * (v[t].double() - torch.einsum(
            "hkv,hk->hv", S, k[t]))
        S = S + k[t][:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(outs), S


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_reference_folds_every_token_as_the_recurrence(family):
    inp = prefill.Packed(family, HEADS[family], (5, 70, 1), device="cpu", seed=3)
    y, core, finals = prefill.reference(inp)
    t, cu = inp.tokens[0], inp.cu.tolist()
    for i in range(inp.B):
        sl = slice(cu[i], cu[i + 1])
        if family == "gdn":
            o, S = _recurrence(t["qn"][sl], t["kn"][sl], t["v"][sl], t["g"][sl], t["beta"][sl], inp.window(0)[i])
        else:
            dt = F.softplus(t["dt"][sl].double() + inp.params[1].double())
            v = dt[..., None] * t["x"][sl].double()
            o, S = _recurrence(t["C"][sl], t["B"][sl], v, dt * -inp.params[0].double().exp(), None, inp.window(0)[i])
        assert torch.allclose(core[sl], o, rtol=1e-9, atol=1e-9)
        assert torch.allclose(finals[i], S, rtol=1e-9, atol=1e-9)
    if family == "mamba2":
        assert torch.allclose(y, core + inp.params[2].double()[:, None] * t["x"].double())


def test_packed_sets_use_disjoint_windows_of_the_pool():
    inp = prefill.Packed("gdn", HEADS["gdn"], (3, 4), sets=3, device="cpu")
    assert [inp.slots(s).tolist() for s in range(4)] == [[0, 1], [2, 3], [4, 5], [0, 1]]
    assert inp.window(1).data_ptr() == inp.state[2].data_ptr() and inp.cu.tolist() == [0, 3, 7]
    assert inp.set_bytes() > inp.N * (2 * 2 * 16 + 2 * 4 * 16)
    zero = prefill.Packed("mamba2", HEADS["mamba2"], (3, 4), zero_states=True, device="cpu")
    assert not zero.state.any() and inp.state.any()


def _prefill32(q, k, v, g, beta, cu, state, slots):
    """Every token folded by the chunked reference at fp32, in place on `state` at `slots`."""
    B, (Hk, K), (Hv, V) = slots.shape[0], k.shape[1:], v.shape[1:]
    bufs = (torch.zeros(B, 1, Hk, K), torch.zeros(B, 1, Hv, V), torch.zeros(B, 1, Hv))
    rows = (torch.arange(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32))
    o, _ = chunked.prefill(q.float(), k.float(), v.float(), g.float(), None if beta is None else beta.float(), cu,
                           state, slots, *bufs, *rows, flush_at=1)
    return o


def our_standin(*args):
    """Our kernel's contract (kvbuffer.kernels.prefill) on the CPU: GDN's after its front, Mamba-2's from the
    raw inputs (its front and D skip inside)."""
    *tokens, cu_seqlens, state, state_slots, out = args
    if len(tokens) == 5:
        return out.copy_(_prefill32(*tokens, cu_seqlens, state, state_slots))
    x, dt, A_log, dt_bias, B, C, D = tokens
    dtv = F.softplus(dt.float() + dt_bias)
    o = _prefill32(C, B, dtv[..., None] * x.float(), dtv * -A_log.exp(), None, cu_seqlens, state, state_slots)
    return out.copy_(o + D[:, None] * x.float())


def fla_standin(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                use_qk_l2norm_in_kernel=False, ignore_initial_state=False):
    """chunk_gated_delta_rule's contract: [1, N, H, D] inputs, a new final state per sequence."""
    assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and output_final_state
    q, k = q[0].float(), k[0].float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    state = torch.zeros_like(initial_state) if ignore_initial_state else initial_state.clone()
    slots = torch.arange(state.shape[0], dtype=torch.int32)
    o = _prefill32(q * scale, k, v[0], g[0], beta[0], cu_seqlens, state, slots)
    return o[None].to(v.dtype), state


def scan_standin(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False, initial_states=None,
                 seq_idx=None, cu_seqlens=None, return_final_states=False, return_varlen_states=False):
    """mamba_chunk_scan_combined's contract: (1, N, ...) inputs, states (P, N), one initial state per batch row
    (packed prompts after the first start from zero), final states per sequence with return_varlen_states."""
    n = cu_seqlens.shape[0] - 1
    assert dt_softplus and (seq_idx is not None) == return_varlen_states == (n > 1) != return_final_states
    if seq_idx is not None:
        assert seq_idx.shape == x.shape[:2] and seq_idx[0, -1] == n - 1
    H, P, N = x.shape[2], x.shape[3], B.shape[3]
    dtv = F.softplus(dt[0].float() + dt_bias)
    state = torch.zeros(n, H, N, P)
    if initial_states is not None:
        state[0] = initial_states[0].transpose(-1, -2)
    o = _prefill32(C[0], B[0], dtv[..., None] * x[0].float(), dtv * A, None, cu_seqlens, state,
                   torch.arange(n, dtype=torch.int32))
    return (o + D[:, None] * x[0].float())[None].to(x.dtype), state.transpose(-1, -2)


@pytest.mark.parametrize("family, peers", [("gdn", {"fla": fla_standin, "fla_qk_l2norm": fla_standin}),
                                           ("mamba2", {"mamba_ssm": scan_standin})], ids=["gdn", "mamba2"])
def test_gate_passes_every_op_that_keeps_the_contract(family, peers):
    errors = prefill.gate(family, HEADS[family], our_standin, peers, device="cpu", cases=CASES)
    ops = {"gdn": ("kvbuffer", "fla", "fla_qk_l2norm"), "mamba2": ("kvbuffer", "mamba_ssm")}
    assert set(errors) == {f"{op}/{case}/{what}" for op in ops[family] for case in CASES for what in ("o", "state")}
    common.check_gate(errors, family)
    assert max(errors.values()) < 1e-2


def test_gate_catches_a_peer_that_drops_the_initial_states():
    def dropping(*args, **kwargs):
        return fla_standin(*args, **kwargs, ignore_initial_state=True)

    errors = prefill.gate("gdn", HEADS["gdn"], our_standin, {"fla": dropping, "fla_qk_l2norm": fla_standin},
                          device="cpu", cases=CASES)
    with pytest.raises(RuntimeError, match="fla/packed/o"):
        common.check_gate(errors, "gdn")
    assert max(v for k, v in errors.items() if not k.startswith("fla/")) < 1e-2


def test_gate_catches_outputs_left_unwritten():
    def lazy(q, k, v, g, beta, cu_seqlens, state, state_slots, out):
        _prefill32(q, k, v, g, beta, cu_seqlens, state, state_slots)
        return out  # poisoned with NaN by the gate

    errors = prefill.gate("gdn", HEADS["gdn"], lazy, {}, device="cpu", cases=CASES)
    assert errors["kvbuffer/packed/o"] == float("inf") and errors["kvbuffer/packed/state"] < 1e-2


def test_kernel_row_and_table():
    heads = HEADS["gdn"]
    measured = {"kvbuffer": (2e-3, "graph"), "fla": (3e-3, "graph"), "fla_qk_l2norm": (4e-3, "eager: capture failed")}
    row = prefill.kernel_row("gdn", "qwen3.5-9b", heads, 8, 4096, measured)
    assert row["tokens"] == 8 * 4096 and row["us"]["fla"] == pytest.approx(3000)
    assert row["tokens_per_s"]["kvbuffer"] == pytest.approx(8 * 4096 / 2e-3)
    assert row["tflops"]["kvbuffer"] == pytest.approx(prefill.chunk_flops(True, 8 * 4096, 4, 16, 16) / 2e-3 / 1e12)
    assert row["over_kvbuffer"] == pytest.approx({"fla": 1.5, "fla_qk_l2norm": 2.0})
    result = prefill.new_result("kernels", timing="cuda-graph", rows=[])
    result["rows"].append(row)
    assert json.loads(json.dumps(result)) == result
    lines = prefill.kernels_table(result).splitlines()
    assert len(lines) == 2 + 3 + 1
    assert lines[2].split()[:4] == ["gdn", "8", "4096", "kvbuffer"] and lines[3].split()[-1] == "1.50"
    assert lines[4].endswith("(eager)")


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-nemotron"])
def test_e2e_runs_both_sides_on_the_cpu(preset):
    pytest.importorskip("transformers")
    result = prefill.run_e2e(preset=preset, prompt_lens=(16, 40), device="cpu", repeats=1,
                             engine={"max_prefill_tokens": 32})
    assert [(r["side"], r["P"]) for r in result["rows"]] == [("kvbuffer", 16), ("kvbuffer", 40),
                                                             ("transformers", 16), ("transformers", 40)]
    for r in result["rows"]:
        assert r["ttft_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["P"] / r["ttft_s"])
        assert r["peak_gib"] is None and r["device_busy_s"] is None  # no CUDA memory or device time to report
    assert result["rows"][0]["path"].startswith("reference") and result["rows"][0]["max_prefill_tokens"] == 32
    assert result["rows"][-1]["path"] == "torch (inputs on cpu)"
    assert json.loads(json.dumps(result)) == result
    table = prefill.e2e_table(result).splitlines()
    assert len(table) == 2 + 4 and table[-1].split()[:2] == ["transformers", "40"]
    assert table[-1].split()[4:8] == ["-"] * 4  # peak, prefill memory, busy time, launches: CUDA only


def test_e2e_without_transformers_times_kvbuffer_alone(monkeypatch):
    monkeypatch.setattr(prefill, "transformers_rows", lambda *a, **k: pytest.fail("timed transformers"))
    result = prefill.run_e2e(preset="tiny-qwen", prompt_lens=(16,), device="cpu", repeats=1, transformers=False)
    assert [(r["side"], r["P"]) for r in result["rows"]] == [("kvbuffer", 16)]
    assert len(prefill.e2e_table(result).splitlines()) == 2 + 1


@pytest.mark.parametrize("kwargs, match", [(dict(prompt_lens=(0,)), "--prompt-lens"), (dict(repeats=0), "--repeats"),
                                           (dict(preset="nope"), "unknown model preset")])
def test_e2e_rejects_bad_arguments_before_building_anything(kwargs, match, monkeypatch):
    monkeypatch.setattr(prefill, "kvbuffer_rows", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(ValueError, match=match):
        prefill.run_e2e(**{"preset": "tiny-qwen", "device": "cpu", **kwargs})


def test_kernels_reject_bad_lengths_before_anything_else(monkeypatch):
    monkeypatch.setattr(prefill.timing, "require_cuda", lambda what: pytest.fail("reached the GPU check"))
    with pytest.raises(ValueError, match="--prompt-lens"):
        prefill.run_kernels(prompt_lens=(256,))
    with pytest.raises(ValueError, match="--families"):
        prefill.run_kernels(families=("rwkv",))


class _Event:
    """A CUDA event stand-in on a fake clock: each record() reads the clock (ms)."""

    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = _Event.clock[0]

    def elapsed_time(self, end):
        return end.at - self.at


def _peer_entry():
    """A peer's entry point whose module-level stages advance the fake clock by known times (ms)."""
    def stage_a(x):
        _Event.clock[0] += 2.0
        return x + 1

    def stage_b(x):
        _Event.clock[0] += 0.5
        return x * 2

    scope = {"__name__": "peer.module", "stage_a": stage_a, "stage_b": stage_b}
    exec("def entry(x):\n    return stage_b(stage_a(x)) + stage_b(x)\n", scope)
    return scope["entry"]


def test_peer_breakdown_times_each_named_stage_and_restores_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    entry = _peer_entry()
    before = dict(entry.__globals__)
    got = prefill.peer_breakdown(entry, ("stage_a", "stage_b", "absent"), lambda s: entry(3), replays=3)
    assert got == pytest.approx({"stage_a": 2000.0, "stage_b": 1000.0, "sum": 3000.0})  # µs; stage_b twice a call
    assert entry.__globals__["stage_a"] is before["stage_a"] and entry.__globals__["stage_b"] is before["stage_b"]
    assert prefill.peer_breakdown(entry, ("nothing",), lambda s: entry(3), replays=1).startswith("not separable")


def test_breakdown_shows_in_the_table():
    heads = HEADS["mamba2"]
    row = prefill.kernel_row("mamba2", "nemotron-3-nano", heads, 1, 4096,
                             {"kvbuffer": (1e-3, "graph"), "kvbuffer[states_BV=16]": (2e-3, "graph")})
    assert row["over_kvbuffer"] == pytest.approx({"kvbuffer[states_BV=16]": 2.0})
    row["breakdown"] = {"kvbuffer": {"chunks": 3.0, "states": 500.0, "output": 400.0, "sum": 903.0},
                        "mamba_ssm": "not separable: none of _chunk_scan_fwd in m"}
    result = prefill.new_result("kernels", timing="cuda-graph")
    result["rows"].append(row)
    table = prefill.kernels_table(result)
    assert "states=500.0" in table and "not separable" in table
    assert prefill.variant_name({"states_BV": 16, "prep_solve": "blockwise"}) == \
        "kvbuffer[prep_solve=blockwise,states_BV=16]"


def test_gate_runs_our_variants_beside_the_default():
    errors = prefill.gate("mamba2", HEADS["mamba2"], our_standin, {}, device="cpu", cases=CASES,
                          variants={"kvbuffer[states_BV=16]": our_standin})
    assert {k.split("/")[0] for k in errors} == {"kvbuffer", "kvbuffer[states_BV=16]"}
    assert max(errors.values()) < 1e-2


def test_a_variant_that_does_not_build_is_dropped_alone():
    def good(*args):
        return our_standin(*args)

    def bad(*args):
        raise AssertionError("never run")

    good.load = lambda batch: object()
    bad.load = lambda batch: (_ for _ in ()).throw(ValueError("BV=48 must divide V"))
    dropped = {}
    kept = prefill._built_variants({"kvbuffer[a=1]": good, "kvbuffer[b=2]": bad}, dropped)
    assert list(kept) == ["kvbuffer[a=1]"] and dropped["kvbuffer[b=2]"].startswith("did not build: BV=48")


def test_attention_cases_cover_the_prompt_in_pieces():
    cases = prefill.attention_cases(5000, piece=2048)
    assert cases == {"fresh": [(0, 5000)], "last_piece": [(4096, 904)],
                     "pieces": [(0, 2048), (2048, 2048), (4096, 904)]}
    assert prefill.attention_cases(4096, piece=2048)["last_piece"] == [(2048, 2048)]


def test_attention_flops_count_the_visible_pairs():
    H, D = 3, 8
    assert prefill.attention_flops((H, 1, D), [(0, 4)]) == 4 * H * D * 10  # 1 + 2 + 3 + 4 pairs
    assert prefill.attention_flops((H, 1, D), [(5, 2), (0, 1)]) == 4 * H * D * (10 + 3 + 1)
    assert prefill.attention_heads("qwen3.5-9b") == (16, 4, 256)


def test_attention_gate_on_the_cpu_with_math_stand_ins(monkeypatch):
    """The gate's wiring (inputs, reference, per-backend calls) with each backend's calls as fp32 math."""
    from kvbuffer.runtime import cudnn_prompt, flash_prompt
    from tests.kernels.test_prompt_attention_split import bottom_right, math_part

    def as_float(fn):
        def run(q, k, v, *rest):
            out = fn(q.double(), k.double(), v.double(), *rest)
            return tuple(o.to(q.dtype) if o.dtype == torch.float64 and o.dim() == 4 else o for o in out) \
                if isinstance(out, tuple) else out.to(q.dtype)
        return run
    monkeypatch.setattr(flash_prompt, "_flash", as_float(bottom_right))
    monkeypatch.setattr(cudnn_prompt, "cudnn_part", as_float(math_part))
    monkeypatch.setattr(cudnn_prompt, "cudnn_causal", as_float(lambda q, k, v, s: math_part(q, k, v, s, True)[0]))
    monkeypatch.setattr(prefill, "attention_backends", lambda heads, device="cuda": ("flash", "cudnn"))
    errors = prefill.attention_gate((4, 2, 16), device="cpu", cases={"fresh": (33, 0), "piece": (20, 17),
                                                                     "one_token": (1, 9)})
    assert set(errors) == {f"{b}/{c}" for b in ("flash", "cudnn") for c in ("fresh", "piece", "one_token")}
    assert max(errors.values()) < 1e-2, errors
