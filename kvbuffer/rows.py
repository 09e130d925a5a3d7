"""Padding-aware row writes shared by the conv histories (kvbuffer.reference.conv) and the attention
KV cache (kvbuffer.runtime.mixing): a batch's padding rows (slot -1) must write nothing, and a
CUDA-graph capture forbids the host sync that boolean indexing would need.
"""

from __future__ import annotations

import torch


def put_rows(dst: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor, real: torch.Tensor) -> None:
    """dst[index] = values for the real rows of a batch, with no host sync (CUDA-graph safe).

    index: tensors shaped like values' leading dims, row b first; values (B, ...); real (B,) bool.
    Boolean indexing would sync; instead padding rows repeat the first real row's write with its
    values (or, when every row is padding, rewrite what is already there), so duplicate indices
    store equal bytes and no write races.
    """
    values = values.to(dst.dtype)
    # the first real row (row 0 if none), 1-D: indexing with a 0-d tensor would read it back
    first = torch.argmax(real.to(torch.int32)).view(1)
    index = tuple(torch.where(real.view((-1,) + (1,) * (i.dim() - 1)), i, i[first]) for i in index)
    lead = (-1,) + (1,) * (values.dim() - 1)
    head = torch.where(real[first].view(lead), values[first], dst[tuple(i[first] for i in index)])
    dst[index] = torch.where(real.view(lead), values, head)
