"""What one model forward computes, and where each row's memory lives.

The engine builds a ForwardBatch; the model's layers read it to find their slots. Every request
owns one *request slot* (its buffer, conv history and attention KV cache all use that index) and,
once its context outgrows the buffer, a *state slot* for the linear layers' recurrent states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..defaults import MODES
from .backend import REFERENCE, Backend

PHASES = ("prefill", "decode", "verify")


@dataclass
class ForwardBatch:
    """B rows, each with T new tokens.

    phase:    "prefill" (T prompt tokens per row, every row at the same buffer fill), "decode"
              (T = 1) or "verify" (T drafts, nothing committed until the engine accepts some of them).
    mode:     "kvbuffer" (buffered linear layers) or "recurrent" (today's servers' scheme).
    positions (B, T) int64: absolute position of each new token.
    slots     (B,) int32: request slots (buffer, conv, KV cache); -1 marks a padding row (its state slot
              is -1 too).
    state_slots (B,) int32: recurrent-state slots; -1 = no state yet (short context).
    lengths   (B,) int32: buffer fill of each row before this forward (kvbuffer mode).
    cached    (B,) int32: tokens already in each row's attention KV cache.
    flush_at: the chunk size C at which a buffer is folded into its state.
    context_len: at least the longest row context after this forward (max of cached + T), known on
              the host so attention sizes its window without reading the device; None = compute it
              (a sync). CUDA graphs fix it to a bucket.
    host_slots, host_cached: a prompt's slots and cached as the host built them (None: not given, as in
              a CUDA graph), so its attention can slice each row's cache without reading them back.
    fuse:     the layers run their elementwise stretches as Inductor regions (kvbuffer.models.fused; the GDN
              prompt's front: kvbuffer.runtime.regions): set by the engine for a prompt chunk too long to
              graph, on CUDA with compile on.
    graphed:  the forward runs as its CUDA graph's bucket (captured, its warm-up, or a use before its
              capture): a prompt's attention takes the path a capture can record, so every run of a bucket
              computes the same.
    """

    phase: str
    mode: str
    positions: torch.Tensor
    slots: torch.Tensor
    state_slots: torch.Tensor
    lengths: torch.Tensor
    cached: torch.Tensor
    flush_at: int
    context_len: int | None = None
    common_fill: int = 0  # prefill: the rows' shared buffer fill, on the host (the chunk plan)
    host_slots: list[int] | None = None
    host_cached: list[int] | None = None
    backend: Backend = REFERENCE  # what the mixers call (kvbuffer.runtime.backend), resolved once by the LLM
    fuse: bool = False
    graphed: bool = False

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[1]
