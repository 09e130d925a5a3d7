"""The chunked prefill's launches (tiles/gdn_prefill.py) run on the CPU through tests/support/simt_emulator.py,
driven by their launchers (kvbuffer.kernels.prefill.chunk_prefill / mamba2_chunk_prefill), against the ops'
fp64 references: GDN with each prep solve (forward substitution, blockwise), Mamba-2's decay-only form with
its front and D skip inside (dt limits too), both in each grid order. Awkward lengths (1, 63, 64, 65, 1000 and a packed batch with an
empty prompt), non-zero starting states, a sequence on slot -1 (zero start, no state written; Mamba-2's a
padding row, zero outputs), outputs poisoned with NaN first, pool slots outside the batch bit-exact.

Built for sm_80, where TileLang lowers the tensor-core products to mma_sync (which the emulator models); on
sm_90a they are wgmma (tests/gpu/test_gdn_prefill.py runs those). Small heads (one key head, two value heads,
K = V = 32) keep the emulator's one thread per CUDA thread affordable; the templates' index arithmetic is the
same at the models' shapes.
"""

import functools
import importlib.util
import os
import shutil
import zlib

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.tilelang, pytest.mark.slow]

_NVCC = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
if importlib.util.find_spec("tilelang") is None or not _NVCC or not shutil.which("g++"):
    pytest.skip("needs TileLang, nvcc and g++", allow_module_level=True)

from kvbuffer.gpus import get_gpu  # noqa: E402
from kvbuffer.kernels import prefill, specs  # noqa: E402
from kvbuffer.kernels.compiled import CompiledOp  # noqa: E402
from kvbuffer.kernels.keys import GDNDims, KernelKey, Mamba2Dims  # noqa: E402

from tests.support.simt_emulator import emulated  # noqa: E402

HEADS = (1, 2, 32, 32)  # Hk, Hv, K, V (Mamba-2: G, H, N, P)
THREADS = 128
TOL = 1e-2  # bf16 tensor-core operands, fp32 accumulation (as on the GPU)
LENGTHS = {"len1": [1], "len63": [63], "len64": [64], "len65": [65], "len1000": [1000],
           "mixed": [65, 1, 0, 64, 63]}


class _Part:
    """One emulated launch called as the compiled kernel is: positional arguments in the prim_func's order
    (the dynamic sizes read from the tensors), the grid from `grid(named arguments)`."""

    def __init__(self, prim, grid):
        self.emulated = emulated(prim, get_gpu("a100").target)
        self.names = [prim.buffer_map[p].name if p in prim.buffer_map else p.name for p in prim.params]
        self.sizes = {}  # dynamic size name -> (argument, axis, the constant added to it there)
        for p in prim.params:
            if p in prim.buffer_map:
                for axis, dim in enumerate(prim.buffer_map[p].shape):
                    var, offset = (dim.a, int(dim.b.value)) if hasattr(dim, "b") else (dim, 0)  # e.g. B + 1
                    if hasattr(var, "name") and var.name not in self.sizes:
                        self.sizes[var.name] = (prim.buffer_map[p].name, axis, offset)
        self.grid = grid

    def __call__(self, *args):
        named = dict(zip(self.names, args))
        named.update({size: named[arg].shape[axis] - offset for size, (arg, axis, offset) in self.sizes.items()})
        self.emulated(self.grid(named), THREADS, **named)


@functools.cache
def emulated_op(family: str, **tunables) -> CompiledOp:
    """The spec's launches for the small heads, each emulated, as the CompiledOp the launchers take."""
    from kvbuffer.tiles import gdn_prefill

    Hk, Hv, K, V = HEADS
    key = KernelKey(family, "chunk_prefill", (GDNDims if family == "gdn" else Mamba2Dims)(Hk, Hv, K, V), "bfloat16")
    spec = specs.spec_for(key)
    t = spec.complete_tunables(key, tunables)
    prims = spec.part_templates(gdn_prefill, key, t)
    heads = (lambda a: (a["chunk_slots"] * Hv, 1)) if t["heads_inner"] else (lambda a: (a["chunk_slots"], Hv))
    grids = {
        "chunks": lambda a: (-(-a["chunk_slots"] // THREADS), 1, 1),
        "prep": lambda a: (*heads(a), 1),
        "states": lambda a: (V // t["states_BV"], Hv, a["batch"]),
        "output": lambda a: (*heads(a), V // t["output_BV"]),
    }
    return CompiledOp({part: _Part(p, grids[part]) for part, p in prims.items()}, "chunk_prefill",
                      spec.launch_params(key, t))


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    """The launchers demand CUDA tensors; the emulator takes CPU ones."""
    monkeypatch.setattr(prefill, "check_on_cuda", lambda name, device: None)


def _case(lengths, seed: str):
    B = len(lengths)
    slots = [2 * i + 1 for i in range(B)]
    slots[B // 2] = -1
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    state = 0.1 * torch.randn(2 * B + 1, HEADS[1], HEADS[2], HEADS[3], generator=gen)
    return gen, cu, state, torch.tensor(slots, dtype=torch.int32)


def _rel(x, ref) -> float:
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _check_states(state, want, before, slots):
    real = [s for s in slots.tolist() if s >= 0]
    if real:
        assert _rel(state[real], want[real]) < TOL
    untouched = [s for s in range(state.shape[0]) if s not in real]
    assert torch.equal(state[untouched], before[untouched]), "a slot outside the batch changed"


@pytest.mark.parametrize("solve,heads_inner,staged", [("substitution", 0, 0), ("blockwise", 0, 0),
                                                      ("substitution", 1, 0), ("substitution", 0, 1)])
@pytest.mark.parametrize("case", LENGTHS)
def test_gdn_prefill_emulated(case, solve, heads_inner, staged):
    Hk, Hv, K, V = HEADS
    lengths = LENGTHS[case]
    gen, cu, state, slots = _case(lengths, f"gdn/{case}")
    N = sum(lengths)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = (F.normalize(r(N, Hk, K), dim=-1) * K ** -0.5).bfloat16()
    k = F.normalize(r(N, Hk, K), dim=-1).bfloat16()
    v, g, beta = r(N, Hv, V).bfloat16(), -F.softplus(r(N, Hv)) * torch.tensor([0.02, 0.5]), torch.sigmoid(r(N, Hv))
    before, want = state.clone(), state.double()
    o_ref = prefill.chunk_prefill_reference(q.double(), k.double(), v.double(), g.double(), beta.double(), cu, want,
                                            slots)
    out = torch.full((N, Hv, V), float("nan")).bfloat16()
    op = emulated_op("gdn", prep_solve=solve, heads_inner=heads_inner, staged_stores=staged)
    prefill.chunk_prefill(op, q, k, v, g, beta, cu, state, slots, out=out)
    assert bool(torch.isfinite(out).all())
    assert _rel(out, o_ref) < TOL
    _check_states(state, want, before, slots)


@pytest.mark.parametrize("heads_inner,staged", [(0, 0), (1, 0), (0, 1)])
@pytest.mark.parametrize("case", LENGTHS)
def test_mamba2_prefill_emulated(case, heads_inner, staged):
    """Mamba-2 from the layer's raw x and dt: the front (softplus, clamp, A's decay) in the state pass, the
    dt-weighted products and the D skip in the output pass; its slot -1 sequence is padding (zeros)."""
    G, H, Nst, P = HEADS
    lengths = LENGTHS[case]
    gen, cu, state, slots = _case(lengths, f"mamba2/{case}")
    N = sum(lengths)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x, Bm, Cm = (0.5 * r(N, H, P)).bfloat16(), (0.3 * r(N, G, Nst)).bfloat16(), (0.3 * r(N, G, Nst)).bfloat16()
    dt, A_log, dt_bias, D = r(N, H) - 1.0, torch.tensor([-2.0, 1.5]), 0.5 * r(H), r(H)
    before, want = state.clone(), state.double()
    y_ref = prefill.mamba2_chunk_prefill_reference(*(t.double() for t in (x, dt, A_log, dt_bias, Bm, Cm, D)), cu,
                                                   want, slots)
    out = torch.full((N, H, P), float("nan")).bfloat16()
    op = emulated_op("mamba2", heads_inner=heads_inner, staged_stores=staged)
    prefill.mamba2_chunk_prefill(op, x, dt, A_log, dt_bias, Bm, Cm, D, cu, state, slots, out=out)
    assert bool(torch.isfinite(out).all())
    assert _rel(out, y_ref) < TOL
    pad = slots.tolist().index(-1)
    assert bool((out[int(cu[pad]):int(cu[pad + 1])] == 0).all())
    _check_states(state, want, before, slots)


def test_mamba2_dt_limits_emulated():
    G, H, Nst, P = HEADS
    gen, cu, state, slots = _case([130, 65], "mamba2/limits")
    N = 195
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    tokens = ((0.5 * r(N, H, P)).bfloat16(), r(N, H), torch.tensor([-2.0, 1.5]), 0.5 * r(H),
              (0.3 * r(N, G, Nst)).bfloat16(), (0.3 * r(N, G, Nst)).bfloat16(), r(H))
    want = state.double()
    y_ref = prefill.mamba2_chunk_prefill_reference(*(t.double() for t in tokens), cu, want, slots, 0.2, 0.6)
    y = prefill.mamba2_chunk_prefill(emulated_op("mamba2"), *tokens, cu, state, slots, 0.2, 0.6)
    assert _rel(y, y_ref) < TOL
    assert _rel(state[slots[slots >= 0].long()], want[slots[slots >= 0].long()]) < TOL
