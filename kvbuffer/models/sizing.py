"""A model's size, planned on the meta device before it is built: a config.json whose sizes
describe more parameters than the device holds is refused before anything is allocated."""

from __future__ import annotations

import os

import torch

from ..errors import CheckpointError


def check_fits(model_cls, config) -> None:
    """Refuse a model whose parameters alone exceed the memory of the device it would be built on
    (counted on the meta device; not checked when building on meta or on an unknown device)."""
    device = torch.get_default_device()
    capacity = _memory_of(device)
    if capacity is None:
        return
    with torch.device("meta"):
        sized = model_cls(config)
    params = list(sized.named_parameters())
    need = sum(p.numel() for _, p in params) * torch.empty((), dtype=torch.get_default_dtype()).element_size()
    if need > capacity:
        name, largest = max(params, key=lambda item: item[1].numel())
        raise CheckpointError(f"config.json describes a model of {need / 2**30:.1f} GiB of parameters, more than "
                              f"the {capacity / 2**30:.1f} GiB of {device}'s memory (its largest tensor: {name}, "
                              f"{tuple(largest.shape)}): check its sizes (hidden_size, vocab_size, ...)")


def _memory_of(device: torch.device) -> int | None:
    """Bytes of memory of `device`: the machine's RAM for the CPU, the card's for CUDA."""
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return None
