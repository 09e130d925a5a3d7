"""The kernel Backend's prompt path (flush, chunked prefill, verify chunks for the rest) against the
reference Backend's chunked prefill, on the CPU in float64: the ops' CPU implementations are the
reference, so everything but the CUDA launches runs.

Outputs, every state slot, the buffer entries up to each row's new fill (other slots bit-exact) must
agree to fp64 rounding, for prompts of 1 .. 1000 tokens after fills 0 .. C-1, one row or three with
a padding row, both families.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvbuffer.runtime.backend import PARAMETERS, REFERENCE, GDNInputs, KernelBackend, Mamba2Inputs
from tests.support.families import FAMILIES, make_family

F64 = torch.float64
TOL = 1e-10
C = 16
CAP = C + 3
SHAPES = {"gdn": dict(Hk=2, Hv=4, K=7, V=5), "mamba2": dict(Hk=2, Hv=8, K=16, V=6)}
LENGTHS = (1, C - 1, C, C + 1, 63, 64, 65, 1000)
FILLS = (0, 1, 7, C - 1)


def problem(family: str, B: int, T: int, fill: int, padding: bool, seed: str):
    """(inputs (B, T, ...), state pool, state slots, buffer pools, buffer slots): slots permuted over
    pools of B + 2 garbage-filled slots; with `padding`, the middle row is a padding row (slots -1)."""
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    fam = make_family(family, gen, **SHAPES[family])
    s = fam.shape
    n = B + 2
    tok = fam.tokens(gen, B, T)
    inputs = (GDNInputs if family == "gdn" else Mamba2Inputs)(*fam.args(tok))
    # the kernel Backend hands the layer parameters to its ops in fp32: make them exact there
    inputs = inputs._replace(**{p: getattr(inputs, p).float().double() for p in PARAMETERS if p in inputs._fields})
    state = torch.randn(n, s.num_v_heads, s.head_k_dim, s.head_v_dim, generator=gen, dtype=F64)
    buf = (torch.randn(n, CAP, s.num_k_heads, s.head_k_dim, generator=gen, dtype=F64),
           torch.randn(n, CAP, s.num_v_heads, s.head_v_dim, generator=gen, dtype=F64),
           -torch.rand(n, CAP, s.num_v_heads, generator=gen, dtype=F64).cumsum(1))
    perm = torch.randperm(n, generator=gen)[:B].to(torch.int32)
    slots = torch.randperm(n, generator=gen)[:B].to(torch.int32)
    if padding:
        perm[B // 2], slots[B // 2] = -1, -1
    state_slots = perm if fill + T >= C else torch.full_like(perm, -1)  # the runner's rule: a state once it folds
    return inputs, state, state_slots, buf, slots


def side_by_side(inputs: GDNInputs) -> GDNInputs:
    """The same values with q, k, v as views of one (B, T, ...) projection output, as the models give them."""
    B, T = inputs.q.shape[:2]
    qkv = torch.cat([inputs.q.flatten(2), inputs.k.flatten(2), inputs.v.flatten(2)], -1)
    q, k, v = qkv.split([inputs.q[0, 0].numel(), inputs.k[0, 0].numel(), inputs.v[0, 0].numel()], -1)
    return inputs._replace(q=q.view(inputs.q.shape), k=k.view(inputs.k.shape), v=v.view(inputs.v.shape))


def run(backend, family, B, T, fill, padding, seed, fuse=False):
    inputs, state, state_slots, buf, slots = problem(family, B, T, fill, padding, seed)
    inputs = side_by_side(inputs) if fuse else inputs
    o = backend.prefill(inputs, state, state_slots, buf, slots, fill, C, fuse)
    return o, state, buf, slots


def check(family, B, T, fill, padding, fuse=False):
    seed = f"{family}/{B}/{T}/{fill}/{padding}"
    before = problem(family, B, T, fill, padding, seed)
    o_ref, state_ref, buf_ref, slots = run(REFERENCE, family, B, T, fill, padding, seed)
    o, state, buf, _ = run(KernelBackend(), family, B, T, fill, padding, seed, fuse)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    torch.testing.assert_close(o, o_ref, rtol=0, atol=TOL)
    assert torch.equal(o[slots < 0], torch.zeros_like(o[slots < 0]))
    torch.testing.assert_close(state, state_ref, rtol=0, atol=TOL)
    new_fill = (fill + T) % C
    rows = {int(b) for b in slots if b >= 0}
    for ours, ref, old in zip(buf, buf_ref, before[3]):
        for slot in range(ours.shape[0]):
            if slot in rows:
                torch.testing.assert_close(ours[slot, :new_fill], ref[slot, :new_fill], rtol=0, atol=TOL)
            else:
                assert torch.equal(ours[slot], old[slot]), f"buffer slot {slot} was written"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T", LENGTHS, ids=lambda T: f"T{T}")
@pytest.mark.parametrize("fill", FILLS, ids=lambda f: f"fill{f}")
def test_one_row_matches_reference_backend(family, T, fill):
    check(family, 1, T, fill, padding=False)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T,fill", [(1, C - 1), (C - 1, 0), (C, 3), (C + 1, 5), (63, 2), (64, 0), (65, C - 1),
                                    (1000, 9), (5, 4)], ids=str)
def test_three_rows_with_a_padding_row_match_reference_backend(family, T, fill):
    check(family, 3, T, fill, padding=True)


@pytest.mark.parametrize("B,T,fill,padding,region", [(1, C, 0, False, True), (1, 1000, 7, False, True),
                                                     (3, 65, C - 1, True, True), (2, 40, 3, False, False)], ids=str)
def test_the_fused_front_matches_reference_backend(B, T, fill, padding, region, monkeypatch):
    """ForwardBatch.fuse: the GDN prompt's front as a compiled region (kvbuffer.runtime.regions; Inductor's
    C++ code here) gives the reference's outputs, states and buffers; where several rows leave a tail to
    buffer (their folded tokens do not flatten as a view) the eager front runs instead, as exactly."""
    from kvbuffer.runtime import regions

    monkeypatch.setattr(regions, "_COMPILED", {})
    check("gdn", B, T, fill, padding, fuse=True)
    assert bool(regions._COMPILED.get(regions._gdn_front)) == region  # the region ran, compiled, or not at all


def test_chunked_prefill_is_skipped_below_a_flush_point(monkeypatch):
    """fill + T < C: no fold, so the prompt runs as verify chunks and the chunked op is never called."""
    called = []
    monkeypatch.setattr(KernelBackend, "_fold_prompt", lambda *a: called.append(a))
    check("gdn", 3, C - 4, 3, padding=True)
    assert not called
