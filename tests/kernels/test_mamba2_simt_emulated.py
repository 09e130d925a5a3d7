"""The thread-level Mamba-2 buffered template (tiles/mamba2_simt.py, `mamba2_buffered(variant="simt")`),
lowered for sm_90a by TileLang, run on the CPU through tests/support/simt_emulator.py against the fp64 reference
(kvbuffer.reference.mamba2): outputs (padding rows exactly zero), written entries, untouched buffer
positions (NaN-poisoned beyond lengths) and pool slots bit-exact, the fused-flush state. Rows of one launch
hold different fills (0, 1, C-1 flushing, C, cap-T), so one compile covers several. The GPU tests
(tests/gpu/test_mamba2_kernels.py) cover the real device; this catches indexing and barrier bugs on CPU.
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

from kvbuffer.reference import mamba2 as ref  # noqa: E402
from kvbuffer.gpus import get_gpu  # noqa: E402  (the generated CUDA these tests read is Hopper's)

from tests.support.simt_emulator import emulated  # noqa: E402
from tests.support.gdn_cases import bits_equal as _bits, rel_err as _rel  # noqa: E402  (shared with the GPU tests)

# name: (kernel params, per-row fills, rows with no state (-1), padding rows (buffer slot -1)); every case names
# its heads per block
CASES = {
    # the Nemotron-3 tile (N 128, P 64): rows at C-1 fold their buffer in the step that fills it
    "step_fused_flush_nemotron_tile_z": (
        dict(G=2, H=4, N=128, P=64, cap=17, T_new=1, flush_at=16, BV=64, threads=128, heads=1, has_z=True),
        [15, 0, 1, 15, 7], [1], [4]),
    # drafts after fills 0, 1, C-1, C (C = 16 nominal; the last one also fills the buffer to cap)
    "verify4_no_flush_full_buffer": (
        dict(G=2, H=4, N=64, P=32, cap=20, T_new=4, flush_at=0, BV=32, threads=64, heads=1),
        [0, 16, 1, 15, 3], [2], [4]),
    "prefill2_fused_flush_BV16_shuffles": (
        dict(G=1, H=2, N=64, P=32, cap=9, T_new=2, flush_at=8, BV=16, threads=64, heads=1, has_z=True),
        [6, 0, 1], [1], []),
    "prefill8_fused_flush_fp32_inputs": (
        dict(G=1, H=2, N=32, P=32, cap=9, T_new=8, flush_at=8, BV=32, threads=64, heads=1, in_dtype="float32"),
        [0, 0], [], [1]),
    # the small-batch value tiles (tiles.mamba2_simt.SMALL_BATCH_CONFIGS)
    "small_batch_step_fused_flush_BV16": (
        dict(G=2, H=4, N=128, P=64, cap=17, T_new=1, flush_at=16, BV=16, threads=64, heads=1, has_z=True),
        [15, 0, 1, 7], [1], [3]),
    "small_batch_verify5_BV8": (
        dict(G=2, H=4, N=64, P=32, cap=21, T_new=5, flush_at=0, BV=8, threads=64, heads=1),
        [0, 11, 1], [2], []),
    # several heads of a group per block (`heads`): the keys and the Gram shared, the rest per head
    "two_heads_step_fused_flush_nemotron_tile_z": (
        dict(G=2, H=4, N=128, P=64, cap=17, T_new=1, flush_at=16, BV=64, threads=64, has_z=True, heads=2),
        [15, 0, 1, 15, 7], [1], [4]),
    "two_heads_verify4_no_flush_full_buffer": (
        dict(G=2, H=4, N=64, P=32, cap=20, T_new=4, flush_at=0, BV=32, threads=64, heads=2),
        [0, 16, 1, 15, 3], [2], [4]),
    "four_heads_step_fused_flush_nemotron_tile_z": (
        dict(G=2, H=8, N=128, P=64, cap=17, T_new=1, flush_at=16, BV=64, threads=64, has_z=True, heads=4),
        [15, 0, 1, 15, 7], [1], [4]),
    "four_heads_prefill2_fused_flush_BV16": (
        dict(G=1, H=4, N=64, P=32, cap=9, T_new=2, flush_at=8, BV=16, threads=64, has_z=True, heads=4),
        [6, 0, 1], [1], []),
}
# decays at the extremes on every token (head: A_log): g = -inf on head 0, g ~ -1e38 on head 1 (sums overflow
# fp32); the case's own gates elsewhere
EXTREME_CASES = {
    "extreme_step_fused_flush": ("step_fused_flush_nemotron_tile_z", {0: float("inf"), 1: 88.0}),
    "extreme_verify4": ("verify4_no_flush_full_buffer", {0: float("inf"), 1: 88.0}),
    "extreme_two_heads_step_fused_flush": ("two_heads_step_fused_flush_nemotron_tile_z", {0: float("inf"), 1: 88.0}),
}


@pytest.mark.parametrize("case", list(CASES) + list(EXTREME_CASES))
def test_mamba2_simt_template_emulated(case):
    from kvbuffer.tiles.mamba2 import mamba2_buffered

    base, extreme_heads = EXTREME_CASES.get(case, (case, {}))
    params, fills, null_rows, pad_rows = CASES[base]
    G, H, N, P = params["G"], params["H"], params["N"], params["P"]
    T, C, cap, has_z = params["T_new"], params["flush_at"], params["cap"], params.get("has_z", False)
    act = getattr(torch, params.get("in_dtype", "bfloat16"))
    emu = emulated(mamba2_buffered(**params, variant="simt"), get_gpu("h200").target)

    B = len(fills)
    g = torch.Generator().manual_seed(len(case))
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, z = r(B, T, H, P).to(act), r(B, T, H, P).to(act)
    dt = (r(B, T, H) - 2).to(act)
    Bm, Cm = r(B, T, G, N).to(act), r(B, T, G, N).to(act)
    A_log = torch.log(1 + 7 * torch.rand(H, generator=g))
    for head, value in extreme_heads.items():
        A_log[head] = value
    dt_bias = torch.log(torch.expm1(0.001 + 0.1 * torch.rand(H, generator=g)))
    D = r(H)
    ns = nb = B + 3
    state = 0.5 * r(ns, H, N, P)
    fill = max(fills)
    bk = torch.full((nb, cap, G, N), float("nan")).bfloat16()
    bv = torch.full((nb, cap, H, P), float("nan")).bfloat16()
    bg = torch.full((nb, cap, H), float("nan"))
    ss, bs = torch.randperm(ns, generator=g)[:B].int(), torch.randperm(nb, generator=g)[:B].int()
    ln = torch.tensor(fills, dtype=torch.int32)
    for row, n in enumerate(fills):  # each row's own fill; positions past it stay NaN
        s = int(bs[row])
        bk[s, :n] = r(n, G, N).bfloat16()
        bv[s, :n] = (0.5 * r(n, H, P)).bfloat16()
        bg[s, :n] = torch.cumsum(-(0.02 + 0.5 * torch.rand(n, H, generator=g)), dim=0)
    ss[null_rows] = -1
    bs[pad_rows] = -1
    assert fill + T <= cap
    before = [t.clone() for t in (state, bk, bv, bg)]
    rk, rv, rg = (torch.nan_to_num(t.clone(), nan=0.0) for t in (bk, bv, bg))
    y = torch.full_like(x, float("nan"))

    heads = params.get("heads", 1)  # a block serves that many heads, `threads` threads each
    emu((P // params["BV"], H // heads, B), params["threads"] * heads, x=x, dt=dt, A_log=A_log, dt_bias=dt_bias, Bm=Bm, Cm=Cm, D=D,
        z=z if has_z else x, state=state, state_slots=ss, buf_k=bk, buf_v=bv, buf_g=bg, buffer_slots=bs,
        lengths=ln, y=y, batch=B, num_buffer_slots=nb, num_state_slots=ns)

    d = lambda t: t.double()  # noqa: E731
    s64 = d(before[0])
    y64 = ref.verify(d(x), d(dt), d(A_log), d(dt_bias), d(Bm), d(Cm), d(D), s64, ss.long(), rk, rv, rg, bs.long(),
                     ln.long(), d(z) if has_z else None)
    full = (bs >= 0) & (ln + T == C) if C else torch.zeros(B, dtype=torch.bool)
    if bool(full.any()):
        keep = torch.where(full, bs, torch.full_like(bs, -1))
        ref.flush(s64, ss.long(), rk, rv, rg, keep.long(), (ln + T).long())
    errs = {"y": _rel(y, y64), "state": _rel(state, s64)}
    written = torch.zeros(bk.shape[:2], dtype=torch.bool)
    for row in torch.nonzero(bs >= 0).flatten().tolist():
        written[int(bs[row]), fills[row]:fills[row] + T] = True
    for name, got, want, old in (("buf_k", bk, rk, before[1]), ("buf_v", bv, rv, before[2]),
                                 ("buf_g", bg, rg, before[3])):
        errs[name] = _rel(got[written], want[written])
        assert _bits(got[~written], old[~written]), f"{name} changed outside the new entries"
    print(case, {k: f"{v:.2e}" for k, v in errs.items()})
    assert errs["y"] < 1e-2 and errs["buf_k"] == 0 and errs["buf_v"] < 1e-2 and errs["buf_g"] < 1e-6
    assert errs["state"] < 1e-6
    assert bool(torch.isfinite(bg[written]).all())
    for row in pad_rows:
        assert bool((y[row] == 0).all()), "a padding row must output exact zeros"
    touched = torch.zeros(ns, dtype=torch.bool)
    touched[ss[full].long()] = True
    assert int(touched.sum()) == int(full.sum())
    assert _bits(state[~touched], before[0][~touched])
