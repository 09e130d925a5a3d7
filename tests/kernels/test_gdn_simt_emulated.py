"""The thread-level GDN buffered template (tiles/gdn.py `gdn_buffered`), lowered for sm_90a by TileLang,
run on the CPU through tests/support/simt_emulator.py against the fp64 reference: outputs, written entries,
untouched buffer positions (NaN-poisoned beyond lengths) and the fused-flush state. The GPU tests
(tests/gpu/test_gdn_kernels.py) cover the real device; this catches indexing and barrier bugs on CPU.
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

from kvbuffer.reference import core as ref  # noqa: E402
from kvbuffer.gpus import get_gpu  # noqa: E402  (the generated CUDA these tests read is Hopper's)
from kvbuffer.reference.gating import gdn_front  # noqa: E402

from tests.support.simt_emulator import emulated  # noqa: E402
from tests.support.gdn_cases import FP32_CASE, fp32_accuracy_case  # noqa: E402
from tests.support.gdn_cases import bits_equal as _bits, rel_err as _rel  # noqa: E402  (shared with the GPU tests)

CASES = {  # name: (kernel params, fill, B, null state row, padding row)
    "step_fused_flush_BV64": (dict(Hk=2, Hv=4, cap=17, T_new=1, flush_at=16, BV=64, threads=128), 15, 3, None, 2),
    "verify4_shuffles_BV32": (dict(Hk=2, Hv=4, cap=24, T_new=4, flush_at=0, BV=32, threads=128), 5, 3, 1, 2),
    "prefill2_small_heads": (dict(Hk=1, Hv=2, K=32, V=32, cap=9, T_new=2, flush_at=8, BV=32, threads=64), 6, 3, None, 2),
    # the small-batch value tiles (tiles.gdn.SMALL_BATCH_CONFIGS): 4 or 2 column groups, 16 or 32 row groups
    "small_batch_step_fused_flush_BV16": (dict(Hk=2, Hv=4, cap=17, T_new=1, flush_at=16, BV=16, threads=64),
                                          15, 3, None, 2),
    "small_batch_verify5_BV16_128": (dict(Hk=2, Hv=4, cap=21, T_new=5, flush_at=0, BV=16, threads=128), 11, 3, 1, 2),
    "small_batch_verify2_BV8": (dict(Hk=2, Hv=4, cap=17, T_new=2, flush_at=16, BV=8, threads=64), 14, 3, None, 2),
    # S0 products on tensor cores (tiles.simt_parts.mma_products): a warp per 32 columns; the flush reuses the
    # same registers; with 13 X rows the MMA's A rows past them are clamped
    "tensor_cores_verify5_BV32": (dict(Hk=2, Hv=4, cap=21, T_new=5, flush_at=0, BV=32, threads=32, tensor_cores=1),
                                  11, 3, 1, 2),
    "tensor_cores_step_fused_flush_BV64": (dict(Hk=2, Hv=4, cap=17, T_new=1, flush_at=16, BV=64, threads=64,
                                                tensor_cores=1), 15, 3, None, 2),
    "tensor_cores_verify3_empty_buffers": (dict(Hk=2, Hv=4, cap=21, T_new=3, flush_at=0, BV=64, threads=64,
                                                tensor_cores=1), 0, 3, 1, 2),
    "tensor_cores_prefill2_small_heads": (dict(Hk=1, Hv=2, K=32, V=32, cap=9, T_new=2, flush_at=8, BV=32, threads=32,
                                               tensor_cores=1), 6, 3, None, 2),
    # the untuned default at 8 tokens per row (tiles.gdn.TENSOR_CORE_TOKENS): an 8-token prompt chunk that fills
    # the buffer and folds it, 16 MMA query rows
    "tensor_cores_prefill8_fused_flush": (dict(Hk=2, Hv=4, cap=17, T_new=8, flush_at=16, BV=32, threads=32,
                                               tensor_cores=1), 8, 3, None, 2),
    # lean: the products in two halves, v and the history sums parked in shared memory until phase 4
    "lean_verify5_shuffles": (dict(Hk=2, Hv=4, cap=21, T_new=5, flush_at=0, BV=32, threads=128, lean=1), 11, 3, 1, 2),
    "lean_prefill2_fused_flush": (dict(Hk=2, Hv=4, cap=17, T_new=2, flush_at=16, BV=64, threads=128, lean=1),
                                  14, 3, None, 2),
}
# gate inputs a at the extremes (row, token): +inf, and 3e38 on consecutive tokens; the rows' buffers also hold
# an earlier step at the clamp (G drops by 128 mid-buffer)
EXTREME = {"inf": float("inf"), "huge": 3e38}
EXTREME_CASES = {
    "extreme_verify4": ("verify4_shuffles_BV32", {(0, 1): "inf", (1, 1): "huge", (1, 2): "huge", (1, 3): "huge"}),
    "extreme_step_fused_flush": ("step_fused_flush_BV64", {(0, 0): "inf", (1, 0): "huge"}),
    "extreme_tensor_cores_verify5": ("tensor_cores_verify5_BV32", {(0, 1): "inf", (1, 2): "huge", (1, 3): "huge"}),
    "extreme_lean_verify5": ("lean_verify5_shuffles", {(0, 1): "inf", (1, 2): "huge", (1, 3): "huge"}),
}


@pytest.mark.parametrize("case", list(CASES) + list(EXTREME_CASES))
def test_simt_template_emulated(case):
    from kvbuffer.tiles.gdn import gdn_buffered

    base, extremes = EXTREME_CASES.get(case, (case, {}))
    params, fill, B, null_row, pad_row = CASES[base]
    Hk, Hv, T, C, cap = params["Hk"], params["Hv"], params["T_new"], params["flush_at"], params["cap"]
    K, V = params.get("K", 128), params.get("V", 128)
    emu = emulated(gdn_buffered(**params), get_gpu("h200").target)

    g = torch.Generator().manual_seed(len(case))
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(B, T, Hk, K).bfloat16(), r(B, T, Hk, K).bfloat16(), r(B, T, Hv, V).bfloat16()
    a, b = r(B, T, Hv).bfloat16(), r(B, T, Hv).bfloat16()
    A_log = torch.log(1 + 15 * torch.rand(Hv, generator=g))
    dt_bias = torch.log(torch.expm1(0.001 + 0.1 * torch.rand(Hv, generator=g)))
    ns = nb = B + 3
    state = 0.5 * r(ns, Hv, K, V)
    bk = torch.full((nb, cap, Hk, K), float("nan")).bfloat16()
    bv = torch.full((nb, cap, Hv, V), float("nan")).bfloat16()
    bg = torch.full((nb, cap, Hv), float("nan"))
    bk[:, :fill] = torch.nn.functional.normalize(r(nb, fill, Hk, K), dim=-1).bfloat16()
    bv[:, :fill] = (0.5 * r(nb, fill, Hv, V)).bfloat16()
    bg[:, :fill] = torch.cumsum(-(0.02 + 0.5 * torch.rand(nb, fill, Hv, generator=g)), dim=1)
    for (row, t), name in extremes.items():
        a[row, t] = EXTREME[name]
    if extremes:
        bg[:, fill // 2:fill] += ref.LOG_DECAY_FLOOR
    ss, bs = torch.randperm(ns, generator=g)[:B].int(), torch.randperm(nb, generator=g)[:B].int()
    if null_row is not None:
        ss[null_row] = -1
    bs[pad_row] = -1
    ln = torch.full((B,), fill, dtype=torch.int32)
    before = [t.clone() for t in (state, bk, bv, bg)]
    rk, rv, rg = (torch.nan_to_num(t.clone(), nan=0.0) for t in (bk, bv, bg))
    o = torch.full_like(v, float("nan"))

    emu((V // params["BV"], Hv, B), params["threads"], q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
        state=state, state_slots=ss, buf_k=bk, buf_v=bv, buf_g=bg, buffer_slots=bs, lengths=ln, o=o,
        batch=B, num_buffer_slots=nb, num_state_slots=ns)

    q64, k64, g64, be64 = gdn_front(q, k, a, b, A_log, dt_bias, dtype=torch.float64)
    s64 = before[0].double()
    o64 = ref.verify(q64, k64, v.double(), g64, be64, s64, ss.long(), rk, rv, rg, bs.long(), ln.long())
    flushed = bool(C) and fill + T == C
    if flushed:
        ref.flush(s64, ss.long(), rk, rv, rg, bs.long(), (ln + T).long())
    assert _rel(o, o64) < 1e-2
    assert _rel(state, s64) < 1e-6
    assert bool(torch.isfinite(bg[bs[bs >= 0].long(), :fill + T]).all())
    written = torch.zeros(bk.shape[:2], dtype=torch.bool)
    for row in torch.nonzero(bs >= 0).flatten().tolist():
        written[int(bs[row]), fill:fill + T] = True
    for got, want, old, tol in ((bk, rk, before[1], 1e-2), (bv, rv, before[2], 1e-2), (bg, rg, before[3], 1e-6)):
        assert _rel(got[written], want[written]) < tol
        assert _bits(got[~written], old[~written])
    touched = torch.zeros(ns, dtype=torch.bool)
    if flushed:
        touched[ss[bs >= 0].long()] = True
    assert _bits(state[~touched], before[0][~touched])


@pytest.mark.parametrize("tensor_cores,in_dtype", [(0, "bfloat16"), (1, "bfloat16"), (1, "float32")])
def test_s0_products_keep_fp32_accuracy(tensor_cores, in_dtype):
    """With fp32 buffer entries the new deltas (beta (v - S0^T k ...)) are stored unrounded, so their error
    against fp64 is the S0 products' own: the tensor-core split (3xTF32) must match fp32 FMAs, where
    one TF32 product leaves ~7e-5. With fp32 activations too, the output shows it as well.
    (tests/gpu/test_gdn_kernels.py runs the same case on the device.)"""
    from kvbuffer.tiles.gdn import gdn_buffered

    params = dict(FP32_CASE, tensor_cores=tensor_cores, in_dtype=in_dtype, buf_dtype="float32")
    emu = emulated(gdn_buffered(**params), get_gpu("h200").target)
    args, want, deltas = fp32_accuracy_case(in_dtype)
    B, fill = args["q"].shape[0], int(args["lengths"][0])
    emu((FP32_CASE["V"] // FP32_CASE["BV"], FP32_CASE["Hv"], B), FP32_CASE["threads"], **args, batch=B,
        num_buffer_slots=B, num_state_slots=B)
    assert _rel(args["buf_v"][:, fill:fill + FP32_CASE["T_new"]], deltas) < 2e-6
    assert _rel(args["o"], want) < (2e-6 if in_dtype == "float32" else 1e-2)
