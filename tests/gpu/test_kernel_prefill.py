"""KernelBackend.prefill on CUDA (flush, chunked prefill kernel, verify chunks for the rest; kernels from the
JIT) against the reference Backend's chunked prefill in fp64 on copies of the same pools.

Engine-like pools: fp32 states, bf16 buffer entries of C + 1 = 65 per slot, bf16 activations; prompts of
1 .. 10,007 tokens after fills 0 .. C-1, one row or three with a padding row in the middle. Outputs, the
states and the buffer entries up to the new fill within the kernels' bf16 rounding (relative Frobenius
errors); slots outside the batch bit-exact.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvbuffer import ops
from kvbuffer.runtime.backend import REFERENCE, GDNInputs, KernelBackend, Mamba2Inputs
from tests.support.gdn_cases import bits_equal, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]

C, CAP = 64, 65
HEADS = {"gdn": (2, 4, 128, 128), "mamba2": (2, 8, 128, 64)}  # Hk, Hv, K, V (Mamba-2: G, H, N, P)
# the verify chunks' and the chunked kernel's bf16 operands; the tail's entries follow the folded state
OUT_TOL, STATE_TOL, ENTRY_TOL = 2e-2, 2e-2, 2e-2
CASES = [(1, T, f) for T in (1, C - 1, C, C + 1, 1000) for f in (0, 37)] + [(1, 1, C - 1), (1, 10007, 5)] \
    + [(3, T, f) for T, f in ((C + 1, 5), (1000, C - 1), (C, 0), (7, 20))]


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


def problem(family: str, B: int, T: int, fill: int):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{family}/{B}/{T}/{fill}".encode()))
    Hk, Hv, K, V = HEADS[family]
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    A_log, dt_bias = torch.log(1 + 8 * torch.rand(Hv, generator=gen, device="cuda")), r(Hv) - 2
    if family == "gdn":
        inputs = GDNInputs(r(B, T, Hk, K).bfloat16(), r(B, T, Hk, K).bfloat16(), r(B, T, Hv, V).bfloat16(),
                           r(B, T, Hv).bfloat16(), r(B, T, Hv).bfloat16(), A_log, dt_bias)
    else:
        inputs = Mamba2Inputs(r(B, T, Hv, V).bfloat16(), r(B, T, Hv).bfloat16(), A_log, dt_bias,
                              r(B, T, Hk, K).bfloat16(), r(B, T, Hk, K).bfloat16(), r(Hv))
    n = B + 2
    state = 0.3 * r(n, Hv, K, V)
    buf = (torch.nn.functional.normalize(r(n, CAP, Hk, K), dim=-1).bfloat16(), (0.5 * r(n, CAP, Hv, V)).bfloat16(),
           torch.cumsum(-0.3 * torch.rand(n, CAP, Hv, generator=gen, device="cuda"), 1))
    cpu = torch.Generator().manual_seed(B * 1000 + T)
    state_slots = torch.randperm(n, generator=cpu)[:B].to("cuda", torch.int32)
    slots = torch.randperm(n, generator=cpu)[:B].to("cuda", torch.int32)
    if B > 1:
        state_slots[B // 2], slots[B // 2] = -1, -1
    if fill + T < C:
        state_slots[:] = -1  # the runner allocates a state only once the prompt folds
    return inputs, state, state_slots, buf, slots


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
@pytest.mark.parametrize("B,T,fill", CASES, ids=lambda x: str(x))
def test_kernel_backend_prefill_matches_reference_backend(family, B, T, fill):
    inputs, state, state_slots, buf, slots = problem(family, B, T, fill)
    state64, buf64 = state.double(), tuple(t.double() for t in buf)
    inputs64 = inputs._make(t.double() for t in inputs)
    before = (state.clone(),) + tuple(t.clone() for t in buf)
    o_ref = REFERENCE.prefill(inputs64, state64, state_slots, buf64, slots, fill, C)
    o = KernelBackend().prefill(inputs, state, state_slots, buf, slots, fill, C)
    torch.cuda.synchronize()
    assert o.dtype == torch.bfloat16 and o.shape == o_ref.shape
    real = slots >= 0
    assert rel_err(o[real], o_ref[real]) < OUT_TOL
    assert bool((o[~real] == 0).all())
    rows = [int(s) for s in state_slots if s >= 0]
    for s in range(state.shape[0]):
        if s in rows:
            assert rel_err(state[s], state64[s]) < STATE_TOL, f"state slot {s}"
        else:
            assert bits_equal(state[s], before[0][s]), f"state slot {s} changed"
    new_fill = (fill + T) % C
    used = [int(s) for s in slots if s >= 0]
    for name, ours, ref, old in zip(("buf_k", "buf_v", "buf_g"), buf, buf64, before[1:]):
        for s in range(ours.shape[0]):
            if s not in used:
                assert bits_equal(ours[s], old[s]), f"{name} slot {s} changed"
            elif new_fill:
                assert rel_err(ours[s, :new_fill], ref[s, :new_fill]) < ENTRY_TOL, f"{name} slot {s}"


def test_prefill_falls_back_to_verify_chunks_without_the_kernel(monkeypatch, caplog):
    """With the chunked kernel missing (no artifact, not compiled) the prompt runs as verify chunks, logged,
    and still matches the reference."""
    from kvbuffer.errors import ArtifactError
    from kvbuffer.kernels import lookup

    real_kernel_for = lookup.kernel_for

    def no_prefill(key, batch=1):
        if key.op == "chunk_prefill":
            raise ArtifactError("no artifact")
        return real_kernel_for(key, batch)

    monkeypatch.setattr(lookup, "kernel_for", no_prefill)
    inputs, state, state_slots, buf, slots = problem("gdn", 1, 100, 3)
    state64, buf64 = state.double(), tuple(t.double() for t in buf)
    o_ref = REFERENCE.prefill(inputs._make(t.double() for t in inputs), state64, state_slots, buf64, slots, 3, C)
    with caplog.at_level("INFO", logger="kvbuffer"):
        o = KernelBackend().prefill(inputs, state, state_slots, buf, slots, 3, C)
    at = state_slots.long()
    assert rel_err(o, o_ref) < OUT_TOL and rel_err(state[at], state64[at]) < STATE_TOL
    assert any("prompts run as verify chunks" in r.getMessage() for r in caplog.records)
