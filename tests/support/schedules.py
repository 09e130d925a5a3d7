"""Random serving schedules, replayed by a buffered executor and by the recurrent baseline.

A schedule is a list of actions drawn from one seed before anything runs, so the buffered and
the recurrent executors (and fp32 / fp64 runs) see exactly the same requests and tokens:

    ("decode", ids, tokens)             one token for each id; None marks a padding row
    ("verify", ids, tokens, accepted)   T drafts per row, then accept m <= T of them
    ("prefill", id, tokens)             a prompt chunk for one request
    ("flush", ids)                      an early flush (a hint; the recurrent executor ignores it)
    ("finish", id) / ("start", id)      request churn: slots are freed and reused
"""

from __future__ import annotations

import random

import torch

from kvbuffer.pools import BufferPool, StatePool

CHUNKS = (1, 2, 3, 5, 6, 7, 12)  # 1, odd sizes and non-powers of two
MAX_DRAFTS = 8


def make_schedule(fam, seed: int, steps: int, requests: int = 5, max_prompt: int = 20):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    live = list(range(requests))
    next_id = requests
    chunks = {i: rng.choice(CHUNKS) for i in live}
    actions = [("start", i) for i in live]
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.02 and len(live) > 1:
            old = rng.choice(live)
            live.remove(old)
            actions.append(("finish", old))
            live.append(next_id)
            chunks[next_id] = rng.choice(CHUNKS)
            actions.append(("start", next_id))
            next_id += 1
            continue
        if roll < 0.07:
            rid = rng.choice(live)
            actions.append(("prefill", rid, fam.tokens(gen, rng.randint(1, max_prompt))))
            continue
        if roll < 0.10:
            actions.append(("flush", rng.sample(live, rng.randint(1, len(live)))))
            continue
        ids = rng.sample(live, rng.randint(1, len(live)))
        ids += [None] * rng.randint(0, 2)
        rng.shuffle(ids)
        if roll < 0.45:
            T = rng.randint(1, MAX_DRAFTS)
            accepted = [rng.randint(0, T) for _ in ids]
            actions.append(("verify", ids, fam.tokens(gen, len(ids), T), accepted))
        else:
            actions.append(("decode", ids, fam.tokens(gen, len(ids))))
    return actions, chunks


def _slots(mapping, ids, dev):
    return torch.tensor([mapping.get(i, -1) if i is not None else -1 for i in ids], dtype=torch.int32, device=dev)


class RecurrentExecutor:
    """Today's servers: one state per request, read and written every token."""

    def __init__(self, fam, capacity: int, dtype):
        self.fam, self.dtype = fam, dtype
        self.pool = StatePool(fam.shape, 1, capacity, dtype=dtype)
        self.slot: dict[int, int] = {}

    def run(self, actions):
        outs = []
        for act in actions:
            kind = act[0]
            if kind == "start":
                self.slot[act[1]] = self.pool.allocate()
            elif kind == "finish":
                self.pool.free(self.slot.pop(act[1]))
            elif kind == "decode":
                outs.append(self._step(act[1], act[2]))
            elif kind == "prefill":
                tok = act[2]
                steps = [self._step([act[1]], self.fam.slice_tokens(tok, slice(t, t + 1)))[0]
                         for t in range(tok[next(iter(tok))].shape[0])]
                outs.append(torch.stack(steps))
            elif kind == "verify":
                outs.append(self._verify(act[1], act[2], act[3]))
        return outs

    def _step(self, ids, tok):
        slots = _slots(self.slot, ids, "cpu")
        return self.fam.ops.recurrent_step(*self.fam.args(tok, self.dtype), self.pool.layer(0), slots)

    def _verify(self, ids, tok, accepted):
        """Servers keep a state per draft; here: run all T on a copy, then replay the accepted ones."""
        T = tok[next(iter(tok))].shape[1]
        saved = self.pool.state.clone()
        outs = [self._step(ids, self.fam.slice_tokens(tok, (slice(None), t))) for t in range(T)]
        self.pool.state.copy_(saved)
        for t in range(T):
            keep = [i if (i is not None and m > t) else None for i, m in zip(ids, accepted)]
            self._step(keep, self.fam.slice_tokens(tok, (slice(None), t)))
        return torch.stack(outs, 1)


class BufferedExecutor:
    """KVBuffer: states allocated only when a buffer first fills; flushes every chunk or on hints."""

    def __init__(self, fam, capacity: int, chunks: dict, dtype, buffer_dtype=None):
        self.fam, self.dtype, self.chunks = fam, dtype, chunks
        self.entries = max(chunks.values()) + MAX_DRAFTS
        self.states = StatePool(fam.shape, 1, capacity, dtype=dtype)
        self.buffers = BufferPool(fam.shape, 1, capacity, self.entries, dtype=buffer_dtype or dtype,
                                  log_decay_dtype=dtype)
        self.sslot: dict[int, int] = {}
        self.bslot: dict[int, int] = {}
        self.max_states_used = 0

    # -- bookkeeping ---------------------------------------------------------------------------
    def _ensure_state(self, rid):
        if rid not in self.sslot:
            self.sslot[rid] = self.states.allocate()
            self.max_states_used = max(self.max_states_used, len(self.sslot))

    def _flush(self, ids):
        ids = [i for i in ids if self.buffers.length(self.bslot[i]) > 0]
        if not ids:
            return
        for i in ids:
            self._ensure_state(i)
        self.fam.ops.flush(self.states.layer(0), _slots(self.sslot, ids, "cpu"), *self.buffers.layer(0).tensors(),
                           _slots(self.bslot, ids, "cpu"), self.buffers.batch_lengths([self.bslot[i] for i in ids]))
        for i in ids:
            self.buffers.reset(self.bslot[i])

    def _flush_full(self, ids):
        self._flush([i for i in ids if i is not None and self.buffers.length(self.bslot[i]) >= self.chunks[i]])

    def _batch(self, ids):
        b = [self.bslot[i] if i is not None else -1 for i in ids]
        return (self.states.layer(0), _slots(self.sslot, ids, "cpu"), *self.buffers.layer(0).tensors(),
                _slots(self.bslot, ids, "cpu"), self.buffers.batch_lengths(b))

    # -- actions -------------------------------------------------------------------------------
    def run(self, actions):
        outs = []
        for act in actions:
            kind = act[0]
            if kind == "start":
                self.bslot[act[1]] = self.buffers.allocate()
            elif kind == "finish":
                self.buffers.free(self.bslot.pop(act[1]))
                if act[1] in self.sslot:
                    self.states.free(self.sslot.pop(act[1]))
            elif kind == "flush":
                self._flush(act[1])
            elif kind == "decode":
                ids, tok = act[1], act[2]
                outs.append(self.fam.ops.buffered_step(*self.fam.args(tok, self.dtype), *self._batch(ids)))
                for i in ids:
                    if i is not None:
                        self.buffers.accept(self.bslot[i], 1)
                self._flush_full(ids)
            elif kind == "verify":
                ids, tok, accepted = act[1], act[2], act[3]
                outs.append(self.fam.ops.verify(*self.fam.args(tok, self.dtype), *self._batch(ids)))
                for i, m in zip(ids, accepted):
                    if i is not None:
                        self.buffers.accept(self.bslot[i], m)
                self._flush_full(ids)
            elif kind == "prefill":
                outs.append(self._prefill(act[1], act[2]))
        return outs

    def _prefill(self, rid, tok):
        bslot = self.bslot[rid]
        n, T, C = self.buffers.length(bslot), tok[next(iter(tok))].shape[0], self.chunks[rid]
        if n + T >= C:
            self._ensure_state(rid)
        o, new_len = self.fam.ops.prefill(*self.fam.args(tok, self.dtype), self.states.layer(0),
                                          self.sslot.get(rid, -1), *self.buffers.layer(0).tensors(), bslot, n, C)
        self.buffers.reset(bslot)
        self.buffers.accept(bslot, new_len)
        return o
