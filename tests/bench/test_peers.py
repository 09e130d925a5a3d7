"""kvbuffer.bench.peers wired into the engine, on CPU: the peers' kernels (FLA's Triton indexed
recurrent kernel fused_recurrent_kda_fwd, mamba_ssm's selective_state_update) need a GPU, so
stand-ins with their signatures run here: FLA's own naive recurrence (fla-core's naive.py, loaded without its
Triton package) and a transcription of selective_state_update's math. Both must give the tokens and
logits of kvbuffer's recurrent mode, plain and speculative, with padding rows (graph buckets)."""

import importlib.metadata
import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

from kvbuffer import LLM
from kvbuffer.bench.peers import PeersBackend, reserve_pad_slot
from tests.support.scripted_drafter import ScriptedDrafter

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]


def _fla_naive():
    try:  # by its files: the transformers tests block `import fla` (sys.modules["fla"] = None)
        dist = importlib.metadata.distribution("fla-core")
        path = pathlib.Path(dist.locate_file("fla/ops/gated_delta_rule/naive.py"))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fla-core is not installed")
    mod_spec = importlib.util.spec_from_file_location("fla_gdn_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.naive_recurrent_gated_delta_rule


def fla_standin(q, k, v, g=None, beta=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                use_beta_sigmoid_in_kernel=False, **unused):
    """fused_recurrent_gated_delta_rule's in-kernel front (L2 norm eps 1e-6, gate, sigmoid, GVA) on FLA's naive loop."""
    if use_qk_l2norm_in_kernel:
        q, k = (x / torch.sqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    if use_gate_in_kernel:
        g = -torch.exp(A_log) * F.softplus(g.float() + dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float())
    r = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    return _fla_naive()(q, k, v, beta, g, initial_state=initial_state, output_final_state=output_final_state)


def fla_indexed_standin(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None,
                        inplace_final_state=False, ssm_state_indices=None, use_qk_l2norm_in_kernel=False,
                        use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, out=None, **unused):
    """fused_recurrent_kda_fwd called as kvbuffer.bench.peers calls it: indexed, in place, T = 1, with
    a per-key-channel gate that must be GDN's per-head gate broadcast over K."""
    assert inplace_final_state and use_gate_in_kernel and q.shape[1] == 1
    K, Hv = q.shape[-1], v.shape[2]
    assert torch.equal(g, g[..., :1].expand_as(g)) and dt_bias.shape == (Hv * K,)
    assert torch.equal(dt_bias.view(Hv, K), dt_bias.view(Hv, K)[:, :1].expand(Hv, K))
    rows = ssm_state_indices.long()
    o, final = fla_standin(q, k, v, g=g[..., 0], beta=beta, initial_state=initial_state[rows],
                           output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                           use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias.view(Hv, K)[:, 0],
                           use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    initial_state[rows] = final.to(initial_state.dtype)
    out.copy_(o)
    return out, initial_state


def ssu_standin(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None):
    """mamba_ssm's selective_state_update (state (S, H, P, N), per-head tensors broadcast over P)."""
    rows = state_batch_indices.long()
    H, G = x.shape[1], B.shape[1]
    dt = dt.float() + dt_bias if dt_bias is not None else dt.float()
    dt = F.softplus(dt) if dt_softplus else dt
    Bh, Ch = (t.float().repeat_interleave(H // G, dim=1)[:, :, None, :] for t in (B, C))
    s = state[rows] * torch.exp(dt[..., None] * A) + (dt * x.float())[..., None] * Bh
    state[rows] = s
    return ((s * Ch).sum(-1) + D * x.float()).to(x.dtype)


CALLS = {"gdn": 0, "mamba2": 0}


def _counted(family, fn):
    def call(*args, **kwargs):
        CALLS[family] += 1
        return fn(*args, **kwargs)
    return call


def _run(kind, peers, T=0, refs=None):
    from tests.support.tiny_models import tiny_model

    spec = {"method": "ngram", "num_draft_tokens": T} if T else None
    llm = LLM(tiny_model(kind), device="cpu", mode="recurrent", chunk_size=4, max_batch=4,
              max_states=reserve_pad_slot(4), speculative=spec)
    llm.runner.use_graphs(True, capture=False)  # 3 requests padded to 4 rows
    if peers:
        llm.backend = llm.runner.backend = PeersBackend(_counted("gdn", fla_indexed_standin),
                                                               _counted("mamba2", ssu_standin))
    if refs is not None:
        llm.drafter = ScriptedDrafter(refs, "some", llm.vocab_size)
    return llm.generate(PROMPTS, max_new_tokens=10, return_logits=True, stop_token_ids=[])


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_peers_backend_equals_recurrent_mode(kind):
    family = "gdn" if kind == "qwen3_5" else "mamba2"
    before = CALLS[family]
    own = _run(kind, peers=False)
    assert CALLS[family] == before
    refs = [(p, o.token_ids) for p, o in zip(PROMPTS, own)]
    for got in (_run(kind, peers=True), _run(kind, peers=True, T=3, refs=refs)):
        assert [o.token_ids for o in got] == [c for _, c in refs]
    for a, b in zip(own, _run(kind, peers=True)):
        for la, lb in zip(a.logits, b.logits):
            torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    assert CALLS[family] > before  # the peers' functions really ran


def test_peers_backend_refuses_the_buffered_scheme():
    with pytest.raises(ValueError, match="recurrent scheme only"):
        PeersBackend().buffered_step()
    with pytest.raises(ValueError, match="no peer kernel for the gdn family"):
        from kvbuffer.runtime.backend import GDNInputs

        z = torch.zeros(1, 1, 1)
        PeersBackend().recurrent_step(GDNInputs(z, z, z, z[0], z[0], z[0, 0], z[0, 0]), z, torch.zeros(1))


@pytest.mark.parametrize("found", ["standins", "missing"])
def test_e2e_peers_rows(monkeypatch, capsys, found):
    """bench decode with mode "peers": rows on the stand-ins; with the package missing, one line and no rows."""
    from kvbuffer.bench import e2e

    peers = {"gdn": fla_indexed_standin, "mamba2": ssu_standin} if found == "standins" else {"gdn": None, "mamba2": None}
    monkeypatch.setattr(e2e, "load_peers", lambda: peers)
    model = e2e.random_model("tiny-qwen", "cpu", torch.float32)
    rows = e2e.bench_decode(model, batches=(3,), modes=("recurrent", "peers"), prompt_len=12, new_tokens=4,
                            chunk_size=6, device="cpu")
    assert [r["mode"] for r in rows] == (["recurrent", "peers"] if found == "standins" else ["recurrent"])
    if found == "missing":
        assert "peers: rows skipped (FLA (fla-core) could not be imported)" in capsys.readouterr().out


def test_mamba2_peer_keeps_its_states_in_its_own_layout():
    """selective_state_update gets each slot's memory as contiguous (H, P, N) states, as vLLM keeps
    them (kvbuffer's (H, N, P) pool handed over transposed would make its loads strided)."""
    from kvbuffer.runtime.backend import Mamba2Inputs

    g = torch.Generator().manual_seed(0)
    Bt, H, P, N, S = 3, 4, 6, 8, 5
    x, dt = torch.randn(Bt, H, P, generator=g), torch.randn(Bt, H, generator=g)
    Bm, Cm = torch.randn(Bt, 1, N, generator=g), torch.randn(Bt, 1, N, generator=g)
    params = (torch.randn(H, generator=g), torch.randn(H, generator=g), torch.randn(H, generator=g))
    state = torch.randn(S, H, N, P, generator=g)
    before = state.clone()
    seen = []

    def update(s, *args, **kwargs):
        seen.append((s.shape, s.is_contiguous()))
        return ssu_standin(s, *args, **kwargs)

    slots = torch.tensor([3, -1, 0], dtype=torch.int32)
    y = PeersBackend(mamba2_update=update).recurrent_step(
        Mamba2Inputs(x, dt, params[0], params[1], Bm, Cm, params[2]), state, slots)
    assert seen == [(torch.Size([S, H, P, N]), True)]
    native = before.flatten(-2).unflatten(-1, (P, N))
    want = ssu_standin(native, x, dt[..., None].expand(-1, -1, P), -torch.exp(params[0])[:, None, None].expand(H, P, N),
                       Bm, Cm, D=params[2][:, None].expand(H, P), dt_bias=params[1][:, None].expand(H, P),
                       dt_softplus=True, state_batch_indices=torch.tensor([3, S - 1, 0], dtype=torch.int32))
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(state.flatten(-2).unflatten(-1, (P, N)), native)


@pytest.mark.slow  # torch.compile from a cold Inductor cache: minutes on a 2-core CPU
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_peers_backend_compiles_without_graph_breaks(kind):
    """Under torch.compile the peers' update is one custom op: the compiled step has no graph break
    and gives the uncompiled step's tokens."""
    import torch._dynamo
    from tests.support.tiny_models import tiny_model

    from torch._dynamo.utils import counters

    outs = []
    for compile_ in (False, True):
        torch._dynamo.reset()
        counters.clear()
        llm = LLM(tiny_model(kind), device="cpu", mode="recurrent", chunk_size=4, max_batch=4,
                  max_states=reserve_pad_slot(4), compile=compile_)
        llm.backend = llm.runner.backend = PeersBackend(fla_indexed_standin, ssu_standin)
        outs.append([o.token_ids for o in llm.generate(PROMPTS, max_new_tokens=4, stop_token_ids=[])])
        if compile_:
            assert not counters["graph_break"], dict(counters["graph_break"])
    assert outs[0] == outs[1]


def test_a_freed_peers_backend_leaves_no_entry_and_keys_are_never_reused():
    import gc

    from kvbuffer.bench import peers

    a = PeersBackend(fla_indexed_standin, ssu_standin)
    key = a.key
    assert peers._UPDATES[key] is a.updates
    del a
    gc.collect()
    assert key not in peers._UPDATES
    assert PeersBackend().key != key
