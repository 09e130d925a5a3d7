"""Step inputs in one transfer, and CUDA graphs of the decode, verify and prefill forwards.

A decode step of a 32-layer model launches about a thousand small kernels. Run eagerly, the host
needs longer to launch them than the GPU needs to run them until the batch is large, so the engine
captures each forward once per bucket and replays it: one launch per step. A speculative verify
(the last token plus T drafts per row) and a short prefill chunk are the same kind of forward with
T tokens per row, so they are captured the same way, keyed by their token count too.

What makes a forward capturable: the per-row integers arrive in one device tensor (`StepInputs`),
the attention window is a host-known bucket (ForwardBatch.context_len), padding rows carry slot -1
(the kernels skip them; kvbuffer.rows.put_rows makes the torch scatters ignore them), and the
kernel launches skip their data-dependent checks (the engine built the slots and lengths itself,
and a capture forbids reading the device back). Outputs of one replay are valid until the next replay.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Sequence

import torch

log = logging.getLogger("kvbuffer")

ROW_FIELDS = ("positions", "slots", "state_slots", "lengths", "cached")  # one integer per row each
_ROW_PADDING = (0, -1, -1, 0, 0)  # a padding row: slot -1, reads nothing, writes nothing a row reads
FIELDS = ("ids",) + ROW_FIELDS  # the decode step's columns (one token per row)
CONTEXT_BUCKET = 256  # attention windows are captured in multiples of this many positions
# a forward is captured on its third use at the same bucket: a capture costs about two forwards (the
# warm-up and the capture), which only a shape seen again repays (a one-off prompt chunk never is)
CAPTURE_AFTER = 2
PREFILL_GRAPH_TOKENS = 256  # prefill chunks of more tokens run eagerly: their launches are not what they wait on


@contextlib.contextmanager
def collection_paused():
    """Python's cycle collector off for the duration of a CUDA graph capture. Objects freed by the
    collector mid-capture include other engines' graphs, whose destruction is an operation a
    capturing stream forbids: it invalidates the capture (or aborts the process). torch no longer
    collects before a capture, so an engine dropped before a new one is made (a test, a server that
    reloads its model) otherwise breaks the new engine's captures."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def row_bucket(n: int, limit: int) -> int:
    """Rows a graph is captured for: 1, 2, 4, 8, then multiples of 8, 32 and 64 as n grows."""
    if n <= 8:
        b = 1 << (n - 1).bit_length()
    else:
        step = 8 if n <= 64 else 32 if n <= 256 else 64
        b = -(-n // step) * step
    return min(b, limit)


def context_bucket(n: int, limit: int) -> int:
    """Attention window a graph is captured for: a multiple of CONTEXT_BUCKET positions, at most max_len."""
    return min(-(-n // CONTEXT_BUCKET) * CONTEXT_BUCKET, limit)


def step_columns(ids: list[list[int]], positions, slots, state_slots, lengths, cached) -> list[Sequence[int]]:
    """The columns StepInputs uploads for rows of T tokens each: T id columns (token t of every row, a
    tuple), then one column per ROW_FIELDS (positions: each row's first new position)."""
    return [*zip(*ids), list(positions), list(slots), list(state_slots), list(lengths), list(cached)]


def split_view(view: torch.Tensor, tokens: int):
    """StepInputs' device view -> (ids (B, T), positions (B, T), slots, state_slots, lengths, cached (B,))."""
    ids = view[:tokens].t()
    first, slots, state_slots, lengths, cached = view[tokens:]
    positions = first[:, None] + torch.arange(tokens, device=view.device)[None, :]
    return ids, positions, slots, state_slots, lengths, cached


class StepInputs:
    """The columns of every row of one forward of `tokens` tokens per row, staged on the host and
    copied to the device at once.

    A decode step's inputs (tokens = 1) can also take a row's token from the previous step's
    pick while it is still on the device (`hold`, then `upload(feed=...)`): the engine launches step
    n + 1 before it reads step n's tokens back (kvbuffer.engine.overlap).
    """

    def __init__(self, max_rows: int, device: torch.device, tokens: int = 1):
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        pin = device.type == "cuda"
        self.max_rows, self.tokens = max_rows, tokens
        self.padding = (0,) * tokens + _ROW_PADDING
        self.padding_column = torch.tensor(self.padding, dtype=torch.long)[:, None]  # a padding row's column
        fields = len(self.padding) + 1  # the last row: where a decode row's token comes from (feed)
        self.host = torch.zeros(fields, max_rows, dtype=torch.long, pin_memory=pin)
        self.device = torch.zeros(fields, max_rows, dtype=torch.long, device=device)
        self._copied = torch.cuda.Event() if pin else None
        decode = tokens == 1  # only a decode step's inputs take picks
        self.picked = torch.zeros(max_rows if decode else 0, dtype=torch.long, device=device)  # the last picks
        self._picked_host = [torch.zeros(max_rows if decode else 0, dtype=torch.long, pin_memory=pin)
                             for _ in range(2)]
        self._picks, self._picked_rows = 0, 0

    def upload(self, columns: list[list[int]], rows: int, feed: list[int] | None = None) -> torch.Tensor:
        """columns: step_columns' lists, n <= rows entries each; rows - n padding rows follow.
        feed (decode only): per row, the index of the pick of the last `hold` that is its token
        (its id column then only holds a placeholder), or -1 for the id in `columns`.
        Returns the device view (tokens + len(ROW_FIELDS), rows); stable across calls with the same `rows`."""
        n = len(columns[0])
        if len(columns) != len(self.padding):
            raise ValueError(f"columns: expected {len(self.padding)} lists ({self.tokens} token(s) per row), "
                             f"got {len(columns)}")
        if not n <= rows <= self.max_rows:
            raise ValueError(f"{n} rows padded to {rows} do not fit {self.max_rows}")
        if feed is not None and (self.tokens != 1 or len(feed) != n):
            raise ValueError(f"feed: one index per row of a one-token forward, got {len(feed)} for {n} rows "
                             f"of {self.tokens} token(s)")
        if feed is not None and max(feed, default=-1) >= self._picked_rows:
            raise ValueError(f"feed: index {max(feed)} past the last hold's {self._picked_rows} rows")
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the staging buffer
        self.host[:-1, :n] = torch.tensor(columns, dtype=torch.long)
        if rows > n:
            self.host[:-1, n:rows] = self.padding_column  # one copy, not one per token: a prompt has thousands
        if feed is not None:
            self.host[-1, :n] = torch.tensor(feed, dtype=torch.long)
            self.host[-1, n:rows] = -1
        copied = len(self.padding) + (feed is not None)
        self.device[:copied, :rows].copy_(self.host[:copied, :rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        view = self.device[:-1, :rows]
        if feed is not None:
            source = self.device[-1, :rows]
            view[0].copy_(torch.where(source >= 0, self.picked[source.clamp(min=0)], view[0]))
        return view

    def hold(self, picks: torch.Tensor) -> "PendingTokens":
        """A decode step's picks (n,) on the device (sampling.pick_rows) into `picked`, for the next
        upload's feed, and on their way to the host; nothing waits for them here."""
        n = picks.shape[0]
        if self.tokens != 1:
            raise ValueError(f"hold serves one-token (decode) forwards, not {self.tokens}-token ones")
        torch.clamp(picks, min=0, out=self.picked[:n])  # a row that could not be sampled (-1) feeds a valid id
        self._picked_rows = n
        host = self._picked_host[self._picks % 2][:n]  # two: the host may still read the last one
        self._picks += 1
        host.copy_(picks, non_blocking=True)  # unclamped: the host finishes a -1 row with an error
        done = None
        if self._copied is not None:
            done = torch.cuda.Event()
            done.record()
        return PendingTokens(host, done)


class PendingTokens:
    """Greedy picks on their way to the host; tolist() waits for them (and only for them)."""

    def __init__(self, host: torch.Tensor, done):
        self.host, self.done = host, done

    def tolist(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def _rows(out, n: int):
    return tuple(o[:n] for o in out) if isinstance(out, tuple) else out[:n]


class CaptureFailed(RuntimeError):
    """A forward's CUDA-graph capture (or its warm-up, on padding rows) failed: nothing a row reads was
    written, so the forward may run again another way. Its cause is the capture's own error."""


def worth_capturing(uses: int, capture_after: int = CAPTURE_AFTER) -> bool:
    """Whether a bucket run uncaptured `uses` times is captured now: once it has been used
    capture_after times (CAPTURE_AFTER: a capture costs about two forwards, repaid only by a bucket
    that comes back), so that a short run captures only the steps it repeats."""
    return uses >= capture_after


class StepGraphs:
    """Captured forwards keyed by (rows bucket, context bucket, *extra) for one token count;
    `forward(view, context_len, *extra)` must be the eager forward on StepInputs' device view,
    returning the rows' outputs (a tensor or a tuple of tensors, rows first). `extra`: host values
    the forward depends on beyond the inputs (a prefill's buffer fill, whether hidden states are wanted).

    capture=False runs the same padded, bucketed forward eagerly: what a replay computes, checkable
    on a machine without CUDA. With capture, a bucket's first `capture_after` forwards run so too,
    and its next one is captured (worth_capturing); capture_after=0 captures at first use. A failed
    capture raises CaptureFailed, and `enabled` is turned False by the caller, which then runs eagerly;
    an uncaptured forward's own errors are raised as they are (it may have written rows).
    """

    def __init__(self, forward, inputs: StepInputs, max_len: int, capture: bool = True, pool=None,
                 capture_after: int = CAPTURE_AFTER):
        self.forward, self.inputs, self.max_len, self.capture = forward, inputs, max_len, capture
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.pool = pool if pool is not None or not capture else torch.cuda.graph_pool_handle()
        self.enabled = True
        self.capture_after = capture_after
        self.uses: dict[tuple, int] = {}  # bucket key -> forwards run uncaptured so far

    def run(self, columns: list[list[int]], context_len: int, *extra, feed: list[int] | None = None,
            now: bool = False):
        """feed: StepInputs.upload's (a decode row's token from the last greedy pick). now: capture
        this bucket at once if it is not yet (a warm-up)."""
        n = len(columns[0])
        rows, window = row_bucket(n, self.inputs.max_rows), context_bucket(context_len, self.max_len)
        view = self.inputs.upload(columns, rows, feed)
        key = (rows, window, *extra)
        if key not in self.graphs and not (self.capture and (now or worth_capturing(self.uses.get(key, 0),
                                                                                     self.capture_after))):
            self.uses[key] = self.uses.get(key, 0) + 1
            return _rows(self.forward(view, window, *extra), n)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(view, window, extra)
            except RuntimeError as e:
                raise CaptureFailed(str(e)) from e
        graph, out = self.graphs[key]
        graph.replay()
        return _rows(out, n)

    def _capture(self, view: torch.Tensor, context_len: int, extra: tuple):
        """Warm up on a side stream (lazy initialisation must not land in the graph), then capture.
        The warm-up runs for real, so it sees padding rows only, which read nothing and write only
        where no row reads (the KV cache's sink); the step's own inputs are put back for the replay
        that follows."""
        saved = view.clone()
        view.copy_(self.inputs.padding_column.to(view.device).expand_as(view))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(view, context_len, *extra)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with collection_paused(), torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(view, context_len, *extra)
        view.copy_(saved)
        log.info("kvbuffer: captured a graph for %d rows x %d tokens, context %d %s", view.shape[1],
                 self.inputs.tokens, context_len, extra)
        return graph, out
