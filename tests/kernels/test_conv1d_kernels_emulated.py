"""The conv1d templates (tiles/conv1d.py), lowered for sm_90a by TileLang, run on the CPU through
tests/support/simt_emulator.py against kvbuffer.reference.conv: outputs (NaN-poisoned before the launch),
the written pool positions, padding rows (zero output, nothing written) and untouched slots bit-exact.
The GPU tests (tests/gpu/test_conv1d_kernels.py) cover the real device.

D = 37 with 32 threads a block: two blocks per row, the second one mostly past D.
"""

import importlib.util
import os
import shutil

import pytest
import torch

pytestmark = [pytest.mark.tilelang, pytest.mark.slow]

_NVCC = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
if importlib.util.find_spec("tilelang") is None or not _NVCC or not shutil.which("g++"):
    pytest.skip("needs TileLang, nvcc and g++", allow_module_level=True)

from kvbuffer.reference import conv as ref  # noqa: E402
from kvbuffer.tiles.conv1d import PREFILL_TOKENS  # noqa: E402
from kvbuffer.gpus import get_gpu  # noqa: E402  (the generated CUDA these tests read is Hopper's)

from tests.support.simt_emulator import Emulated, emulated  # noqa: E402
from tests.support.gdn_cases import bits_equal as _bits  # noqa: E402  (shared with the GPU tests)

D, W, DRAFTS, THREADS = 37, 4, 8, 32
SPAN = W - 1 + DRAFTS
DT = {"bfloat16": torch.bfloat16, "float32": torch.float32}
BLOCKS = -(-D // THREADS)


def _emulated(template: str, **params) -> Emulated:
    from kvbuffer.tiles import conv1d

    return emulated(getattr(conv1d, template)(**params), get_gpu("h200").target)


def _pool(g, B, dtype, pad_row):
    ns = B + 3
    state = torch.randn(ns, D, SPAN, generator=g).to(dtype)
    slots = torch.randperm(ns, generator=g)[:B].int()
    if pad_row is not None:
        slots[pad_row] = -1
    return state, slots


def _reference(mode, x, state, slots, weight, bias):
    if mode == "verify":
        return ref.verify_rows(x, state, slots, weight, bias)
    if x.shape[1] == 1:
        return ref.step_rows(x[:, 0], state, slots, weight, bias)[:, None]
    return ref.prefill_rows(x, state, slots, weight, bias)


UPDATE_CASES = [  # (mode, T, dtype, has_bias, B, padding row)
    (mode, T, dtype, (T + i) % 2 == 1, (1, 3, 7)[(T + i) % 3], None if (T + i) % 3 == 0 else 1 + (T % 2))
    for i, mode in enumerate(("advance", "verify")) for T in (1, 2, 5, 8) for dtype in DT]


@pytest.mark.parametrize("mode,T,dtype,has_bias,B,pad", UPDATE_CASES,
                         ids=[f"{m}-T{t}-{d}-{'bias' if b else 'nobias'}-B{n}" for m, t, d, b, n, _ in UPDATE_CASES])
def test_conv1d_update_emulated(mode, T, dtype, has_bias, B, pad):
    emu = _emulated("conv1d_update", D=D, W=W, span=SPAN, T_len=T, mode=mode, dtype=dtype,
                    has_bias=has_bias, threads=THREADS)
    dt = DT[dtype]
    g = torch.Generator().manual_seed(T * 10 + len(mode) + len(dtype))
    x = torch.randn(B, T, D, generator=g).to(dt)
    weight = (0.5 * torch.randn(D, W, generator=g)).to(dt)
    bias = (0.5 * torch.randn(D, generator=g)).to(dt) if has_bias else None
    state, slots = _pool(g, B, dt, pad)
    before, want_state = state.clone(), state.clone()
    out = torch.full((B, T, D), float("nan"), dtype=dt)

    emu((BLOCKS, B, 1), THREADS, x=x, conv_state=state, slots=slots, weight=weight,
        bias=bias if has_bias else weight.view(-1)[:1], out=out, batch=B, num_slots=state.shape[0])

    want = _reference(mode, x, want_state, slots, weight, bias)
    # the same arithmetic as the reference: equal up to expf's last bit (glibc vs torch's), i.e. bf16 exact
    err = float((out.double() - want.double()).abs().max())
    assert err <= (0.0 if dt == torch.bfloat16 else 2e-6), err
    # and close to fp64
    want64 = _reference(mode, x.double(), before.clone().double(), slots, weight.double(),
                        None if bias is None else bias.double())
    rel = float((out.double() - want64).norm() / want64.norm().clamp_min(1e-30))
    assert rel < (4e-3 if dt == torch.bfloat16 else 1e-6), rel
    if pad is not None:
        assert bool((out[pad] == 0).all())
    assert _bits(state, want_state)  # written positions as the reference, everything else untouched
    used = torch.zeros(state.shape[0], dtype=torch.bool)
    used[slots[slots >= 0].long()] = True
    assert _bits(state[~used], before[~used])


PREFILL_CASES = [(T, dtype, T % 2 == 0, (1, 3, 7)[T % 3]) for T in (1, 2, 5, 8, 13, 64, 65, 130) for dtype in DT]


@pytest.mark.parametrize("T,dtype,has_bias,B", PREFILL_CASES,
                         ids=[f"T{t}-{d}-{'bias' if b else 'nobias'}-B{n}" for t, d, b, n in PREFILL_CASES])
def test_conv1d_prefill_dynamic_tokens_emulated(T, dtype, has_bias, B):
    """T_len=0: one kernel for every prompt length (mode advance), prompts of one and of several token blocks,
    x a strided view (the columns of a packed projection)."""
    emu = _emulated("conv1d_update", D=D, W=W, span=SPAN, T_len=0, mode="advance", dtype=dtype,
                    has_bias=has_bias, threads=THREADS)
    dt = DT[dtype]
    g = torch.Generator().manual_seed(100 + T)
    # x as the columns of a wider projection (the prompt kernel reads a strided view in place)
    x = torch.randn(B, T, D + 11, generator=g).to(dt)[..., 5:5 + D]
    weight = (0.5 * torch.randn(D, W, generator=g)).to(dt)
    bias = (0.5 * torch.randn(D, generator=g)).to(dt) if has_bias else None
    pad = 1 if B > 1 else None
    state, slots = _pool(g, B, dt, pad)
    before, want_state = state.clone(), state.clone()
    out = torch.full((B, T, D), float("nan"), dtype=dt)

    token_blocks = -(-T // PREFILL_TOKENS)  # several blocks of one row: only the first reads and writes history
    emu((BLOCKS, token_blocks, B), THREADS, x=x, conv_state=state, slots=slots, weight=weight,
        bias=bias if has_bias else weight.view(-1)[:1], out=out, batch=B, num_slots=state.shape[0], tokens=T,
        x_batch_stride=x.stride(0), x_token_stride=x.stride(1))

    want = _reference("advance", x, want_state, slots, weight, bias)
    err = float((out.double() - want.double()).abs().max())
    assert err <= (0.0 if dt == torch.bfloat16 else 2e-6), err
    if pad is not None:
        assert bool((out[pad] == 0).all())
    assert _bits(state, want_state)
    used = torch.zeros(state.shape[0], dtype=torch.bool)
    used[slots[slots >= 0].long()] = True
    assert _bits(state[~used], before[~used])


ACCEPT_CASES = [(dtype, B) for dtype in DT for B in (1, 3, 7)]


@pytest.mark.parametrize("dtype,B", ACCEPT_CASES, ids=[f"{d}-B{b}" for d, b in ACCEPT_CASES])
def test_conv1d_accept_emulated(dtype, B):
    emu = _emulated("conv1d_accept", D=D, W=W, span=SPAN, dtype=dtype, threads=THREADS)
    dt = DT[dtype]
    g = torch.Generator().manual_seed(B + len(dtype))
    pad = 1 if B > 1 else None
    for T in (1, 2, 5, 8):
        # every m in 0..T for every row, plus one mixed batch
        counts = [torch.full((B,), m, dtype=torch.int32) for m in range(T + 1)]
        counts.append(torch.randint(0, T + 1, (B,), generator=g, dtype=torch.int32))
        for accepted in counts:
            state, slots = _pool(g, B, dt, pad)
            before, want = state.clone(), state.clone()
            emu((BLOCKS, B, 1), THREADS, conv_state=state, slots=slots, accepted=accepted, batch=B,
                num_slots=state.shape[0])
            ref.accept_rows(want, slots, accepted, W)
            assert _bits(state, want), (T, accepted.tolist())
            touched = torch.zeros_like(state, dtype=torch.bool)
            touched[slots[slots >= 0].long(), :, : W - 1] = True
            assert _bits(state[~touched], before[~touched])


def test_bad_template_parameters():
    from kvbuffer.tiles.conv1d import conv1d_accept, conv1d_update

    with pytest.raises(ValueError, match="span"):
        conv1d_update(D, W, span=W - 1 + 2, T_len=3)
    with pytest.raises(ValueError, match="mode"):
        conv1d_update(D, W, SPAN, 1, mode="rollback")
    with pytest.raises(ValueError, match="dtype"):
        conv1d_accept(D, W, SPAN, dtype="float64")
    with pytest.raises(ValueError, match="threads"):
        conv1d_update(D, W, SPAN, threads=48)
