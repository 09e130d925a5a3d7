"""The attention kernels (tiles/attention.py through kvbuffer.kernels) on CUDA against
kvbuffer.kernels.attention.attention_reference in fp64: one split and several, long contexts, large
batches, outputs NaN-poisoned before the launch, cache positions past each row's and slots no row
uses NaN-poisoned (a read of them would show), padding rows exactly zero; the custom op, a CUDA
graph replay, and the engine's greedy output with the kernel vs with the torch path.

Kernels come from JIT (kvbuffer.ops.allow_jit()). Run with -s to see the measured errors.
"""

import zlib

import pytest
import torch

from kvbuffer import ops
from kvbuffer.kernels import attention as attn
from kvbuffer.kernels import launch, lookup, specs

pytestmark = pytest.mark.gpu

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}  # relative (norm) error


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


def _case(B, T, H, Hkv, D, lengths, dtype, kv_dtype, seed, pad=True):
    """Slots drawn out of order from a pool of B + 3; positions past each row's and unused slots NaN."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    max_len = max(lengths) + T + 5
    ns = B + 3
    kc = torch.full((ns, max_len, Hkv, D), float("nan"), device="cuda", dtype=DTYPES[kv_dtype])
    vc = torch.full_like(kc, float("nan"))
    slots = torch.randperm(ns, device="cpu")[:B].to("cuda", torch.int32)
    if pad and B > 1:
        slots[B // 2] = -1
    cached = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    for b in range(B):
        s, n = int(slots[b]), lengths[b] + T
        if s >= 0:
            kc[s, :n] = torch.randn(n, Hkv, D, generator=gen, device="cuda").to(kc.dtype)
            vc[s, :n] = torch.randn(n, Hkv, D, generator=gen, device="cuda").to(kc.dtype)
    q = (1.5 * torch.randn(B, T, H, D, generator=gen, device="cuda")).to(DTYPES[dtype])
    return q, kc, vc, slots, cached


def _reference(q, kc, vc, slots, cached, scale):
    """fp64, with the NaN never-read positions zeroed first (the reference slices exactly the valid ones)."""
    return attn.attention_reference(q.double(), kc.double().nan_to_num(), vc.double().nan_to_num(), slots, cached,
                                    scale)


def _launch(q, kc, vc, slots, cached, scale, splits):
    op = lookup.kernel_for(launch.attention_key(specs.ATTENTION_DECODE, q, kc))
    combine = lookup.kernel_for(launch.attention_key(specs.ATTENTION_COMBINE, q, kc)) if splits > 1 else None
    out = torch.full_like(q, float("nan"))
    return attn.attention_decode(op, combine, q, kc, vc, slots, cached, scale, out, splits=splits)


def _check(out, want, q, slots, label):
    rel = float((out.double() - want).norm() / want.norm())
    print(f"{label}: rel err {rel:.2e}, max |diff| {float((out.double() - want).abs().max()):.3g}")
    assert bool(torch.isfinite(out).all())
    assert rel < TOL[q.dtype], rel
    pad = slots < 0
    if bool(pad.any()):
        assert bool((out[pad] == 0).all())


def _lengths(B, long_ctx, seed):
    g = torch.Generator().manual_seed(seed)
    base = [0, 1, 2, 63, 64, 65, 300, 1023] + ([2047, 2500] if long_ctx else [])
    return [base[i] if i < len(base) else int(torch.randint(0, 2600 if long_ctx else 400, (1,), generator=g))
            for i in range(B)]


CASES = [  # (B, T, H, Hkv, D, dtype, kv_dtype, long contexts)
    (1, 1, 16, 4, 256, "bfloat16", "bfloat16", True),   # Qwen3.5-9B decode
    (3, 1, 16, 4, 256, "bfloat16", "bfloat16", False),
    (5, 1, 32, 2, 128, "bfloat16", "bfloat16", True),   # Nemotron-3 (G = 16)
    (257, 1, 16, 4, 256, "bfloat16", "bfloat16", True),
    (64, 1, 32, 2, 128, "bfloat16", "bfloat16", False),
    (5, 5, 16, 4, 256, "bfloat16", "bfloat16", True),   # verify of 4 drafts
    (3, 8, 32, 2, 128, "bfloat16", "bfloat16", False),
    (33, 8, 16, 4, 256, "bfloat16", "bfloat16", True),
    (5, 1, 16, 4, 256, "float16", "float16", False),
    (3, 2, 8, 2, 64, "float32", "float32", False),
    (3, 1, 16, 4, 128, "bfloat16", "float32", False),
    # the tensor-core form (keys.attention_on_tensor_cores: 8 .. 48 rows G x T, one 16-bit dtype; the
    # verifies above of 20 and 32 rows take it too)
    (64, 3, 32, 2, 128, "bfloat16", "bfloat16", True),  # Nemotron-3's 2-draft verify: 48 rows
    (257, 1, 32, 2, 128, "bfloat16", "bfloat16", True),
    (9, 1, 16, 2, 128, "bfloat16", "bfloat16", True),   # G = 8
    (7, 1, 32, 2, 128, "float16", "float16", True),
    (3, 1, 16, 2, 256, "bfloat16", "bfloat16", False),  # G = 8, D = 256
    (4, 1, 32, 2, 64, "bfloat16", "bfloat16", False),
]


@pytest.mark.parametrize("B,T,H,Hkv,D,dtype,kv_dtype,long_ctx", CASES,
                         ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-Hkv{c[3]}-D{c[4]}-{c[5]}-kv{c[6]}{'-long' if c[7] else ''}"
                              for c in CASES])
def test_attention_matches_reference(B, T, H, Hkv, D, dtype, kv_dtype, long_ctx):
    seed = zlib.crc32(f"{B}/{T}/{H}/{D}/{dtype}/{kv_dtype}".encode())
    lengths = _lengths(B, long_ctx, seed)
    q, kc, vc, slots, cached = _case(B, T, H, Hkv, D, lengths, dtype, kv_dtype, seed)
    before = (kc.clone(), vc.clone())
    scale = D ** -0.5
    want = _reference(q, kc, vc, slots, cached, scale)
    ctx = max(lengths) + T
    auto = attn.splits_for(attn.decode_blocks(lookup.kernel_for(launch.attention_key(specs.ATTENTION_DECODE, q, kc)), B), ctx,
                           torch.cuda.get_device_properties(0).multi_processor_count)
    for splits in sorted({1, 3, auto}):
        out = _launch(q, kc, vc, slots, cached, scale, splits)
        _check(out, want, q, slots, f"B={B} T={T} splits={splits}")
    # the engine's call (the split rule, direct launch) and the custom op (checked launch) agree with it
    got = launch.attention_decode(q, kc, vc, slots, cached, scale, ctx, checked=False)
    _check(got, want, q, slots, f"B={B} T={T} launch")
    op_out = torch.ops.kvbuffer.attention_decode(q, kc, vc, slots, cached, scale, ctx)
    assert torch.equal(op_out, got)
    assert torch.equal(kc.nan_to_num(7.0), before[0].nan_to_num(7.0))  # the cache is only read
    assert torch.equal(vc.nan_to_num(7.0), before[1].nan_to_num(7.0))


def test_bad_launches_raise_before_anything_runs():
    from kvbuffer.errors import DTypeError, ShapeError, SlotError

    q, kc, vc, slots, cached = _case(3, 1, 16, 4, 256, [5, 6, 7], "bfloat16", "bfloat16", 0, pad=False)
    with pytest.raises(SlotError):
        torch.ops.kvbuffer.attention_decode(q, kc, vc, torch.tensor([0, 1, 99], dtype=torch.int32, device="cuda"),
                                            cached, 0.1)
    with pytest.raises(ShapeError, match="max_len"):
        torch.ops.kvbuffer.attention_decode(q, kc, vc, slots, cached + 1000, 0.1)
    with pytest.raises(DTypeError):
        torch.ops.kvbuffer.attention_decode(q, kc, vc, slots, cached.long(), 0.1)
    with pytest.raises(ShapeError, match="new tokens"):
        torch.ops.kvbuffer.attention_decode(q.expand(3, 9, 16, 256).contiguous(), kc, vc, slots, cached, 0.1)


@pytest.mark.parametrize("B", [1, 64])
def test_cuda_graph_replay_equals_eager(B):
    """Captured with the engine's direct launch (no device read-back), replayed after the rows moved on."""
    lengths = [100 + 37 * i for i in range(B)]
    q, kc, vc, slots, cached = _case(B, 1, 16, 4, 256, [x + 50 for x in lengths], "bfloat16", "bfloat16", B)
    cached.copy_(torch.tensor(lengths, dtype=torch.int32))
    ctx = max(lengths) + 51
    launch.attention_decode(q, kc, vc, slots, cached, 0.0625, ctx, checked=False)  # warm-up: lookups
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch.attention_decode(q, kc, vc, slots, cached, 0.0625, ctx, checked=False)
    cached += 50
    graph.replay()
    torch.cuda.synchronize()
    want = launch.attention_decode(q, kc, vc, slots, cached, 0.0625, ctx, checked=False)
    assert torch.equal(out, want)
    _check(out, _reference(q, kc, vc, slots, cached, 0.0625), q, slots, f"graph B={B}")


# ----------------------------------------------------------------------------------------------
# the engine: the kernel vs the torch path


PROMPTS = [[5, 17, 3, 44, 9, 61, 2, 30, 11, 7, 12, 90, 4, 21, 33, 8, 70, 1, 15], [8, 1, 33], [60, 2, 2, 19, 40]]


def _generate(kind, in_place: bool, monkeypatch, dtype=torch.bfloat16, drafts=4):
    from tests.support.scripted_drafter import ScriptedDrafter
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM
    from kvbuffer.runtime.backend import KernelBackend

    with monkeypatch.context() as m:
        if not in_place:  # the engine keeps the torch window path
            m.setattr(KernelBackend, "attends_in_place", lambda self, q, k_cache: False)
        kw = dict(device="cuda", dtype=dtype, chunk_size=8, max_batch=4, kernels=True)
        plain = LLM(tiny_model(kind, head_dim=64), **kw).generate(PROMPTS, max_new_tokens=32, return_logits=True)
        llm = LLM(tiny_model(kind, head_dim=64), speculative={"method": "ngram", "num_draft_tokens": drafts}, **kw)
        llm.drafter = ScriptedDrafter([(p, o.token_ids) for p, o in zip(PROMPTS, plain)], "some", llm.vocab_size,
                                      strict=False)
        spec = llm.generate(PROMPTS, max_new_tokens=32, return_logits=True)
    return plain, spec


def _worst(got, want) -> float:
    """Largest |logit difference| over the steps before the first differing token."""
    worst = 0.0
    for g, w in zip(got, want):
        for i, (a, b) in enumerate(zip(g.logits, w.logits)):
            worst = max(worst, float((a - b).abs().max()))
            if g.token_ids[i] != w.token_ids[i]:
                break
    return worst


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_engine_kernel_attention_equals_torch_attention(kind, monkeypatch):
    """kernels=True with the attention kernel vs the torch window path (all else equal, CUDA graphs on).
    fp32 model (fp32 KV cache and queries: the same math up to rounding): the same greedy tokens, plain
    and speculative. bf16: logits within bf16 rounding (the torch path rounds the probabilities to
    bf16 before the second matmul, the kernel keeps them fp32), greedy tokens equal except at near ties
    (tests/kernels/test_attention_wiring.py shows the in-place path itself equals the window path)."""
    from tests.gpu.test_ops_and_engine import compare_greedy

    lookup.clear_kernels("attention")
    plain, spec = _generate(kind, True, monkeypatch, torch.float32)
    used = {(k.op, k.T, k.in_dtype) for k in lookup.loaded_keys() if k.family == "attention"}
    assert ("decode", 1, "float32") in used and any(op == "decode" and T > 1 for op, T, _ in used), used
    ref_plain, ref_spec = _generate(kind, False, monkeypatch, torch.float32)
    print(f"{kind} fp32: max |logit diff| plain {_worst(plain, ref_plain):.3g}, speculative {_worst(spec, ref_spec):.3g}")
    assert [g.token_ids for g in plain] == [g.token_ids for g in ref_plain]
    assert [g.token_ids for g in spec] == [g.token_ids for g in ref_spec]
    assert _worst(plain, ref_plain) < 2e-3

    plain, spec = _generate(kind, True, monkeypatch)
    ref_plain, ref_spec = _generate(kind, False, monkeypatch)
    same = [g.token_ids == w.token_ids for g, w in zip(plain, ref_plain)]
    print(f"{kind} bf16: max |logit diff| plain {_worst(plain, ref_plain):.3g}, speculative "
          f"{_worst(spec, ref_spec):.3g}; prompts with identical tokens: {same}")
    compare_greedy(plain, ref_plain, tol=0.1)
    compare_greedy(spec, ref_spec, tol=0.15)


def test_engine_compiled_forward_with_the_kernel():
    """Under torch.compile the kernel runs as torch.ops.kvbuffer.attention_decode after the writes;
    tolerance as in tests/gpu/test_engine_perf.py (Inductor fuses in fp32 what eager rounds to bf16)."""
    from tests.gpu.test_ops_and_engine import compare_greedy
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM

    torch._dynamo.reset()
    kw = dict(device="cuda", dtype=torch.bfloat16, chunk_size=8, max_batch=4, kernels=True)
    eager = LLM(tiny_model("qwen3_5", head_dim=64), **kw).generate(PROMPTS, max_new_tokens=24, return_logits=True)
    lookup.clear_kernels("attention")
    llm = LLM(tiny_model("qwen3_5", head_dim=64), compile=True, **kw)
    compiled = llm.generate(PROMPTS, max_new_tokens=24, return_logits=True)
    print(f"compiled vs eager: max |logit diff| {_worst(compiled, eager):.3g}")
    assert llm.runner.compiled is not None, "compile fell back"
    assert any(k.family == "attention" for k in lookup.loaded_keys())
    compare_greedy(compiled, eager, tol=0.15)


@pytest.mark.parametrize("B", [1, 64, 512])
def test_tensor_core_form_follows_the_thread_level_one(B):
    """Nemotron-3's decode attention (G = 16): the tensor-core pass and the thread-level pass, both
    against fp64 on the same inputs, and within bf16 rounding of each other."""
    from kvbuffer.kernels.compiled import build_template
    from kvbuffer.kernels.keys import attention_on_tensor_cores

    assert attention_on_tensor_cores(16, 1, 128, "bfloat16", "bfloat16")
    lengths = _lengths(B, True, B)
    q, kc, vc, slots, cached = _case(B, 1, 32, 2, 128, lengths, "bfloat16", "bfloat16", B)
    want = _reference(q, kc, vc, slots, cached, 128 ** -0.5)
    params = dict(H=32, Hkv=2, D=128, T_len=1, dtype="bfloat16", kv_dtype="bfloat16", threads=128, unroll=4)
    simt = build_template("attention_decode", "attention_decode_simt", params, module="attention", aliases={"T": 1})
    fast = lookup.kernel_for(launch.attention_key(specs.ATTENTION_DECODE, q, kc))
    outs = [attn.attention_decode(op, None, q, kc, vc, slots, cached, 128 ** -0.5) for op in (fast, simt)]
    for out, label in zip(outs, ("tensor cores", "thread-level")):
        _check(out, want, q, slots, f"B={B} {label}")
    assert float((outs[0].double() - outs[1].double()).norm() / outs[1].double().norm()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("B,T,H,Hkv,D", [(64, 3, 32, 2, 128), (257, 5, 16, 4, 256), (5, 1, 16, 4, 256),
                                         (3, 8, 16, 4, 256)])
def test_tensor_core_form_for_verifies_and_fewer_query_heads(B, T, H, Hkv, D):
    """The tensor-core pass on a verify's rows (which the engine now gives it) and on Qwen3.5's G = 4
    decode (which it does not: 4 rows padded to a 16-row tile), one block for all of a KV head's rows:
    against fp64 at 1 / 3 splits, long contexts."""
    from kvbuffer.kernels.compiled import build_template

    seed = zlib.crc32(f"mma/{B}/{T}/{H}/{D}".encode())
    lengths = _lengths(B, True, seed)
    q, kc, vc, slots, cached = _case(B, T, H, Hkv, D, lengths, "bfloat16", "bfloat16", seed)
    want = _reference(q, kc, vc, slots, cached, D ** -0.5)
    params = dict(H=H, Hkv=Hkv, D=D, T_len=T, dtype="bfloat16", threads=128, unroll=4)  # its cache is q's dtype
    op = build_template("attention_decode", "attention_decode_mma", params, module="attention",
                        aliases={"T": T, "kv_dtype": "bfloat16"})
    combine = lookup.kernel_for(launch.attention_key(specs.ATTENTION_COMBINE, q, kc))
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        attn.attention_decode(op, combine, q, kc, vc, slots, cached, D ** -0.5, out, splits=splits)
        _check(out, want, q, slots, f"B={B} T={T} G={H // Hkv} tensor cores, splits={splits}")
