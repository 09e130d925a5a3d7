"""The one-token experts kernel (tiles/gemv.py `gemv_experts` through kvbuffer.kernels) on CUDA against
the products in fp64: Nemotron-3-Nano's and Qwen3.5-35B-A3B's expert weights, awkward sizes, one and
several rows and experts per row, bf16 and fp16, every tuner config, outputs NaN-poisoned; bad calls;
the custom op in a CUDA graph; and the engine at one row with and without it on a MoE model (eager
and compiled), whose logits agree within bf16 rounding.

Kernels come from JIT (kvbuffer.ops.allow_jit()). Run with -s to see the measured errors.
"""

import pytest
import torch

from kvbuffer import ops
from kvbuffer.kernels import build_gemv_experts, gemv_experts, launch, lookup, specs

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3}  # relative (norm) error: the output's rounding
SHAPES = [(1856, 2688), (2688, 1856), (1024, 2048), (2048, 512), (37, 2688), (3, 8)]


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


def _case(S, J, E, N, K, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(S, K, generator=gen, device="cuda").to(dtype)
    w = (torch.randn(E, N, K, generator=gen, device="cuda") * K ** -0.5).to(dtype)
    ids = torch.randint(0, E, (S, J), generator=gen, device="cuda")
    return x, w, ids


def _want(x, w, ids):
    return torch.einsum("sk,sjnk->sjn", x.double(), w[ids].double())


def _rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("S,J", [(1, 6), (1, 1), (3, 8)])
def test_kernel_matches_fp64(N, K, S, J):
    from kvbuffer.tiles.gemv import DEFAULT

    for dtype in (torch.bfloat16, torch.float16):
        x, w, ids = _case(S, J, 9, N, K, dtype, N + K + S + J)
        op = build_gemv_experts(N, K, dtype=str(dtype).removeprefix("torch."), **DEFAULT)
        y = torch.full((S, J, N), float("nan"), device="cuda", dtype=dtype)
        gemv_experts(op, x, w, ids, out=y)
        err = _rel(y, _want(x, w, ids))
        print(f"N={N} K={K} S={S} J={J} {dtype}: rel err {err:.2e}")
        assert bool(torch.isfinite(y).all()) and err < TOL[dtype]


@pytest.mark.parametrize("config", range(5))
def test_every_tuner_config_matches_fp64(config):
    from kvbuffer.tiles.gemv import get_configs

    tunables = get_configs()[config]
    for N, K in ((1856, 2688), (37, 2688), (1000, 72)):
        x, w, ids = _case(2, 6, 8, N, K, torch.bfloat16, config)
        y = gemv_experts(build_gemv_experts(N, K, **tunables), x, w, ids)
        assert _rel(y, _want(x, w, ids)) < TOL[torch.bfloat16], (tunables, N, K)


def test_bad_calls_raise_before_the_launch():
    from kvbuffer.errors import DTypeError, ExpertIndexError, ShapeError

    op = build_gemv_experts(64, 128)
    x, w, ids = _case(2, 3, 4, 64, 128, torch.bfloat16, 0)
    with pytest.raises(ExpertIndexError, match=r"outside \[0, 4\)"):
        gemv_experts(op, x, w, ids + 4)
    with pytest.raises(ShapeError, match="weight must have shape"):
        gemv_experts(op, x, w[..., :64].contiguous(), ids)
    with pytest.raises(DTypeError, match="expert must have dtype"):
        gemv_experts(op, x, w, ids.int())
    with pytest.raises(ShapeError, match="contiguous"):
        gemv_experts(op, x, w, ids.T.contiguous().T)
    many = torch.zeros(8192, 8, dtype=torch.int64, device="cuda")  # 65536 (row, expert) pairs
    with pytest.raises(ShapeError, match="at most 65535"):
        gemv_experts(op, torch.zeros(8192, 128, dtype=torch.bfloat16, device="cuda"), w, many)


def test_custom_op_in_a_cuda_graph():
    """torch.ops.kvbuffer.gemv_experts on CUDA, captured once and replayed after x and the ids changed."""
    x, w, ids = _case(1, 6, 16, 1856, 2688, torch.bfloat16, 3)
    torch.ops.kvbuffer.gemv_experts(x, w, ids)  # the lookup (and JIT compile) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.kvbuffer.gemv_experts(x, w, ids)
    x.copy_(torch.randn_like(x))
    ids.copy_(torch.randperm(16, device="cuda")[:6][None])
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(y, _want(x, w, ids)) < TOL[torch.bfloat16]


PROMPTS = [[5, 17, 3, 44, 9, 61, 2, 30, 11, 7, 12, 90, 4, 21, 33, 8, 70, 1, 15], [8, 1, 33]]


@pytest.mark.parametrize("compiled", [False, True])
def test_engine_one_row_experts_follow_the_grouped_path(compiled):
    """A Nemotron-H model with routed experts, max_batch 1: gemv=True puts its experts' one-token
    forwards on the kernel; the logits follow the grouped path within bf16 rounding, and greedy
    tokens agree except at near ties (tests/gpu/test_ops_and_engine.compare_greedy)."""
    from tests.gpu.test_ops_and_engine import compare_greedy
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM
    from kvbuffer.models.layers import one_row_experts

    blocks = ["mamba", "moe", "attention", "mamba", "moe"]
    torch._dynamo.reset()
    kw = dict(device="cuda", dtype=torch.bfloat16, chunk_size=8, max_batch=1, kernels=True, compile=compiled)
    want = LLM(tiny_model("nemotron_h", head_dim=64, layers_block_type=blocks), gemv=False, **kw).generate(
        PROMPTS, max_new_tokens=24, return_logits=True)
    torch._dynamo.reset()
    llm = LLM(tiny_model("nemotron_h", head_dim=64, layers_block_type=blocks), gemv=True, **kw)
    assert "of 2 expert layers, 2 run forwards of up to 8 tokens" in llm.gemv and all(m.one_row == 8 for m in one_row_experts(llm.model))
    got = llm.generate(PROMPTS, max_new_tokens=24, return_logits=True)
    assert any(k.op == "experts" for k in lookup.loaded_keys())
    assert specs.tune_template(launch.gemv_experts_key(one_row_experts(llm.model)[0].expert_weights()[0])) == "gemv_experts"
    compare_greedy(got, want, tol=0.1)
