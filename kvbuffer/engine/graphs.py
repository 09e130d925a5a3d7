"""Decode-step inputs in one transfer, and CUDA graphs of the decode forward.

A decode step of a 32-layer model launches about a thousand small kernels. Run eagerly, the host
needs longer to launch them than the GPU needs to run them until the batch is large, so the engine
captures the forward once per (batch bucket, context bucket) and replays it: one launch per step.

What makes the forward capturable: the per-row integers arrive in one device tensor (`StepInputs`),
the attention window is a host-known bucket (ForwardBatch.context_len), padding rows carry slot -1
(the kernels skip them; kvbuffer.rows.put_rows makes the torch scatters ignore them), and the
kernel launches skip their data-dependent checks (the engine built the slots and lengths itself,
and a capture forbids reading the device back). Logits of one replay are valid until the next replay.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("kvbuffer")

FIELDS = ("ids", "positions", "slots", "state_slots", "lengths", "cached")
_PADDING = (0, 0, -1, -1, 0, 0)  # a padding row: slot -1 everywhere, nothing read or written


def row_bucket(n: int, limit: int) -> int:
    """Rows a graph is captured for: 1, 2, 4, 8, then multiples of 8, 32 and 64 as n grows."""
    if n <= 8:
        b = 1 << (n - 1).bit_length()
    else:
        step = 8 if n <= 64 else 32 if n <= 256 else 64
        b = -(-n // step) * step
    return min(b, limit)


def context_bucket(n: int, limit: int) -> int:
    """Attention window a graph is captured for: a multiple of 256 positions, at most max_len."""
    return min(-(-n // 256) * 256, limit)


class StepInputs:
    """The FIELDS of every row of one forward, staged on the host and copied to the device at once."""

    def __init__(self, max_rows: int, device: torch.device):
        pin = device.type == "cuda"
        self.max_rows = max_rows
        self.host = torch.zeros(len(FIELDS), max_rows, dtype=torch.long, pin_memory=pin)
        self.device = torch.zeros(len(FIELDS), max_rows, dtype=torch.long, device=device)
        self._copied = torch.cuda.Event() if pin else None

    def upload(self, columns: list[list[int]], rows: int) -> torch.Tensor:
        """columns: one list per field, n <= rows entries each; rows - n padding rows follow.
        Returns the device view (len(FIELDS), rows); stable across calls with the same `rows`."""
        n = len(columns[0])
        if not n <= rows <= self.max_rows:
            raise ValueError(f"{n} rows padded to {rows} do not fit {self.max_rows}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the staging buffer
        self.host[:, :n] = torch.tensor(columns, dtype=torch.long)
        for f, pad in enumerate(_PADDING):
            self.host[f, n:rows] = pad
        self.device[:, :rows].copy_(self.host[:, :rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return self.device[:, :rows]


class DecodeGraphs:
    """Captured decode forwards keyed by (rows, context) buckets; `forward(inputs, context_len)`
    must be the eager forward on StepInputs' device view, returning logits (rows, vocab).

    capture=False runs the same padded, bucketed forward eagerly: what a replay computes, checkable
    on a machine without CUDA.
    """

    def __init__(self, forward, inputs: StepInputs, max_len: int, capture: bool = True):
        self.forward, self.inputs, self.max_len, self.capture = forward, inputs, max_len, capture
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.enabled = True

    def run(self, columns: list[list[int]], context_len: int) -> torch.Tensor:
        n = len(columns[0])
        key = (row_bucket(n, self.inputs.max_rows), context_bucket(context_len, self.max_len))
        view = self.inputs.upload(columns, key[0])
        if not self.capture:
            return self.forward(view, key[1])[:n]
        if key not in self.graphs:
            self.graphs[key] = self._capture(view, key[1])
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:n]

    def _capture(self, view: torch.Tensor, context_len: int):
        """Warm up on a side stream (lazy initialisation must not land in the graph), then capture.
        The warm-up runs for real, so it sees padding rows only, which read and write nothing; the
        step's own inputs are put back for the replay that follows."""
        saved = view.clone()
        for f, pad in enumerate(_PADDING):
            view[f].fill_(pad)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(view, context_len)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.forward(view, context_len)
        view.copy_(saved)
        log.info("kvbuffer: captured a decode graph for %d rows, context %d", view.shape[1], context_len)
        return graph, logits
