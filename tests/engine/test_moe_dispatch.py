"""Mixture-of-experts dispatch: the grouped matmul and the per-expert loop equal a per-token sum."""

import pytest
import torch
import torch.nn.functional as F

from kvbuffer.models import layers
from kvbuffer.models.layers import route_to_experts
from kvbuffer.reference.experts import grouped_ok


@pytest.mark.parametrize("I", [8, 6], ids=["aligned-grouped-mm", "unaligned-loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_route_to_experts_matches_per_token_sum(I, dtype):
    g = torch.Generator().manual_seed(0)
    N, H, E, k = 13, 16, 5, 2
    x = torch.randn(N, H, generator=g, dtype=dtype)
    first, down = torch.randn(E, 2 * I, H, generator=g, dtype=dtype), torch.randn(E, H, I, generator=g, dtype=dtype)
    idx = torch.randint(0, E, (N, 1), generator=g)
    idx = torch.cat([idx, (idx + 1) % E], 1)  # distinct experts per token; expert E-1 may get none
    w = torch.rand(N, k, generator=g, dtype=dtype)
    act = lambda y: F.silu(y[:, :I]) * y[:, I:]  # noqa: E731
    got = route_to_experts(x, idx, w, first, down, act)
    want = torch.zeros_like(x)
    for n in range(N):
        for j in range(k):
            e = idx[n, j]
            want[n] += w[n, j] * F.linear(act(F.linear(x[n:n + 1], first[e])), down[e])[0]
    tol = 1e-4 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    used = grouped_ok(x, first) and grouped_ok(x, down)
    assert used == (I == 8 and dtype == torch.float32 and hasattr(torch, "_grouped_mm"))
