"""The grouped experts kernel (tiles/grouped.py through kvbuffer.kernels) on CUDA against the products
in fp64: Nemotron-3-Nano's and Qwen3.5-35B-A3B's expert weights at decode-sized routings (1 to 1,024
tokens' top-k), awkward sizes (N past a block, rows past a row block, empty experts, every row on one
expert), bf16 and fp16, every tuner config, outputs NaN-poisoned; bad calls; the custom op in a CUDA
graph; and the engine with and without it on a MoE model (eager and compiled), whose logits agree
within bf16 rounding.

Kernels come from JIT (kvbuffer.ops.allow_jit()). Run with -s to see the measured errors.
"""

import pytest
import torch

from kvbuffer import ops
from kvbuffer.kernels import build_grouped_experts, grouped_experts, launch, lookup, specs
from kvbuffer.tiles.grouped import get_configs

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3}  # relative (norm) error: the output's rounding


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


def _routed(tokens, k, E, N, K, dtype, seed):
    """x sorted by expert, the weights, the ends: `tokens` tokens' top-k of E experts, drawn at random."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    top = torch.rand(tokens, E, generator=gen, device="cuda").topk(k, dim=-1).indices
    experts, _ = torch.sort(top.reshape(-1).to(torch.int32))
    ends = torch.searchsorted(experts, torch.arange(1, E + 1, device="cuda", dtype=torch.int32), out_int32=True)
    x = torch.randn(tokens * k, K, generator=gen, device="cuda").to(dtype)
    w = (torch.randn(E, N, K, generator=gen, device="cuda") * K ** -0.5).to(dtype)
    return x, w, ends


def _want(x, w, ends):
    out, start = [], 0
    for e, end in enumerate(ends.tolist()):
        out.append(x[start:end].double() @ w[e].double().T)
        start = end
    return torch.cat(out)


def _rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("E,k,N,K", [(128, 6, 1856, 2688), (128, 6, 2688, 1856), (256, 8, 1024, 2048),
                                     (256, 8, 2048, 512), (5, 2, 200, 192), (3, 1, 64, 64)])
@pytest.mark.parametrize("tokens", [1, 9, 64, 257, 1024])
def test_kernel_matches_fp64(E, k, N, K, tokens):
    from kvbuffer.tiles.grouped import DEFAULT

    for dtype in (torch.bfloat16, torch.float16):
        x, w, ends = _routed(tokens, k, E, N, K, dtype, N + K + tokens)
        op = build_grouped_experts(N, K, dtype=str(dtype).removeprefix("torch."), **DEFAULT)
        y = torch.full((x.shape[0], N), float("nan"), device="cuda", dtype=dtype)
        grouped_experts(op, x, w, ends, out=y)
        err = _rel(y, _want(x, w, ends))
        print(f"E={E} k={k} N={N} K={K} tokens={tokens} {dtype}: rel err {err:.2e}")
        assert bool(torch.isfinite(y).all()) and err < TOL[dtype]


def test_one_expert_holding_every_token_and_the_rest_empty():
    """Many row blocks on one expert (its blocks loop over them), others with none or one row; then
    every row on the last expert."""
    x, w, _ = _routed(300, 2, 16, 1856, 2688, torch.bfloat16, 7)
    counts = torch.tensor([301, 0, 1, 0, 2] + [37] * 8 + [0, 0, 0], dtype=torch.int32, device="cuda")
    ends = counts.cumsum(0, dtype=torch.int32)
    assert int(ends[-1]) == x.shape[0]
    op = build_grouped_experts(1856, 2688)
    assert _rel(grouped_experts(op, x, w, ends), _want(x, w, ends)) < TOL[torch.bfloat16]
    last = torch.zeros(16, dtype=torch.int32, device="cuda")
    last[-1] = x.shape[0]
    assert _rel(grouped_experts(op, x, w, last), x.double() @ w[-1].double().T) < TOL[torch.bfloat16]


@pytest.mark.parametrize("config", range(len(get_configs())))
def test_row_counts_at_every_row_block_edge(config):
    """Experts of 1 to 300 rows, at and either side of each row block and pass (row_blocks * block_t)
    edge of the config: a row block runs only when its expert's rows reach it, a pass past it reads
    the weight again."""
    tunables = get_configs()[config]
    bt, rb = tunables["block_t"], tunables["row_blocks"]
    edges = sorted({max(1, m * bt + d) for m in range(1, 2 * rb + 2) for d in (-1, 0, 1)} | {1, 300})
    counts = torch.tensor(edges + [0], dtype=torch.int32, device="cuda")
    ends = counts.cumsum(0, dtype=torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(config)
    N, K = 200, 192
    x = torch.randn(int(ends[-1]), K, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(len(counts), N, K, generator=gen, device="cuda") * K ** -0.5).bfloat16()
    y = torch.full((x.shape[0], N), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped_experts(build_grouped_experts(N, K, **tunables), x, w, ends, out=y)
    assert bool(torch.isfinite(y).all()) and _rel(y, _want(x, w, ends)) < TOL[torch.bfloat16], (tunables, edges)


@pytest.mark.parametrize("config", range(len(get_configs())))
def test_every_tuner_config_matches_fp64(config):
    tunables = get_configs()[config]
    for E, N, K, tokens in ((128, 1856, 2688, 512), (5, 200, 192, 33), (8, 2048, 512, 70)):
        x, w, ends = _routed(tokens, 2, E, N, K, torch.bfloat16, config)
        y = grouped_experts(build_grouped_experts(N, K, **tunables), x, w, ends)
        assert _rel(y, _want(x, w, ends)) < TOL[torch.bfloat16], (tunables, N, K)


def test_bad_calls_raise_before_the_launch():
    from kvbuffer.errors import DTypeError, ExpertIndexError, ShapeError

    op = build_grouped_experts(64, 128)
    x, w, ends = _routed(10, 2, 4, 64, 128, torch.bfloat16, 0)
    with pytest.raises(ExpertIndexError, match="non-decreasing"):
        grouped_experts(op, x, w, ends - 1)
    with pytest.raises(ExpertIndexError, match="decreasing"):
        grouped_experts(op, x, w, ends.flip(0).contiguous())
    with pytest.raises(ShapeError, match="weight must have shape"):
        grouped_experts(op, x, w[..., :64].contiguous(), ends)
    with pytest.raises(ShapeError, match="ends must have shape"):
        grouped_experts(op, x, w, ends[:3])
    with pytest.raises(DTypeError, match="ends must have dtype"):
        grouped_experts(op, x, w, ends.long())
    with pytest.raises(ShapeError, match="contiguous"):
        grouped_experts(op, x.T.contiguous().T, w, ends)
    assert grouped_experts(op, x[:0], w, torch.zeros_like(ends)).shape == (0, 64)


def test_custom_op_in_a_cuda_graph():
    """torch.ops.kvbuffer.grouped_experts on CUDA, captured once and replayed after x and the routing changed."""
    x, w, ends = _routed(64, 6, 128, 1856, 2688, torch.bfloat16, 3)
    torch.ops.kvbuffer.grouped_experts(x, w, ends)  # the lookup (and JIT compile) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.kvbuffer.grouped_experts(x, w, ends)
    x2, _, ends2 = _routed(64, 6, 128, 1856, 2688, torch.bfloat16, 4)
    x.copy_(x2)
    ends.copy_(ends2)
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(y, _want(x, w, ends)) < TOL[torch.bfloat16]


PROMPTS = [[5, 17, 3, 44, 9, 61, 2, 30, 11, 7, 12, 90, 4, 21, 33, 8, 70, 1, 15], [8, 1, 33]] * 6


@pytest.mark.parametrize("compiled", [False, True])
def test_engine_grouped_experts_follow_torchs_grouped_matmul(compiled):
    """A Nemotron-H model with routed experts whose both matmuls the grouped kernel takes, 12 requests:
    gemv=True runs the prompts and the decode steps past 8 rows on it; the logits follow torch's grouped
    matmul within bf16 rounding, and greedy tokens agree except at near ties."""
    from tests.gpu.test_ops_and_engine import compare_greedy
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM
    from kvbuffer.models.layers import one_row_experts

    blocks = ["mamba", "moe", "attention", "mamba", "moe"]
    cfg = dict(head_dim=64, layers_block_type=blocks, moe_intermediate_size=64)
    torch._dynamo.reset()
    kw = dict(device="cuda", dtype=torch.bfloat16, chunk_size=8, max_batch=16, kernels=True, compile=compiled)
    want = LLM(tiny_model("nemotron_h", **cfg), gemv=False, **kw).generate(PROMPTS, max_new_tokens=20,
                                                                           return_logits=True)
    torch._dynamo.reset()
    llm = LLM(tiny_model("nemotron_h", **cfg), gemv=True, **kw)
    assert llm.gemv.endswith("2 expert layers, 2 run forwards of up to 8 tokens on the one-row experts kernel and "
                             "2 of up to 512 on the grouped experts kernel")
    assert all(m.grouped for m in one_row_experts(llm.model))
    got = llm.generate(PROMPTS, max_new_tokens=20, return_logits=True)
    assert any(k.op == "grouped" for k in lookup.loaded_keys())
    key = launch.grouped_experts_key(one_row_experts(llm.model)[0].expert_weights()[0])
    assert specs.tune_template(key) == "grouped_experts"
    compare_greedy(got, want, tol=0.1)
