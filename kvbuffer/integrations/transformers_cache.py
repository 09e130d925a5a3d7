"""A transformers cache's linear-attention states, read one way across the supported releases.

The buffered forwards need three things of a cache layer: its conv state and its recurrent state
(None until the layer's first forward filled them) and whether it records past states (kept for a
speculative rollback, which the buffered decode step does not serve). Releases expose them two ways:

- accessor methods (5.24): `Cache.get_conv_state(i, state_idx)`, `Cache.get_recurrent_state`,
  `Cache.is_recording_past`;
- layer attributes (5.17): `Cache.has_previous_state(i, state_idx)` and the cache layer's public
  `conv_states[state_idx]`, `recurrent_states[state_idx]` and `record_past`.

5.25 also counts each linear layer's tokens (`Cache.increase_count`; a layer's
`cumulative_length_linear`), and that count is the cache's sequence length: the buffered conv step
counts its token as the stock one does (transformers_layers._conv_step), and
kvbuffer.engine.hf_interop sets it for a prefix it exports.

`access_for(cache)` picks the first family the cache object has (feature detection, no version
string), so a release that keeps either spelling works unchanged. The layer's own forward takes the
cache as `cache=` in 5.24 and `cache_params=` in 5.17; `cache_keyword` reads which from its signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheAccess:
    """How to read one cache layer's linear-attention states (state index 0, the only one these
    models use); `methods` are what a cache object must have for this family to apply."""

    name: str
    methods: tuple[str, ...]
    conv_state: Callable[[object, int], torch.Tensor | None]
    recurrent_state: Callable[[object, int], torch.Tensor | None]
    is_recording_past: Callable[[object, int], bool]

    def fits(self, cache) -> bool:
        return all(callable(getattr(cache, name, None)) for name in self.methods)


def _layer_state(kind: str) -> Callable[[object, int], torch.Tensor | None]:
    """The layer's `conv_states` / `recurrent_states` entry once it has a state, else None (as the
    accessor methods answer: a reset cache keeps zeroed tensors but has no previous state)."""
    def read(cache, idx: int) -> torch.Tensor | None:
        if not cache.has_previous_state(idx, state_idx=0):
            return None
        return getattr(cache.layers[idx], kind)[0]
    return read


ACCESSOR_METHODS = CacheAccess(
    "accessor methods", ("get_conv_state", "get_recurrent_state", "is_recording_past"),
    conv_state=lambda cache, idx: cache.get_conv_state(idx, state_idx=0),
    recurrent_state=lambda cache, idx: cache.get_recurrent_state(idx, state_idx=0),
    is_recording_past=lambda cache, idx: cache.is_recording_past(idx))

LAYER_ATTRIBUTES = CacheAccess(
    "layer attributes", ("has_previous_state",),
    conv_state=_layer_state("conv_states"),
    recurrent_state=_layer_state("recurrent_states"),
    is_recording_past=lambda cache, idx: bool(getattr(cache.layers[idx], "record_past", False)))

ACCESSES = (ACCESSOR_METHODS, LAYER_ATTRIBUTES)  # preferred first


def access_for(cache) -> CacheAccess:
    """The first access family `cache` (a transformers Cache, or its class) supports; ImportError
    naming what is missing and the installed version otherwise."""
    for access in ACCESSES:
        if access.fits(cache):
            return access
    import transformers

    owner = cache if isinstance(cache, type) else type(cache)
    wanted = " or ".join(f"({', '.join(a.methods)})" for a in ACCESSES)
    raise ImportError(f"kvbuffer.integrations.transformers needs a transformers cache with linear-attention "
                      f"states, but {owner.__name__} has neither {wanted} (tested with transformers 5.17 "
                      f"and 5.24); transformers {transformers.__version__} is installed")


def cache_keyword(layer_class: type) -> str:
    """The name under which `layer_class.forward` takes the cache: `cache` (5.24) or `cache_params` (5.17)."""
    params = inspect.signature(layer_class.forward).parameters
    return "cache" if "cache" in params else "cache_params"
