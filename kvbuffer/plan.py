"""Capacity planning: bytes per request and how many requests fit, for KVBuffer and for today's scheme.

The arithmetic is the engine's own: a CacheSpec is built for one request slot and its tensors'
bytes are summed (kvbuffer.runtime.caches.CacheSpec.tensor_shapes), so the planner and the
engine's admission cannot disagree. Counted per request: the attention KV cache for the context,
the linear layers' states, KVBuffer's buffers, conv histories and, for the recurrent scheme with
speculation, one extra state per fed draft token (what SGLang and vLLM keep to roll back).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from . import presets
from .defaults import DEFAULT_CHUNK_SIZE
from .pools import LinearLayerShape
from .runtime.caches import CacheSpec


@dataclass(frozen=True)
class ModelGeometry:
    """What memory planning needs to know about a model."""

    name: str
    weight_bytes: int
    linear_shape: LinearLayerShape
    num_linear_layers: int
    conv_dim: int
    conv_width: int
    num_attention_layers: int
    num_kv_heads: int
    head_dim: int


class _PresetGeometries(Mapping):
    """kvbuffer.presets' real models by name, each geometry derived on first use (see preset_geometry)."""

    def __init__(self):
        self._built: dict[str, ModelGeometry] = {}

    def __getitem__(self, name: str) -> ModelGeometry:
        if name not in self:
            raise KeyError(name)
        if name not in self._built:
            self._built[name] = preset_geometry(presets.get(name))
        return self._built[name]

    def __contains__(self, name) -> bool:
        return name in presets.MODELS

    def __iter__(self):
        return iter(presets.MODELS)

    def __len__(self) -> int:
        return len(presets.MODELS)


def preset_geometry(preset: presets.Preset) -> ModelGeometry:
    """A preset's geometry, read from its model built on the meta device (shapes only, no memory).

    The weights count as bf16 at the parameter count the model's name states (embeddings and MTP
    layers vary between counts); a preset without one counts its parameters.
    """
    from .models.loader import build_model

    with torch.device("meta"):
        model = build_model(preset.hf_config())
    params = preset.params_billions * 1e9 if preset.params_billions else sum(p.numel() for p in model.parameters())
    return replace(geometry_of(model), name=preset.name, weight_bytes=int(params * 2))


# Geometries of kvbuffer.presets' real models (the smoke-test presets are left out)
GEOMETRIES: Mapping[str, ModelGeometry] = _PresetGeometries()


def geometry_of(model) -> ModelGeometry:
    """Geometry of a loaded kvbuffer model (weights counted from its parameters)."""
    g = model.cache_geometry()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return ModelGeometry(type(model).__name__, weights, g["linear_shape"], g["num_linear_layers"], g["conv_dim"],
                         g["conv_width"], g["num_attention_layers"], g["num_kv_heads"], g["head_dim"])


def request_spec(geo: ModelGeometry, *, scheme: str, context: int, draft_tokens: int = 0,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, requests: int = 1, states: int | None = None) -> CacheSpec:
    """The CacheSpec for `requests` slots under `scheme` ("kvbuffer" or "recurrent"): the one function
    both the planner and kvbuffer.LLM build their caches' description with.

    context: tokens a request keeps (the fed draft tokens come on top); states: state slots (None:
    one per request, or none when every context fits its buffer).
    """
    if scheme not in ("kvbuffer", "recurrent"):
        raise ValueError(f"scheme must be 'kvbuffer' or 'recurrent', got {scheme!r}")
    if context < 1 or draft_tokens < 0 or chunk_size < 1:
        raise ValueError("context and chunk_size must be >= 1 and draft_tokens >= 0")
    buffered = scheme == "kvbuffer"
    # KVBuffer serves a context shorter than its buffer without any state
    needs_state = not buffered or context + draft_tokens >= chunk_size
    fed = draft_tokens + 1 if draft_tokens else 1
    return CacheSpec(
        linear_shape=geo.linear_shape, num_linear_layers=geo.num_linear_layers, conv_dim=geo.conv_dim,
        conv_width=geo.conv_width, num_attention_layers=geo.num_attention_layers, num_kv_heads=geo.num_kv_heads,
        head_dim=geo.head_dim, max_requests=requests,
        max_states=states if states is not None else requests if needs_state else 0,
        max_len=context + fed, chunk_size=chunk_size, max_drafts=fed, buffers=buffered,
        draft_states=not buffered and draft_tokens > 0,
    )


def check_fits(parts: Mapping[str, int], available: int, named: Mapping[str, str], where: str) -> int:
    """The total of `parts` (tensor name -> bytes), or a ValueError, to raise before anything is
    allocated, where they need more than `available` bytes: it names the arguments that size the
    largest tensor (named[tensor]) and gives the bytes needed and free on `where`."""
    total = sum(parts.values())
    if total > available:
        largest = max(parts, key=parts.get)
        raise ValueError(f"{named[largest]}: the caches would need {total:,} B ({largest} {parts[largest]:,} B), "
                         f"more than the {available:,} B free on {where}")
    return total


@dataclass(frozen=True)
class Plan:
    scheme: str
    bytes_per_request: int
    breakdown: dict
    free_bytes: int
    max_requests: int


def plan(geo: ModelGeometry, *, gpu_memory: int, context: int, draft_tokens: int = 0,
         chunk_size: int = DEFAULT_CHUNK_SIZE, reserve_fraction: float = 0.1, dtype=torch.bfloat16) -> dict[str, Plan]:
    """Both schemes' bytes per request and maximum concurrent requests in `gpu_memory` bytes.

    `reserve_fraction` of the memory is kept for activations, workspaces and the allocator.
    """
    free = int(gpu_memory * (1 - reserve_fraction)) - geo.weight_bytes
    if free <= 0:
        raise ValueError(f"{geo.name}: weights ({geo.weight_bytes / 2**30:.1f} GiB) do not fit in "
                         f"{gpu_memory * (1 - reserve_fraction) / 2**30:.1f} GiB")
    out = {}
    for scheme in ("kvbuffer", "recurrent"):
        spec = request_spec(geo, scheme=scheme, context=context, draft_tokens=draft_tokens, chunk_size=chunk_size)
        parts = spec.nbytes(dtype)
        per = sum(parts.values())
        out[scheme] = Plan(scheme, per, parts, free, free // per)
    if not any(p.max_requests for p in out.values()):
        fewest = min(p.bytes_per_request for p in out.values())
        raise ValueError(f"{geo.name}: not one request of context {context} fits: it needs "
                         f"{fewest / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free after the weights")
    return out


def format_plan(geo: ModelGeometry, plans: dict[str, Plan], *, context: int, draft_tokens: int) -> str:
    kb, rc = plans["kvbuffer"], plans["recurrent"]
    names = sorted(set(kb.breakdown) | set(rc.breakdown))
    mib = lambda b: f"{b / 2**20:10.2f}"  # noqa: E731
    lines = [f"{geo.name}: context {context}, {draft_tokens} draft token(s), weights {geo.weight_bytes / 2**30:.1f} GiB, "
             f"{kb.free_bytes / 2**30:.1f} GiB for requests",
             f"{'MiB per request':<22}{'kvbuffer':>10}{'recurrent':>11}"]
    for n in names:
        lines.append(f"  {n:<20}{mib(kb.breakdown.get(n, 0))} {mib(rc.breakdown.get(n, 0))}")
    lines.append(f"  {'total':<20}{mib(kb.bytes_per_request)} {mib(rc.bytes_per_request)}")
    ratio = f"{kb.max_requests / rc.max_requests:.2f}x" if rc.max_requests else "recurrent fits none"
    lines.append(f"max concurrent requests: kvbuffer {kb.max_requests}, recurrent {rc.max_requests} ({ratio})")
    return "\n".join(lines)
