"""The conv1d kernels (tiles/conv1d.py through kvbuffer.kernels) on CUDA vs kvbuffer.reference.conv on
CUDA: outputs NaN-poisoned before the launch, pool slots no row uses NaN-poisoned and compared bit-exact,
every accepted count; and the engine on the compiled conv vs the same engine on the reference conv.

Kernels come from JIT (kvbuffer.ops.allow_jit()). Run with -s to see the measured differences.
"""

import zlib

import pytest
import torch

from kvbuffer import kernels, ops
from kvbuffer.kernels import launch, lookup
from kvbuffer.reference import conv as ref
from tests.support.gdn_cases import bits_equal as _bits

pytestmark = pytest.mark.gpu

W, DRAFTS = 4, 8
SPAN = W - 1 + DRAFTS
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


def _pool(gen, B, D, dtype, pad=True):
    """A pool of B + 5 slots; the slots no row uses are NaN (any write to them shows)."""
    ns = B + 5
    state = torch.full((ns, D, SPAN), float("nan"), dtype=dtype, device="cuda")
    slots = torch.randperm(ns, device="cpu")[:B].to("cuda", torch.int32)
    if pad and B > 1:
        slots[B // 2] = -1
    used = slots[slots >= 0].long()
    state[used] = torch.randn(len(used), D, SPAN, generator=gen, device="cuda").to(dtype)
    return state, slots


def _reference(kind, x, state, slots, w, b):
    if kind == "verify":
        return ref.verify_rows(x, state, slots, w, b)
    if x.shape[1] == 1:
        return ref.step_rows(x[:, 0], state, slots, w, b)[:, None]
    return ref.prefill_rows(x, state, slots, w, b)


def _report(name, out, want):
    diff = (out.float() - want.float()).abs()
    print(f"{name}: max |diff| {float(diff.max()):.3g}, {int((diff > 0).sum())}/{diff.numel()} elements differ")


UPDATE = [(kind, T, B, "bfloat16", D) for kind in ("advance", "verify") for T in range(1, 9) for B in (1, 3, 64, 257)
          for D in (256,)] + [(kind, T, 3, dt, 8192 + 37) for kind in ("advance", "verify") for T in (1, 4)
                              for dt in ("float16", "float32")]


@pytest.mark.parametrize("kind,T,B,dtype,D", UPDATE, ids=[f"{k}-T{t}-B{b}-{d}-D{n}" for k, t, b, d, n in UPDATE])
def test_conv1d_update_matches_reference(kind, T, B, dtype, D):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{kind}/{T}/{B}/{dtype}/{D}".encode()))
    dt = DTYPES[dtype]
    has_bias = T % 2 == 0
    x = torch.randn(B, T, D, generator=gen, device="cuda").to(dt)
    w = (0.5 * torch.randn(D, W, generator=gen, device="cuda")).to(dt)
    b = (0.5 * torch.randn(D, generator=gen, device="cuda")).to(dt) if has_bias else None
    state, slots = _pool(gen, B, D, dt)
    theirs = state.clone()
    op = lookup.kernel_for(launch.conv_update_key(kind, x, state, w, b, True))
    out = torch.full_like(x, float("nan"))
    kernels.conv1d_update(op, x, state, slots, w, b, out)
    want = _reference(kind, x, theirs, slots, w, b)
    _report(f"{kind} T={T} B={B} {dtype}", out, want)
    assert bool(torch.isfinite(out).all())
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dt]
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    assert _bits(state, theirs)  # the same positions written, everything else (NaN slots too) untouched
    if B > 1:
        assert bool((out[B // 2] == 0).all())
    # the custom op (checked launch) gives the same, from the state after the first call
    mine2, theirs2 = state.clone(), state.clone()
    got = torch.ops.kvbuffer.conv1d_update(x, mine2, slots, w, b, kind)
    assert torch.equal(got, kernels.conv1d_update(op, x, theirs2, slots, w, b)) and _bits(mine2, theirs2)


@pytest.mark.parametrize("B,T", [(1, 4096), (3, 65), (2, 1)], ids=str)
def test_the_prompt_kernel_reads_a_packed_projections_columns_in_place(B, T):
    """The any-length kernel (T = 0) on x as columns of a wider projection output, as the GDN mixer
    hands it over: the outputs and the state of the same x made contiguous first, bit for bit (at one
    token the step kernel runs on a contiguous copy)."""
    gen = torch.Generator(device="cuda").manual_seed(B * 1000 + T)
    D = 8192 + 37
    wide = torch.randn(B, T, D + 4160, generator=gen, device="cuda").bfloat16()
    x = wide[..., :D]
    w = (0.5 * torch.randn(D, W, generator=gen, device="cuda")).bfloat16()
    state, slots = _pool(gen, B, D, torch.bfloat16)
    theirs = state.clone()
    key = launch.conv_update_key("advance", x.contiguous(), state, w, None, True)
    if T > 1:
        assert key.T == 0 and kernels.conv.reads_in_place(x)
    op = lookup.kernel_for(key)
    got = launch.CONV_UPDATE(x, state, slots, w, None, "advance")
    want = kernels.conv1d_update(op, x.contiguous(), theirs, slots, w, None)
    assert _bits(got, want) and _bits(state, theirs)


@pytest.mark.parametrize("B", [1, 3, 64, 257])
def test_conv1d_accept_every_count(B):
    gen = torch.Generator(device="cuda").manual_seed(B)
    D = 256
    for T in range(1, DRAFTS + 1):
        counts = [torch.full((B,), m, dtype=torch.int32, device="cuda") for m in range(T + 1)]
        counts.append(torch.randint(0, T + 1, (B,), generator=gen, device="cuda", dtype=torch.int32))
        for accepted in counts:
            state, slots = _pool(gen, B, D, torch.bfloat16)
            theirs = state.clone()
            torch.ops.kvbuffer.conv1d_accept(state, slots, accepted, W)
            ref.accept_rows(theirs, slots, accepted, W)
            assert _bits(state, theirs), (T, accepted.tolist()[:8])


def test_bad_launches_raise_before_writing():
    from kvbuffer.errors import DTypeError, ShapeError, SlotError

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 2, 256, device="cuda").bfloat16()
    w = torch.randn(256, W, device="cuda").bfloat16()
    state, slots = _pool(gen, 3, 256, torch.bfloat16)
    before = state.clone()
    with pytest.raises(SlotError):
        torch.ops.kvbuffer.conv1d_update(x, state, torch.tensor([0, 0, 1], dtype=torch.int32, device="cuda"), w,
                                         None, "verify")
    with pytest.raises(DTypeError):
        torch.ops.kvbuffer.conv1d_update(x.float(), state, slots, w, None, "verify")
    with pytest.raises(ShapeError):
        torch.ops.kvbuffer.conv1d_accept(state, slots, torch.tensor([1, 9, 0], dtype=torch.int32, device="cuda"), W)
    assert _bits(state, before)


PROMPTS = [[5, 17, 3, 44, 9, 61, 2, 30, 11, 7, 12, 90, 4, 21, 33, 8, 70, 1, 15], [8, 1, 33], [60, 2, 2, 19, 40]]


def _generate(kind, compiled_conv: bool, monkeypatch, **extra):
    from tests.support.scripted_drafter import ScriptedDrafter
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM
    from kvbuffer.runtime.backend import KernelBackend

    with monkeypatch.context() as m:
        if not compiled_conv:  # the conv kernels "missing": the engine keeps the reference conv
            m.setattr(KernelBackend, "_conv_kernel_loads", lambda self, key, batch: False)
        # uncompiled: under compile the conv kernel's lookup is not consulted (it would break the graph), so the
        # "missing" conv would not be missing there
        kw = dict(device="cuda", dtype=torch.bfloat16, chunk_size=8, max_batch=4, kernels=True, compile=False,
                  **extra)
        plain = LLM(tiny_model(kind), **kw).generate(PROMPTS, max_new_tokens=32, return_logits=True)
        llm = LLM(tiny_model(kind), speculative={"method": "ngram", "num_draft_tokens": 4}, **kw)
        llm.drafter = ScriptedDrafter([(p, o.token_ids) for p, o in zip(PROMPTS, plain)], "some", llm.vocab_size,
                                      strict=False)
        spec = llm.generate(PROMPTS, max_new_tokens=32, return_logits=True)
    return plain, spec


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_engine_compiled_conv_equals_reference_conv(kind, monkeypatch):
    """kernels=True with the compiled conv vs kernels=True with the reference conv (all else equal, CUDA
    graphs on): identical greedy tokens, plain and speculative (verify + accept), logits within bf16
    rounding; the conv kernels were really used. Then kernels=True vs kernels=False on CUDA."""
    from tests.support.tiny_models import tiny_model

    from tests.gpu.test_ops_and_engine import compare_greedy
    from kvbuffer import LLM

    lookup.clear_kernels("conv1d")
    plain, spec = _generate(kind, True, monkeypatch)
    keys = [k for k in lookup.loaded_keys() if k.family == "conv1d"]
    used = {k.op for k in keys}
    assert used == {"advance", "verify", "accept"}, used
    assert any(k.T == 0 for k in keys) and any(k.op == "advance" and k.T == 1 for k in keys)
    ref_plain, ref_spec = _generate(kind, False, monkeypatch)
    assert [g.token_ids for g in plain] == [g.token_ids for g in ref_plain]
    # the speculative runs agree with each other and with plain decoding up to bf16 near ties
    # (tolerances: see test_speculative_greedy_equals_plain_on_kernels_every_family)
    compare_greedy(spec, ref_spec, tol=0.15)
    compare_greedy(spec, ref_plain, tol=0.15)
    worst = max(float((a - b).abs().max()) for g, w in zip(plain, ref_plain) for a, b in zip(g.logits, w.logits))
    print(f"{kind}: compiled vs reference conv, max |logit diff| {worst:.3g}")
    assert worst < 0.06, worst
    off = LLM(tiny_model(kind), device="cuda", dtype=torch.bfloat16, chunk_size=8, max_batch=4,
              kernels=False).generate(PROMPTS, max_new_tokens=32, return_logits=True)
    compare_greedy(plain, off, tol=0.06)
