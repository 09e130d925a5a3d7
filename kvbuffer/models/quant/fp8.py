"""FP8 (e4m3) arithmetic: quantize and dequantize weights by block, and the one GEMM of an FP8
projection, on FP8 tensor cores where this torch and GPU serve its scaling, else by dequantizing.

A weight's scale is a grid: W[i, j] = q[i, j] * scale[i // bn, j // bk] with (bn, bk) its block. Qwen's
block format has (128, 128) blocks; a ModelOpt per-tensor scale is kept as one scale per row (block
(1, K)), so that packed parts stack their scales.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ...kernels import launch
from ...reference.fp8 import FP8, FP8_MAX, GROUP, dequantize as reference_dequantize, quantize_activations, \
    quantize_activations_padded, scale_grid

log = logging.getLogger("kvbuffer")

NAN_BYTES = (0x7F, 0xFF)  # e4m3fn has no infinity; these two bytes are its NaNs


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """The (n, k) fp32 multiplier of each weight element from its block's scale."""
    s = scale.float().repeat_interleave(block[0], 0)[: shape[0]]
    return s.repeat_interleave(block[1], 1)[:, : shape[1]]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype=torch.float32) -> torch.Tensor:
    """W = q * scale per block (kvbuffer.reference.fp8), computed in fp32 and returned in `dtype`: the
    dequantized model's weight."""
    return reference_dequantize(q, scale, block).to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn, scale fp32 of the block grid) with w ~= dequantize(q, scale, block): each block
    scaled so that its largest magnitude maps to FP8_MAX (an all-zero block gets scale 1)."""
    n, k = w.shape
    gn, gk = scale_grid(n, k, block)
    padded = w.float().new_zeros(gn * block[0], gk * block[1])
    padded[:n, :k] = w.float()
    amax = padded.view(gn, block[0], gk, block[1]).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / expand_scale(scale, (n, k), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def has_nan_bytes(t: torch.Tensor) -> bool:
    """Whether an e4m3fn tensor holds a NaN encoding (isfinite does not serve float8)."""
    b = t.view(torch.uint8)
    return bool(((b & 0x7F) == 0x7F).any())


def _blockwise(x2, q, scale, out_dtype, fused: bool = True):
    """x2 (M, K) bf16 times the (128, 128)-block weight q on torch._scaled_mm. `fused`: x2 quantized by
    launch.FP8_QUANT_ACT (torch.ops.kvbuffer.fp8_quant_act: on CUDA the fused kernel where it loads, else
    the same torch ops); else by those torch ops directly (the device probe, which must build no kernel).
    Either way the activations and their scales come padded to 4 rows, the scales group-major: scale_a is
    their transpose, column-major."""
    m = x2.shape[0]
    quantize = launch.FP8_QUANT_ACT if fused else quantize_activations_padded
    xq, xs = quantize(x2)
    # the 1 x 128 activation scales outer-dim-major, the 128 x 128 weight scales as (K/128, N/128)
    y = torch._scaled_mm(xq, q.t(), scale_a=xs.t(), scale_b=scale.t(), out_dtype=out_dtype)
    return y[:m]


def _rowwise(x2, q, scale, input_scale, out_dtype):
    xq = (x2.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    scale_a = input_scale.float().reshape(1, 1).expand(x2.shape[0], 1).contiguous()
    return torch._scaled_mm(xq, q.t(), scale_a=scale_a, scale_b=scale.float().reshape(1, -1), out_dtype=out_dtype)


_SUPPORT: dict[torch.device, tuple[bool, bool]] = {}  # device -> (row-wise, block-wise) _scaled_mm
# cuBLASLt reads 128 x 128 weight scales in whole groups of 4 blocks along K (its scaling-factor layout
# rule; a scale tensor of another count gives wrong products, not an error): block-wise needs K / 128 % 4 == 0
K_BLOCKS = 4


def device_support(device: torch.device) -> tuple[bool, bool]:
    """(row-wise, block-wise): whether torch._scaled_mm runs FP8 GEMMs with per-row scales on `device`
    (a CUDA GPU of compute capability >= 8.9), and whether it also takes 1 x 128 / 128 x 128 block-wise
    scales there: tried once per device on a small product checked against the dequantized one, and a
    refusal logged once. The FP8 modules ask when they are moved to a device, before any forward (none
    is asked during a CUDA graph capture or a compile)."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False, False
    if device not in _SUPPORT:
        rowwise = torch.cuda.get_device_capability(device) >= (8, 9)
        _SUPPORT[device] = rowwise, rowwise and _try_blockwise(device)
    return _SUPPORT[device]


def _try_blockwise(device: torch.device) -> bool:
    try:
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(256, GROUP * K_BLOCKS, device=device, generator=g)
        x = torch.randn(32, GROUP * K_BLOCKS, device=device, generator=g).bfloat16()
        q, s = quantize(w, (GROUP, GROUP))
        got = _blockwise(x, q, s, torch.bfloat16, fused=False).float()
        xq, xs = quantize_activations(x)
        want = dequantize(xq, xs, (1, GROUP)) @ dequantize(q, s, (GROUP, GROUP)).t()
        ok = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())))
        why = "" if ok else " (its result differs from the dequantized product)"
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        ok, why = False, f" ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    if not ok:
        log.info("kvbuffer: this torch's _scaled_mm does not run block-scaled FP8 on %s%s; block-FP8 projections "
                 "dequantize their weights and run torch's GEMM", device, why)
    return ok


def gemm_path(x: torch.Tensor, q: torch.Tensor, block: tuple[int, int], input_scale: torch.Tensor | None,
              support: tuple[bool, bool] = (False, False), one_row: bool = False) -> str:
    """How an FP8 projection multiplies x by its weight q, chosen in this one place (`support`: the
    weight's device_support; `one_row`: the engine found its FP8 one-row kernel, kvbuffer.engine.one_row):

    - "one_row": one token in bf16 / fp16 on CUDA with `one_row`: the FP8 one-row kernel streams q
      (torch.ops.kvbuffer.fp8_gemv; x is not quantized: the dequantized product in fp32).

    - "rowwise": a per-tensor (ModelOpt) weight, kept as one scale per row, with its static input_scale: x
      quantized by input_scale, torch._scaled_mm with row-wise weight scales.
    - "blockwise": a (128, 128)-block weight where torch._scaled_mm takes block-wise scales, K a multiple
      of 128 x K_BLOCKS: x quantized per token and 128 columns, weights per 128 x 128 block.
    - "dequantize": everywhere else (the CPU, other blocks, sizes and dtypes): W = q * scale in x's dtype,
      then F.linear; exactly the dequantized model's product.

    Both FP8 paths need x in bf16 (the scaled GEMMs' output dtype) on the weight's CUDA device and N, K
    multiples of 16 (128 for block-wise).
    """
    n, k = q.shape
    if one_row and x.is_cuda and x.numel() == k and x.dtype in (torch.bfloat16, torch.float16):
        return "one_row"
    rowwise, blockwise = support
    if not (rowwise and x.is_cuda and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0):
        return "dequantize"
    if input_scale is not None and block == (1, k):
        return "rowwise"
    if blockwise and block == (GROUP, GROUP) and n % GROUP == 0 and k % (GROUP * K_BLOCKS) == 0:
        return "blockwise"
    return "dequantize"


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               support: tuple[bool, bool] = (False, False), one_row: bool = False) -> torch.Tensor:
    """x (..., K) times the FP8 weight q (N, K) scaled per `block` (plus `bias`), in x's dtype; the path
    is gemm_path's."""
    path = gemm_path(x, q, block, input_scale, support, one_row)
    if path == "dequantize":
        return F.linear(x, dequantize(q, scale, block, x.dtype), bias)
    if path == "one_row":
        y = launch.FP8_GEMV(x.reshape(1, -1).contiguous(), q, scale, *block).view(*x.shape[:-1], q.shape[0])
        return y if bias is None else y + bias
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_zeros(*x.shape[:-1], q.shape[0])
    x2 = x2.contiguous()
    y = _rowwise(x2, q, scale, input_scale, x.dtype) if path == "rowwise" else _blockwise(x2, q, scale, x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], q.shape[0])
