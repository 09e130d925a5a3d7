"""FP8 projections: a model's Linear and PackedLinear as loaded from an FP8 checkpoint.

The weights stay float8_e4m3fn and the scales fp32 whatever the model is cast to (`model.to(bf16)`
moves them and keeps their dtypes); the bias follows the model's dtype. The forward is
kvbuffer.models.quant.fp8.fp8_linear; the engine sets an FP8Linear's `one_row` where the FP8 one-row
kernel loads (kvbuffer.engine.one_row), as it does a Linear's.
"""

from __future__ import annotations

import torch
from torch import nn

import torch.nn.functional as F

from .fp8 import dequantize, device_support, fp8_linear, gemm_path


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class FP8Linear(nn.Module):
    """y = x W^T + b with W = weight * weight_scale per `block` (kvbuffer.models.quant.fp8);
    `input_scale` (ModelOpt's static activation scale, () fp32) or None."""

    KEPT = ("weight", "weight_scale", "input_scale")  # dtypes no cast changes
    one_row = False

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                 input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        super().__init__()
        self.block = block
        self.out_features, self.in_features = weight.shape
        self.weight = _frozen(weight)
        self.weight_scale = _frozen(weight_scale.float())
        self.input_scale = None if input_scale is None else _frozen(input_scale.float().reshape(()))
        self.bias = None if bias is None else nn.Parameter(bias)
        self.support = device_support(weight.device)  # what the FP8 GEMMs of the weight's device serve

    def forward(self, x):
        return fp8_linear(x, self.weight, self.weight_scale, self.block, self.input_scale, self.bias, self.support,
                          self.one_row)

    def dequantized(self, dtype) -> torch.Tensor:
        """The weight the dequantized model has, in `dtype`."""
        return dequantize(self.weight, self.weight_scale, self.block, dtype)

    def path(self, x: torch.Tensor) -> str:
        """How a forward of x runs (kvbuffer.models.quant.fp8.gemm_path)."""
        return gemm_path(x, self.weight, self.block, self.input_scale, self.support, self.one_row)

    def _apply(self, fn, recurse=True):
        """nn.Module._apply (to, cuda, half, ...) with the FP8 weight and the fp32 scales only moved."""
        kept = {n: self._parameters.pop(n) for n in self.KEPT if self._parameters.get(n) is not None}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, p in kept.items():
                device = fn(p.detach().new_empty(0)).device  # where `fn` sends tensors, learnt on an empty one
                self._parameters[name] = p if p.device == device else _frozen(p.detach().to(device))
        self.support = device_support(self.weight.device)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


class FP8PackedLinear(nn.Module):
    """PackedLinear's contract (the parts' outputs, as views, in part order) over groups of parts: an
    FP8Linear per group of FP8 parts whose scales concatenate, and one Linear for the parts the
    checkpoint keeps unquantized (Qwen3.5's in_proj_b / in_proj_a next to in_proj_qkv / in_proj_z).
    `layout[i]` = (group, offset in its output) of part i. Where every FP8 group dequantizes (the
    reference path), the parts' weights are dequantized and packed back into one GEMM: the dequantized
    model's product, bit for bit."""

    def __init__(self, in_features: int, parts: dict[str, int], groups: list[nn.Module],
                 layout: list[tuple[int, int]]):
        super().__init__()
        self.in_features = in_features
        self.parts, self.sizes = tuple(parts), tuple(parts.values())
        self.groups = nn.ModuleList(groups)
        self.layout = tuple(layout)

    def forward(self, x) -> tuple[torch.Tensor, ...]:
        if all(g.path(x) == "dequantize" for g in self.groups if isinstance(g, FP8Linear)):
            weights = [g.dequantized(x.dtype) if isinstance(g, FP8Linear) else g.weight.to(x.dtype)
                       for g in self.groups]
            w = torch.cat(self._in_part_order(weights))
            b = None if self.groups[0].bias is None else torch.cat(self._in_part_order([g.bias for g in self.groups]))
            return torch.split(F.linear(x, w, b), self.sizes, dim=-1)
        outs = [g(x) for g in self.groups]
        return tuple(outs[g].narrow(-1, off, size) for (g, off), size in zip(self.layout, self.sizes))

    def _in_part_order(self, per_group: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each part's rows of its group's tensor (weight or bias), in part order."""
        return [per_group[g].narrow(0, off, size) for (g, off), size in zip(self.layout, self.sizes)]
