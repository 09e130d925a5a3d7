"""The contract of `torch.ops.kvbuffer.*` as a server uses it, checked against the plain recurrence.

A toy server keeps one layer's pools for a fixed number of slots and drives the ops the way vLLM or
SGLang would (docs/integrations.md): requests join (a prompt prefilled in chunks with the fused
flush) and leave between steps; each request has its own state slot and buffer slot (different
numbers, batch rows shuffled every step, padding rows with slot -1); decode steps fold at C;
speculative verifies of D drafts + 1 token keep a per-request accepted count, and a row whose fill
reaches C after accepting is flushed. Every output row is compared with `kvbuffer.reference`'s plain
recurrent step run per request on an fp64 state, and slots outside the batch must stay bit-exact.
On CUDA the same runs on the compiled kernels (JIT allowed), and one decode step is captured in a
CUDA graph and replayed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from kvbuffer import ops as kvb_ops  # registers torch.ops.kvbuffer.*
from kvbuffer.reference import gdn, mamba2

OPS = torch.ops.kvbuffer
C, DRAFTS = 8, 3
CAP = C + DRAFTS + 1  # the layout `kvbuffer tune --chunk-sizes C --draft-tokens DRAFTS` builds
SLOTS = 7
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# (Hk, Hv, K, V): odd heads and dk != dv on CPU; the kernels' head dims are multiples of 16
SHAPES = {"cpu": (1, 3, 12, 20), "cuda": (2, 4, 32, 32)}
TOL = {torch.float32: 2e-4, torch.bfloat16: 4e-2}  # relative to the output's scale


@dataclass
class Family:
    """One mixer kind: its op names, random per-token inputs and the per-request oracle step."""

    name: str
    Hk: int
    Hv: int
    K: int
    V: int
    dtype: torch.dtype
    device: str
    params: list = field(default_factory=list)  # the layer's fp32 parameters (A_log, dt_bias[, D])

    def __post_init__(self):
        g = torch.Generator().manual_seed(11)
        hv = self.Hv
        self.params = [torch.log(1 + 8 * torch.rand(hv, generator=g)), torch.randn(hv, generator=g)]
        if self.name == "mamba2":
            self.params.append(torch.randn(hv, generator=g))
        self.params = [p.to(self.device) for p in self.params]

    def tokens(self, lead: tuple, gen: torch.Generator) -> list[torch.Tensor]:
        r = lambda *s: torch.randn(*lead, *s, generator=gen).to(self.device, self.dtype)  # noqa: E731
        if self.name == "gdn":  # q, k, v, a, b
            return [r(self.Hk, self.K), r(self.Hk, self.K), r(self.Hv, self.V), r(self.Hv), r(self.Hv)]
        return [r(self.Hv, self.V), r(self.Hv), r(self.Hk, self.K), r(self.Hk, self.K)]  # x, dt, B, C

    def args(self, tokens: list[torch.Tensor], params: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The op's (and the reference's) leading arguments in schema order."""
        params = self.params if params is None else params
        if self.name == "gdn":
            return [*tokens, *params]
        x, dt, Bm, Cm = tokens
        A_log, dt_bias, D = params
        return [x, dt, A_log, dt_bias, Bm, Cm, D]

    def op(self, kind: str):
        return getattr(OPS, f"{self.name}_{kind}")

    def oracle_step(self, tokens: list[torch.Tensor], state64: torch.Tensor) -> torch.Tensor:
        """The plain recurrent step of one request (token tensors without batch axis) on an fp64 state."""
        one = torch.zeros(1, dtype=torch.int32, device=state64.device)
        batch = [t[None].double() for t in tokens]
        params = [p.double() for p in self.params]
        ref = gdn if self.name == "gdn" else mamba2
        return ref.recurrent_step(*self.args(batch, params), state64, one)[0]


@dataclass
class Request:
    state_slot: int
    buffer_slot: int
    oracle: torch.Tensor  # (1, Hv, K, V) fp64
    fill: int = 0


class Server:
    """One layer's pools and the bookkeeping a server does around the ops."""

    def __init__(self, fam: Family, seed: int):
        dev, f = fam.device, fam
        self.fam, self.gen, self.rng = fam, torch.Generator().manual_seed(seed), random.Random(seed)
        self.state = torch.zeros(SLOTS, f.Hv, f.K, f.V, device=dev)
        self.buf_k = torch.zeros(SLOTS, CAP, f.Hk, f.K, dtype=f.dtype, device=dev)
        self.buf_v = torch.zeros(SLOTS, CAP, f.Hv, f.V, dtype=f.dtype, device=dev)
        self.buf_g = torch.zeros(SLOTS, CAP, f.Hv, device=dev)
        self.free_states = list(range(SLOTS))[::-1]
        self.free_buffers = list(range(SLOTS))
        self.requests: dict[int, Request] = {}
        self.next_id = 0

    # -- pools ------------------------------------------------------------------------------------

    def pools(self):
        return [self.state, self.buf_k, self.buf_v, self.buf_g]

    def rows(self, reqs: list[Request], padding: int = 0):
        """state_slots, buffer_slots, lengths for these requests plus `padding` rows of slot -1."""
        i32 = dict(dtype=torch.int32, device=self.fam.device)
        pad = [-1] * padding
        return (torch.tensor([r.state_slot for r in reqs] + pad, **i32),
                torch.tensor([r.buffer_slot for r in reqs] + pad, **i32),
                torch.tensor([r.fill for r in reqs] + [0] * padding, **i32))

    def call(self, kind: str, reqs, tokens, padding: int = 0, flush_at: int = C):
        """Run one op and check that pool slots of requests outside the batch stay bit-exact."""
        s_slots, b_slots, lengths = self.rows(reqs, padding)
        others = [r for r in self.requests.values() if r not in reqs]
        before = [self.owned(r) for r in others]
        o = self.fam.op(kind)(*self.fam.args(tokens), self.state, s_slots, self.buf_k, self.buf_v, self.buf_g,
                              b_slots, lengths, flush_at)
        for r, kept in zip(others, before):
            assert all(torch.equal(a, b) for a, b in zip(self.owned(r), kept)), "a slot outside the batch changed"
        return o

    def owned(self, r: Request) -> list[torch.Tensor]:
        """Copies of what a request owns in the pools."""
        return [self.state[r.state_slot].clone()] + [p[r.buffer_slot].clone() for p in self.pools()[1:]]

    # -- requests ---------------------------------------------------------------------------------

    def join(self, prompt_chunks: int) -> None:
        """Admit a request and prefill a prompt of `prompt_chunks` chunks of C tokens (each fills the
        buffer exactly, so the fused flush folds it)."""
        f = self.fam
        req = Request(self.free_states.pop(), self.free_buffers.pop(),
                      torch.zeros(1, f.Hv, f.K, f.V, dtype=torch.float64, device=f.device))
        self.state[req.state_slot].zero_()
        self.requests[self.next_id] = req
        self.next_id += 1
        for _ in range(prompt_chunks):
            tokens = f.tokens((1, C), self.gen)
            o = self.call("verify", [req], tokens)
            for t in range(C):
                self.expect(o[0, t], f.oracle_step([x[0, t] for x in tokens], req.oracle))

    def leave(self, rid: int) -> None:
        req = self.requests.pop(rid)
        self.free_states.append(req.state_slot)
        self.free_buffers.append(req.buffer_slot)

    def batch(self) -> list[Request]:
        reqs = list(self.requests.values())
        self.rng.shuffle(reqs)
        return reqs

    # -- steps ------------------------------------------------------------------------------------

    def decode(self, padding: int = 0) -> None:
        reqs = self.batch()
        tokens = self.fam.tokens((len(reqs) + padding,), self.gen)
        o = self.call("buffered_step", reqs, tokens, padding)
        for b, r in enumerate(reqs):
            self.expect(o[b], self.fam.oracle_step([x[b] for x in tokens], r.oracle))
            r.fill = 0 if r.fill + 1 == C else r.fill + 1  # the fused flush emptied a full buffer
        assert not bool(o[len(reqs):].any()), "padding rows give zeros"

    def verify(self) -> None:
        """D drafts + the last token per request; each keeps a random count, then full buffers flush."""
        reqs, T = self.batch(), DRAFTS + 1
        tokens = self.fam.tokens((len(reqs), T), self.gen)
        o = self.call("verify", reqs, tokens, flush_at=0)
        for b, r in enumerate(reqs):
            accepted = self.rng.randint(1, T)
            trial = r.oracle.clone()
            for t in range(T):
                self.expect(o[b, t], self.fam.oracle_step([x[b, t] for x in tokens], trial))
                if t + 1 == accepted:
                    r.oracle.copy_(trial)
            r.fill += accepted
        full = [r for r in reqs if r.fill >= C]
        if full:  # the post-verify update: fold the buffers that reached C
            s_slots, b_slots, lengths = self.rows(full)
            self.fam.op("flush")(self.state, s_slots, self.buf_k, self.buf_v, self.buf_g, b_slots, lengths)
            for r in full:
                r.fill = 0

    def expect(self, out: torch.Tensor, ref: torch.Tensor) -> None:
        err = float((out.double() - ref).abs().max()) / max(float(ref.abs().max()), 1e-6)
        assert err < TOL[self.fam.dtype], f"{self.fam.name} relative error {err:.2e}"


def family(name: str, device: str) -> Family:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the kernels take bf16 activations
    return Family(name, *SHAPES[device], dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def jit_on_cuda():
    kvb_ops.allow_jit(True)  # CUDA: compile what the artifact cache lacks; CPU: no effect
    yield
    kvb_ops.allow_jit(None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["gdn", "mamba2"])
def test_requests_join_leave_decode_and_verify(name, device):
    server = Server(family(name, device), seed=3)
    for chunks in (0, 1, 2):
        server.join(chunks)
    for step in range(3 * C):
        server.decode(padding=step % 2)
        if step % 5 == 2:
            server.verify()
        if step == C:
            server.leave(1)  # a finished request frees its slots for the next one
            server.join(1)
        if step == 2 * C:
            server.join(0)
    assert sorted(server.free_states + [r.state_slot for r in server.requests.values()]) == list(range(SLOTS))


@pytest.mark.parametrize("device", DEVICES)
def test_verify_with_every_draft_rejected_leaves_the_pools_as_before(device):
    """Accepting only the last token keeps one entry; the drafts past it are never read again."""
    server = Server(family("gdn", device), seed=5)
    server.join(1)
    server.decode()
    req = next(iter(server.requests.values()))
    state = server.state[req.state_slot].clone()
    tokens = server.fam.tokens((1, DRAFTS + 1), server.gen)
    server.call("verify", [req], tokens, flush_at=0)
    assert torch.equal(server.state[req.state_slot], state), "a verify writes no state"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn", "mamba2"])
def test_decode_step_in_a_cuda_graph(name):
    """Capture a decode step once, replay it with new inputs and fills: the same as eager calls."""
    fam = family(name, "cuda")
    server = Server(fam, seed=9)
    for chunks in (0, 1, 1):
        server.join(chunks)
    reqs = server.batch()
    s_slots, b_slots, lengths = server.rows(reqs, padding=1)
    static = fam.tokens((len(reqs) + 1,), server.gen)
    run = lambda: fam.op("buffered_step")(*fam.args(static), server.state, s_slots, server.buf_k,  # noqa: E731
                                          server.buf_v, server.buf_g, b_slots, lengths, C)
    saved = [p.clone() for p in server.pools()]
    run()  # eager first: validates the inputs and loads the kernel
    for p, s in zip(server.pools(), saved):
        p.copy_(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step in range(C + 2):
        new = fam.tokens((len(reqs) + 1,), server.gen)
        for dst, src in zip(static, new):
            dst.copy_(src)
        eager_pools = [p.clone() for p in server.pools()]
        expected = fam.op("buffered_step")(*fam.args(new), eager_pools[0], s_slots, *eager_pools[1:], b_slots,
                                           lengths.clone(), C)
        graph.replay()
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
        for p, e in zip(server.pools(), eager_pools):
            torch.testing.assert_close(p, e, atol=0, rtol=0)
        lengths.copy_(torch.where(lengths + 1 == C, 0, lengths + 1))  # device-side bookkeeping, graph-safe
