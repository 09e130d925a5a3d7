"""The two model families as test fixtures: random layer parameters, random tokens, and the ops.

Tests drive both families through one interface so every property is checked for each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbuffer.pools import LinearLayerShape
from kvbuffer.reference import gdn, mamba2


@dataclass
class Family:
    """One family's shape, parameters and ops, with inputs drawn from a seeded generator."""

    name: str
    shape: LinearLayerShape
    params: dict
    ops: object  # module with recurrent_step / buffered_step / verify / prefill / flush

    def tokens(self, gen: torch.Generator, *lead: int, dtype=torch.float64) -> dict:
        """Fresh random per-token inputs of leading shape `lead` (e.g. (B,) or (B, T))."""
        s = self.shape
        r = lambda *shape: torch.randn(*lead, *shape, generator=gen, dtype=torch.float64)  # noqa: E731
        if self.name == "gdn":
            t = dict(q=r(s.num_k_heads, s.head_k_dim), k=r(s.num_k_heads, s.head_k_dim),
                     v=r(s.num_v_heads, s.head_v_dim), a=r(s.num_v_heads), b=r(s.num_v_heads))
        else:
            t = dict(x=r(s.num_v_heads, s.head_v_dim), dt=r(s.num_v_heads) - 1.0,
                     B=r(s.num_k_heads, s.head_k_dim) * 0.5, C=r(s.num_k_heads, s.head_k_dim) * 0.5)
        return {k: v.to(dtype) for k, v in t.items()}

    def args(self, tok: dict, dtype=torch.float64) -> tuple:
        """Positional token + parameter arguments in the family's op order."""
        p = {k: v.to(dtype) for k, v in self.params.items()}
        if self.name == "gdn":
            return (tok["q"], tok["k"], tok["v"], tok["a"], tok["b"], p["A_log"], p["dt_bias"])
        return (tok["x"], tok["dt"], p["A_log"], p["dt_bias"], tok["B"], tok["C"], p["D"])

    def slice_tokens(self, tok: dict, index) -> dict:
        return {k: v[index] for k, v in tok.items()}


def make_family(name: str, gen: torch.Generator, Hk=2, Hv=4, K=8, V=6) -> Family:
    """A small layer of the named family ('gdn' or 'mamba2') with random parameters."""
    shape = LinearLayerShape(Hk, Hv, K, V, delta_rule=(name == "gdn"))
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if name == "gdn":
        params = dict(A_log=torch.log(u(Hv) * 4 + 0.5), dt_bias=u(Hv) - 0.5)
        return Family(name, shape, params, gdn)
    params = dict(A_log=torch.log(u(Hv) * 4 + 0.5), dt_bias=u(Hv) - 0.5, D=u(Hv))
    return Family(name, shape, params, mamba2)


FAMILIES = ("gdn", "mamba2")
