"""The `replayssm` mode: the servers' ReplaySSM kernels inside kvbuffer's engine, on CPU under Triton's interpreter.

The kernels come from an installed vllm / sglang or a `python -m kvbuffer.bench.peer_sources` folder on
PYTHONPATH; without them (or triton) the engine tests skip. Greedy tokens must be kvbuffer mode's on
tiny models (rings of L = 4 or 8, crossing folds; padded graph buckets), plain and speculative; the
refusals, the planning of the rings and the benchmark's rows and skips run anywhere.
"""

import importlib.util

import pytest
import torch
from click.testing import CliRunner

from kvbuffer import LLM
from kvbuffer.bench import e2e, replayssm, replayssm_engine
from kvbuffer.bench.replayssm_engine import NO_VERIFY, ReplayCaches, ReplayLayout, replayssm_llm
from kvbuffer.cli.main import main
from kvbuffer.pools import LinearLayerShape
from tests.bench.triton_cpu import interpreted, request_interpreter
from tests.support.scripted_drafter import ScriptedDrafter
from tests.support.tiny_models import tiny_model

if importlib.util.find_spec("sglang") or importlib.util.find_spec("vllm"):
    request_interpreter()  # before triton is first imported (only where there is something to run)

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 1], [7, 5, 3, 2, 6, 6, 6, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]
LONG_PROMPTS = [p + p for p in PROMPTS]  # >= 16 tokens (the verify ring): every request has its state from admission
FAMILY = {"qwen3_5": "gdn", "nemotron_h": "mamba2"}


def _kernels_or_skip(kind: str, drafts: int = 0) -> None:
    found, note = replayssm_engine.load_kernels(FAMILY[kind], drafts + 1)
    if found is None:
        pytest.skip(note)


def _kvbuffer_run(model, chunk_size, tokens, prompts=PROMPTS):
    llm = LLM(model, device="cpu", mode="kvbuffer", chunk_size=chunk_size, max_batch=4)
    return llm.generate(prompts, max_new_tokens=tokens, stop_token_ids=[], return_logits=True)


@pytest.mark.parametrize("kind, ring, atol", [("qwen3_5", "float32", 1e-4), ("qwen3_5", "bfloat16", 3e-2),
                                              ("nemotron_h", "float32", 3e-2)],
                         ids=["gdn-fp32-ring", "gdn-bf16-ring", "mamba2"])
def test_greedy_decode_equals_kvbuffer_mode(kind, ring, atol):
    """L = 4, prompts of 9, 8 and 13 tokens (cursors 1, 0, 1) and 5 decode steps: every row's ring folds;
    3 rows padded to a 4-row bucket. vLLM's
    rings are bf16 (x, B) and so are SGLang's with ring bf16: logits within bf16 rounding."""
    _kernels_or_skip(kind)
    model = tiny_model(kind)
    want = _kvbuffer_run(model, 4, 6)
    with interpreted():
        llm = replayssm_llm(model, device="cpu", chunk_size=4, max_batch=4,
                            ring_dtype=replayssm_engine.RING_DTYPES[ring])
        llm.runner.use_graphs(True, capture=False)  # 3 requests padded to 4 rows
        got = llm.generate(PROMPTS, max_new_tokens=6, stop_token_ids=[], return_logits=True)
    assert llm.runner.backend.name == "replayssm" and llm.runner.unbuffered_rows == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(want, got):
        torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), rtol=0, atol=atol)
    assert any(r.abs().sum() > 0 for r in llm.runner.backend.caches.rings())  # the steps wrote the rings


def test_speculative_greedy_equals_kvbuffer_mode():
    """SGLang's verify and commit of 2 drafts (L = 16: its early fold every few verifies), drafts right
    except every third: the tokens of plain kvbuffer decoding."""
    _kernels_or_skip("qwen3_5", drafts=2)
    model = tiny_model("qwen3_5")
    refs = [(p, o.token_ids) for p, o in zip(LONG_PROMPTS, _kvbuffer_run(model, 8, 11, LONG_PROMPTS))]
    with interpreted():
        llm = replayssm_llm(model, device="cpu", chunk_size=16, max_batch=4, drafts=2)
        llm.runner.use_graphs(True, capture=False)
        llm.drafter = ScriptedDrafter(refs, "some", llm.vocab_size)
        got = llm.generate(LONG_PROMPTS, max_new_tokens=9, stop_token_ids=[])
    assert [o.token_ids for o in got] == [c[:9] for _, c in refs]
    assert 0.3 < llm.acceptance["acceptance_rate"] < 1.0  # drafts kept and rejected


def test_a_prompt_shorter_than_the_ring_is_refused_and_the_engine_goes_on():
    _kernels_or_skip("qwen3_5")
    with interpreted():
        llm = replayssm_llm(tiny_model("qwen3_5"), device="cpu", chunk_size=16, max_batch=4)
        with pytest.raises(ValueError, match="prompt 1: 8 tokens; the replayssm mode takes prompts of at least"):
            llm.generate([LONG_PROMPTS[0], PROMPTS[1]], max_new_tokens=2, stop_token_ids=[])
        assert not llm.has_work()
        assert len(llm.generate(LONG_PROMPTS[:1], max_new_tokens=2, stop_token_ids=[])[0].token_ids) == 2


@pytest.mark.parametrize("kind, options, match", [
    ("nemotron_h", dict(drafts=2), "no ReplaySSM verify for Mamba-2"),
    ("qwen3_5", dict(drafts=2, chunk_size=12), "power-of-two length >= 2 x 3"),
    ("qwen3_5", dict(drafts=4, chunk_size=8), "power-of-two length >= 2 x 5"),
    ("qwen3_5", dict(drafts=2, chunk_size=8), ">= 16 \\(its commit folds the ring in one tl.dot\\)"),
    ("qwen3_5", dict(mode="recurrent"), "set by replayssm_llm"),
    ("qwen3_5", dict(ring_dtype=torch.float16), "ring_dtype must be one of"),
    ("qwen3_5", dict(drafts=-1), "drafts must be an int >= 0"),
    ("qwen3_5", dict(chunk_size=None), "chunk_size .* must be given"),
], ids=["mamba2-verify", "ring-not-pow2", "ring-too-short", "ring-under-16", "mode", "ring-dtype", "drafts", "chunk-size"])
def test_refused_before_anything_is_built(kind, options, match):
    options = {"chunk_size": 8, **options}
    with pytest.raises(ValueError, match=match):
        replayssm_llm(tiny_model(kind), device="cpu", max_batch=2, **options)


def test_small_key_heads_and_a_missing_module_are_refused(monkeypatch):
    model = e2e.random_model("tiny-qwen", "cpu", torch.float32)  # K = 16: one K tile
    with pytest.raises(ValueError, match="head_k_dim >= 32"):
        replayssm_llm(model, device="cpu", chunk_size=8, max_batch=2)
    monkeypatch.setitem(replayssm.MODULES, "sglang_step", ("no_such_server.kernels", ("decode",)))
    with pytest.raises(RuntimeError, match="sglang_step: not installed"):
        replayssm_llm(tiny_model("qwen3_5"), device="cpu", chunk_size=8, max_batch=2)


@pytest.mark.parametrize("fed", [1, 5])
@pytest.mark.parametrize("delta_rule", [True, False], ids=["gdn", "mamba2"])
def test_layout_is_what_is_allocated_and_planned(fed, delta_rule):
    shape = LinearLayerShape(2, 6, 32, 48, delta_rule)
    layout = ReplayLayout(shape, layers=3, states=7, requests=5, L=16, fed=fed if delta_rule else 1)
    caches = ReplayCaches(layout, "cpu")
    planned = layout.nbytes()
    assert planned == {n: getattr(caches, n).numel() * getattr(caches, n).element_size() for n in planned}
    if delta_rule and fed > 1:  # request-keyed rings, padding rows' sink in the state map
        assert caches.d_ring.shape == (3, 5, 6, 16, 48) and caches.state_of.tolist() == [-1] * 6
    elif delta_rule:  # state-keyed rings in SGLang's value-major layout
        assert caches.d_ring.shape == (3, 7, 6, 16, 48) and caches.k_ring.shape == (3, 7, 2, 16, 32)
    else:
        assert caches.x_ring.shape == (3, 7, 6, 16, 48) and caches.B_ring.shape == (3, 7, 2, 16, 32)
    one = replayssm_engine.request_nbytes(shape, 3, 16, fed if delta_rule else 1)
    assert one == sum(ReplayLayout(shape, 3, 1, 1, 16, fed if delta_rule else 1).nbytes().values())


def test_rings_are_checked_before_they_are_allocated(monkeypatch):
    """The rings' bytes go through plan.check_fits (after the engine's own caches, before any ring)."""
    _kernels_or_skip("qwen3_5")
    import kvbuffer.plan

    seen = []

    def refuse(parts, available, named, where):
        seen.append(sorted(parts))
        raise ValueError(named[max(parts, key=parts.get)])
    monkeypatch.setattr(kvbuffer.plan, "check_fits", refuse)
    monkeypatch.setattr(replayssm_engine, "ReplayCaches", None)  # allocating would fail loudly
    with pytest.raises(ValueError, match=r"max_batch=3, chunk_size=8 \(the ReplaySSM rings\)"):
        replayssm_llm(tiny_model("qwen3_5"), device="cpu", chunk_size=8, max_batch=3)
    assert seen == [["d_ring", "force_flush", "g_ring", "k_ring"]]


def test_bench_decode_rows_beside_kvbuffer():
    _kernels_or_skip("qwen3_5")
    model = tiny_model("qwen3_5")
    with interpreted():
        rows = e2e.bench_decode(model, batches=(3,), modes=("kvbuffer", "replayssm"), prompt_len=4, new_tokens=4,
                                chunk_size=4, device="cpu", replayssm_ring="bfloat16")
    assert [r["mode"] for r in rows] == ["kvbuffer", "replayssm"]
    assert rows[1]["replayssm_ring"] == "bfloat16" and "replayssm_ring" not in rows[0]
    assert rows[1]["decode_tokens_per_s"] > 0


def test_bench_skips_are_rows_with_the_reason(monkeypatch, capsys):
    tiny = e2e.random_model("tiny-qwen", "cpu", torch.float32)
    rows = e2e.bench_decode(tiny, batches=(2,), modes=("replayssm",), prompt_len=8, new_tokens=2, chunk_size=8,
                            device="cpu")
    assert rows == [dict(mode="replayssm", skipped=rows[0]["skipped"])] and "head_k_dim" in rows[0]["skipped"]
    nano = e2e.random_model("tiny-nemotron", "cpu", torch.float32)
    rows = e2e.bench_spec(nano, settings=("equal", "capacity"), batches=(2,), alphas=(1.0,), drafts=2,
                          modes=("replayssm",), prompt_len=8, new_tokens=2, chunk_size=8, device="cpu")
    assert rows == [dict(mode="replayssm", skipped=NO_VERIFY)]
    monkeypatch.setitem(replayssm.MODULES, "vllm_step", ("no_such_server.kernels", ("step",)))
    assert "vllm_step: not installed" in e2e.replayssm_missing(nano, chunk_size=8)
    assert "replayssm: rows skipped (vLLM 0.33.0 ships no ReplaySSM verify" in capsys.readouterr().out


def test_capacity_counts_the_servers_caches():
    """replayssm's requests per budget: kvbuffer mode's caches without its buffers, with the rings."""
    model = tiny_model("qwen3_5")
    kw = dict(budget_bytes=2**24, context=40, drafts=4, chunk_size=16)
    geo = e2e.geometry_of(model)
    spec = e2e.request_spec(geo, scheme="kvbuffer", context=40, draft_tokens=4, chunk_size=16).nbytes(torch.float32)
    per = sum(v for k, v in spec.items() if not k.startswith("buffer_")) + \
        replayssm_engine.request_nbytes(geo.linear_shape, geo.num_linear_layers, 16, 5)
    assert e2e.admitted_requests(model, mode="replayssm", **kw) == 2**24 // per
    assert e2e.admitted_requests(model, mode="replayssm", **kw) != e2e.admitted_requests(model, mode="kvbuffer", **kw)


@pytest.mark.parametrize("modes, prompt_len, match", [(("kvbuffer", "nope"), 16, "modes must be among"),
                                                      ((), 16, "modes must be among"),
                                                      (("replayssm",), 15, "prompt_len must be at least")])
def test_modes_are_checked_first(modes, prompt_len, match):
    with pytest.raises(ValueError, match=match):
        e2e.bench_decode(None, batches=(1,), modes=modes, prompt_len=prompt_len, chunk_size=16)


@pytest.mark.parametrize("args", [["decode", "--modes", "kvbuffer,nope"],
                                  ["spec", "--modes", "replayssm", "--prompt-len", "8"],
                                  ["decode", "--replayssm-ring", "float16"]], ids=["mode", "prompt", "ring"])
def test_cli_usage_errors(args):
    res = CliRunner().invoke(main, ["bench", *args])
    assert res.exit_code == 2, res.output
    assert ("--modes" if "--modes" in args else "--replayssm-ring") in res.output


def test_cli_help_names_the_mode():
    for command in ("decode", "spec"):
        res = CliRunner().invoke(main, ["bench", command, "--help"])
        assert "replayssm" in res.output and "--replayssm-ring" in res.output


@pytest.mark.slow  # torch.compile from a cold Inductor cache and the interpreter: minutes on a 2-core CPU
@pytest.mark.parametrize("drafts", [0, 2], ids=["decode", "verify"])
def test_compiled_steps_have_no_graph_break(drafts):
    """Under torch.compile each server kernel call is one custom op: no graph break, the state pool's own
    layer views reach it (ReplaySSMBackend finds each layer by its place in the pool), the uncompiled tokens."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    _kernels_or_skip("qwen3_5", drafts)
    refs = [(p, o.token_ids) for p, o in zip(PROMPTS, _kvbuffer_run(tiny_model("qwen3_5"), 8, 8))]
    outs = []
    with interpreted():
        for compile_ in (False, True):
            torch._dynamo.reset()
            counters.clear()
            llm = replayssm_llm(tiny_model("qwen3_5"), device="cpu", chunk_size=16 if drafts else 8, max_batch=4,
                                compile=compile_, drafts=drafts)
            if drafts:
                llm.drafter = ScriptedDrafter(refs, "some", llm.vocab_size)
            outs.append([o.token_ids for o in llm.generate(PROMPTS, max_new_tokens=5, stop_token_ids=[])])
            if compile_:
                assert not counters["graph_break"], dict(counters["graph_break"])
    assert outs[0] == outs[1] == [c[:5] for _, c in refs]


def test_a_bf16_ring_run_writes_its_own_file(tmp_path, monkeypatch):
    """Runs with SGLang's two decode ring dtypes land in two files (the second does not overwrite the first)."""
    monkeypatch.setattr(e2e, "bench_decode", lambda model, **options: [])
    for ring in ("float32", "bfloat16"):
        e2e.run("decode", preset="tiny-qwen", device="cpu", out_dir=tmp_path, batches=(1,), modes=("replayssm",),
                replayssm_ring=ring)
    names = sorted(p.name.split("_20")[0] for p in tmp_path.glob("*.json"))
    assert names == ["e2e_decode_bf16ring_tiny-qwen", "e2e_decode_tiny-qwen"]
