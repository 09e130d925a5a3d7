"""The GDN prompt's front as a compiled region (ForwardBatch.fuse; kvbuffer.runtime.regions) on a CUDA GPU:
the kernel Backend's prefill with it gives the eager front's outputs, states and buffers, at the 9B's
heads, bf16 projections side by side in one tensor, a padding row among the rows."""

from __future__ import annotations

import pytest
import torch

from kvbuffer.runtime import regions
from kvbuffer.runtime.backend import GDNInputs, KernelBackend
from tests.support.gdn_cases import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]

Hk, Hv, K, V, C = 16, 32, 128, 128, 16
E = C + 1  # the engine's buffer layout (and its kernels' keys): C entries plus the one a decode step appends


def problem(B: int, T: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    width = 2 * Hk * K + Hv * V
    proj = (r(B, T, width + 2 * Hv) * 2).to(torch.bfloat16)
    q, k, v = proj[..., :Hk * K], proj[..., Hk * K:2 * Hk * K], proj[..., 2 * Hk * K:width]
    inputs = GDNInputs(q.view(B, T, Hk, K), k.view(B, T, Hk, K), v.view(B, T, Hv, V), proj[..., width + Hv:],
                       proj[..., width:width + Hv], r(Hv) * 0.5, r(Hv).sigmoid() * 2 - 1)
    n = B + 2
    state = r(n, Hv, K, V) * 0.1
    buf = (r(n, E, Hk, K).to(torch.bfloat16), r(n, E, Hv, V).to(torch.bfloat16),
           -torch.rand(n, E, Hv, generator=gen, device="cuda").cumsum(1))
    slots = torch.tensor([2, -1, 0][:B], dtype=torch.int32, device="cuda")
    return inputs, state, slots.clone(), buf, slots


@pytest.mark.parametrize("B,T,fill", [(1, 4096, 0), (3, 1005, 3)], ids=str)
def test_the_fused_front_gives_the_eager_fronts_prompt(B, T, fill, monkeypatch):
    monkeypatch.setattr(regions, "_COMPILED", {})
    runs = []
    for fuse in (False, True):
        inputs, state, state_slots, buf, slots = problem(B, T, seed=B * 7 + T)
        o = KernelBackend().prefill(inputs, state, state_slots, buf, slots, fill, C, fuse)
        runs.append((o, state, buf))
    assert regions._COMPILED.get(regions._gdn_front)  # compiled (Triton), not run eagerly
    (o0, s0, b0), (o1, s1, b1) = runs
    real = torch.tensor([True, False, True][:B], device="cuda")
    assert rel_err(o1[real], o0[real]) < 1e-2 and torch.equal(o1[~real], torch.zeros_like(o1[~real]))
    assert rel_err(s1, s0) < 1e-2
    for x, y in zip(b1, b0):
        assert rel_err(x, y) < 1e-2
