"""The block-FP8 activation quantizer's tuner template (tiles/fp8_quant.py), family "fp8_quant"; its shape is
kvbuffer.kernels.keys.projection_shape("fp8_quant", K, K, dtype, (1, 128)): x's columns K, the scale
block 1 x 128.

    fp8_quant_act   x (TIMED_ROWS, K) -> q (TIMED_ROWS, K) float8_e4m3fn, scale (K / 128, TIMED_ROWS) fp32

Its rows are dynamic, and every batch bucket times one prompt's worth of them (TIMED_ROWS tokens, the
prefill the block-FP8 GEMMs serve). Inputs: x ~ N(0, 1) scaled per row and group by 10^U(-3, 3); the
outputs poisoned (NaN bytes, NaN scales); the check is against kvbuffer.reference.fp8, which the kernel
equals bit for bit (tolerance 0).
"""

from __future__ import annotations

import importlib.util

from kvbuffer.kernels.keys import FP8_DTYPE, GemvDims, KernelKey
from kvbuffer.kernels.specs import SPECS

from .template import Template, from_spec

TILES = "kvbuffer.tiles.fp8_quant"
TIMED_ROWS = 4096  # tokens a timed call quantizes (a 4k prompt)


def _key(shape, chunk, drafts):
    dims = GemvDims(shape["N"], shape["K"], shape["bn"], shape["bk"])
    return KernelKey("gemv", "fp8_quant", dims, shape["dtype"], w_dtype=FP8_DTYPE)


def _inputs(shape, batch, chunk_size, device, gen):
    import torch

    from kvbuffer.reference.fp8 import FP8, GROUP

    K, G = shape["K"], shape["K"] // GROUP
    x = torch.randn(TIMED_ROWS, G, GROUP, generator=gen, device=device)
    x *= 10 ** (6 * torch.rand(TIMED_ROWS, G, 1, generator=gen, device=device) - 3)
    q = torch.full((TIMED_ROWS, K), 0x7F, dtype=torch.uint8, device=device).view(FP8)
    scale = torch.full((G, TIMED_ROWS), float("nan"), device=device)
    return dict(x=x.view(TIMED_ROWS, K).to(getattr(torch, shape["dtype"])), q=q, scale=scale)


def _reference(shape, chunk_size, args):
    from kvbuffer.reference.fp8 import quantize_activations_padded

    q, scale = quantize_activations_padded(args["x"])
    return {"q": q, "scale": scale}


def fp8_quant_templates() -> list[Template]:
    if importlib.util.find_spec(TILES) is None:
        return []
    return [from_spec(SPECS[("gemv", "fp8_quant")], "fp8_quant_act", "fp8_quant", _key, _inputs, _reference,
                      uses_chunk=False, tolerance=0.0)]
