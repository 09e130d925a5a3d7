"""The thread-level attention templates (tiles/attention.py: `attention_decode_simt`, `attention_combine`),
compiled for sm_90a by TileLang, run on the CPU through
tests/support/simt_emulator.py against kvbuffer.kernels.attention.attention_reference in fp64: outputs
NaN-poisoned before the launch, padding rows exactly zero, one split and several (decode + combine).
The GPU tests (tests/gpu/test_attention_kernels.py) cover the real device, long contexts, the engine,
and the tensor-core form (`attention_decode_mma`, whose bf16 products the emulator does not model).

The emulator runs a block's threads one after another, so the cases keep H x T x positions small: one KV head
(G = H) and 2 warps a block; every template shape the engine builds differs from these only in Hkv,
which only picks the cache column.
"""

import importlib.util
import os
import shutil
import zlib

import pytest
import torch

pytestmark = [pytest.mark.tilelang, pytest.mark.slow]

_NVCC = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
if importlib.util.find_spec("tilelang") is None or not _NVCC or not shutil.which("g++"):
    pytest.skip("needs TileLang, nvcc and g++", allow_module_level=True)

from kvbuffer.gpus import get_gpu  # noqa: E402  (the generated CUDA these tests read is Hopper's)
from kvbuffer.kernels.attention import attention_reference  # noqa: E402

from tests.support.simt_emulator import Emulated, emulated  # noqa: E402

THREADS, UNROLL = 64, 2
DT = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_EMU: dict = {}


def _emulated(template: str, **params) -> Emulated:
    """Lowered once per run (no nvcc); the emulator's build is cached on disk by its source's hash."""
    from kvbuffer.tiles import attention

    key = (template, tuple(sorted(params.items())))
    if key not in _EMU:
        _EMU[key] = emulated(getattr(attention, template)(**params), get_gpu("h200").target)
    return _EMU[key]


def _run(q, kc, vc, slots, cached, scale, splits, kv_dtype, form="simt"):
    """Both kernels as the launcher runs them (kvbuffer.kernels.attention.attention_decode); `form`
    "simt" (THREADS, UNROLL) or "mma" (the tensor-core decode pass, 128 threads, 64 positions a tile)."""
    from kvbuffer.kernels.keys import attention_query_block

    B, T, H, D = q.shape
    Hkv = kc.shape[2]
    dtype = "bfloat16" if q.dtype == torch.bfloat16 else "float32"
    if form == "mma":  # one block a (split, KV head, row) for all its query rows
        threads, nqb = 128, 1
        decode = _emulated("attention_decode_mma", H=H, Hkv=Hkv, D=D, T_len=T, dtype=dtype, threads=threads,
                           unroll=4)
    else:
        threads, nqb = THREADS, H // Hkv * T // attention_query_block(H // Hkv, T, D)
        decode = _emulated("attention_decode_simt", H=H, Hkv=Hkv, D=D, T_len=T, dtype=dtype, kv_dtype=kv_dtype,
                           threads=THREADS, unroll=UNROLL)
    out = torch.full_like(q, float("nan"))
    rows = B if splits > 1 else 1
    part = torch.full((rows, splits, T * H, D), float("nan"))
    stats = torch.full((rows, splits, T * H, 2), float("nan"))
    decode((splits, Hkv * nqb, B), threads, q=q, k_cache=kc, v_cache=vc, slots=slots, cached=cached, part=part,
           stats=stats, out=out, scale=scale, batch=B, num_slots=kc.shape[0], max_len=kc.shape[1], splits=splits,
           work_rows=rows)
    if splits > 1:
        combine = _emulated("attention_combine", H=H, D=D, T_len=T, dtype=dtype, threads=THREADS)
        combine((-(-T * H * D // THREADS), B, 1), THREADS, part=part, stats=stats, slots=slots, out=out, batch=B,
                splits=splits)
    return out


def _case(B, T, H, D, lengths, pad, dtype, kv_dtype, seed):
    """A pool of B + 2 slots (rows use them out of order), max_len past the longest row, lengths[b]
    positions already cached in row b (the T new ones follow), padding rows at `pad`."""
    g = torch.Generator().manual_seed(seed)
    max_len = max(lengths) + T + 3
    kc = torch.randn(B + 2, max_len, 1, D, generator=g).to(DT[kv_dtype])
    vc = torch.randn(B + 2, max_len, 1, D, generator=g).to(DT[kv_dtype])
    q = (1.5 * torch.randn(B, T, H, D, generator=g)).to(DT[dtype])  # peaked softmaxes as well as flat ones
    slots = torch.randperm(B + 2, generator=g)[:B].int()
    for b in pad:
        slots[b] = -1
    return q, kc, vc, slots, torch.tensor(lengths, dtype=torch.int32)


CASES = [  # (B, T, H (= G), D, cached lengths, padding rows, splits, dtype)
    (1, 1, 4, 256, [300], [], 1, "bfloat16"),
    (1, 1, 4, 256, [300], [], 5, "bfloat16"),
    (3, 1, 16, 128, [63, 0, 64], [], 2, "bfloat16"),
    (5, 1, 4, 128, [1, 65, 2, 0, 64], [3], 1, "bfloat16"),
    (5, 1, 4, 256, [1, 65, 2, 7, 64], [0, 3], 3, "float32"),
    (3, 5, 4, 256, [0, 63, 65], [1], 1, "bfloat16"),
    (3, 5, 4, 128, [2, 64, 1], [], 4, "bfloat16"),
    (3, 8, 4, 128, [0, 63, 64], [2], 3, "bfloat16"),
    (1, 8, 4, 256, [65], [], 2, "float32"),
]


@pytest.mark.parametrize("B,T,H,D,lengths,pad,splits,dtype", CASES,
                         ids=[f"B{c[0]}-T{c[1]}-G{c[2]}-D{c[3]}-S{c[6]}-{c[7]}" for c in CASES])
def test_attention_emulated(B, T, H, D, lengths, pad, splits, dtype):
    seed = zlib.crc32(f"{B}/{T}/{H}/{D}/{splits}/{dtype}".encode())
    q, kc, vc, slots, cached = _case(B, T, H, D, lengths, pad, dtype, dtype, seed)
    scale = D ** -0.5
    out = _run(q, kc, vc, slots, cached, scale, splits, dtype)
    want = attention_reference(q.double(), kc.double(), vc.double(), slots, cached, scale)
    assert bool(torch.isfinite(out).all())
    for b in pad:
        assert bool((out[b] == 0).all())
    rel = float((out.double() - want).norm() / want.norm())
    worst = float((out.double() - want).abs().max())
    assert rel < (5e-3 if dtype == "bfloat16" else 1e-5), (rel, worst)
    assert worst < (3e-2 if dtype == "bfloat16" else 1e-5), (rel, worst)


MMA_CASES = [  # (B, T, H (= G), D, cached lengths, padding rows, splits)
    (3, 1, 16, 64, [63, 0, 130], [], 1),   # Nemotron-3's G (the engine's case); 64 positions a tile
    (4, 1, 16, 64, [64, 1, 65, 200], [1], 3),
    (2, 1, 8, 128, [129, 7], [], 2),       # G = 8: eight zero query rows pad the tile
    # built and emulated, not taken by the engine yet: verifies, and fewer query heads (rows padded to 16)
    (3, 3, 16, 64, [0, 70, 130], [2], 2),  # Nemotron-3's verify of 2 drafts: 48 rows, causal within the tokens
    (2, 5, 4, 128, [66, 3], [], 3),        # Qwen3.5's G = 4: 20 rows in a tile of 32
    (2, 1, 4, 256, [140, 9], [], 1),       # Qwen3.5-9B's decode shape: 4 rows of 16
]


@pytest.mark.parametrize("B,T,H,D,lengths,pad,splits", MMA_CASES,
                         ids=[f"B{c[0]}-T{c[1]}-G{c[2]}-D{c[3]}-S{c[6]}" for c in MMA_CASES])
def test_tensor_core_form_emulated(B, T, H, D, lengths, pad, splits):
    """attention_decode_mma (bf16 mma, ldmatrix, stmatrix, the block reductions, all emulated) against
    fp64, every cache position past a row's NaN (its V rows must be zeroed before P V, and its scores
    masked), one split and several, decode steps and verifies."""
    seed = zlib.crc32(f"mma/{B}/{T}/{H}/{D}/{splits}".encode())
    q, kc, vc, slots, cached = _case(B, T, H, D, lengths, pad, "bfloat16", "bfloat16", seed)
    for b in range(B):
        if slots[b] >= 0:
            kc[slots[b], lengths[b] + T:] = float("nan")
            vc[slots[b], lengths[b] + T:] = float("nan")
    scale = D ** -0.5
    out = _run(q, kc, vc, slots, cached, scale, splits, "bfloat16", form="mma")
    want = attention_reference(q.double(), kc.double().nan_to_num(), vc.double().nan_to_num(), slots, cached, scale)
    assert bool(torch.isfinite(out).all())
    for b in pad:
        assert bool((out[b] == 0).all())
    rel = float((out.double() - want).norm() / want.norm())
    assert rel < 5e-3, rel


def test_fp32_cache_under_bf16_queries():
    """The cache's dtype is the kernel's own parameter (an fp32 cache under bf16 activations)."""
    q, kc, vc, slots, cached = _case(3, 1, 4, 128, [5, 64, 30], [1], "bfloat16", "float32", 7)
    out = _run(q, kc, vc, slots, cached, 0.1, 2, "float32")
    want = attention_reference(q.double(), kc.double(), vc.double(), slots, cached, 0.1)
    assert bool((out[1] == 0).all())
    assert float((out.double() - want).norm() / want.norm()) < 5e-3


def test_bad_template_parameters():
    from kvbuffer.tiles.attention import attention_combine, attention_decode

    with pytest.raises(ValueError, match="multiple"):
        attention_decode(6, 4, 128)
    with pytest.raises(ValueError, match="head dim"):
        attention_decode(4, 1, 96)
    with pytest.raises(ValueError, match="new tokens"):
        attention_decode(4, 1, 128, 9)
    with pytest.raises(ValueError, match="kv_dtype"):
        attention_decode(4, 1, 128, kv_dtype="float64")
    with pytest.raises(ValueError, match="threads"):
        attention_decode(4, 1, 128, threads=48)
    with pytest.raises(ValueError, match="dtype"):
        attention_combine(4, 128, dtype="int8")
