"""The one-row projection kernel (tiles/gemv.py through kvbuffer.kernels) on CUDA against the product in
fp64: the decode projections of Qwen3.5-9B and Nemotron-3-Nano, awkward sizes (N not a multiple of a
block's columns, K not a multiple of a warp's 256-element pass), one and two rows, every tuner config,
outputs NaN-poisoned before the launch; the custom op in a CUDA graph; and the engine at one row with
and without it (eager and compiled), whose logits agree within bf16 rounding.

Kernels come from JIT (kvbuffer.ops.allow_jit()). Run with -s to see the measured errors.
"""

import pytest
import torch

from kvbuffer import ops
from kvbuffer.kernels import build_gemv, gemv, launch, lookup, specs

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3}  # relative (norm) error: the output's rounding
SHAPES = [(12352, 4096), (4096, 12288), (10304, 2688), (2688, 3712), (37, 2688), (1000, 72), (3, 8)]


@pytest.fixture(autouse=True, scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


def _case(N, K, rows, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, K, generator=gen, device="cuda").to(dtype)
    w = (torch.randn(N, K, generator=gen, device="cuda") * K ** -0.5).to(dtype)
    return x, w


def _rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("rows", [1, 2])
def test_kernel_matches_fp64(N, K, rows):
    from kvbuffer.tiles.gemv import DEFAULT

    for dtype in (torch.bfloat16, torch.float16):
        x, w = _case(N, K, rows, dtype, N + K + rows)
        op = build_gemv(N, K, rows, dtype=str(dtype).removeprefix("torch."), **DEFAULT)
        y = torch.full((rows, N), float("nan"), device="cuda", dtype=dtype)
        gemv(op, x, w, out=y)
        ref = x.double() @ w.double().T
        err, gemm = _rel(y, ref), _rel(torch.nn.functional.linear(x, w), ref)
        print(f"N={N} K={K} rows={rows} {dtype}: rel err {err:.2e} (torch's GEMM {gemm:.2e})")
        assert bool(torch.isfinite(y).all()) and err < TOL[dtype]


@pytest.mark.parametrize("config", range(5))
def test_every_tuner_config_matches_fp64(config):
    from kvbuffer.tiles.gemv import get_configs

    tunables = get_configs()[config]
    for N, K in ((4096, 4096), (37, 2688), (1000, 72)):
        x, w = _case(N, K, 1, torch.bfloat16, config)
        y = gemv(build_gemv(N, K, **tunables), x, w)
        assert _rel(y, x.double() @ w.double().T) < TOL[torch.bfloat16], (tunables, N, K)


def test_bad_calls_raise_before_the_launch():
    from kvbuffer.errors import DTypeError, ShapeError

    op = build_gemv(64, 128)
    x, w = _case(64, 128, 1, torch.bfloat16, 0)
    with pytest.raises(ShapeError, match="weight must have shape"):
        gemv(op, x, w[:, :64].contiguous())
    with pytest.raises(DTypeError, match="x must have dtype"):
        gemv(op, x.half(), w)
    with pytest.raises(ShapeError, match="contiguous"):
        gemv(op, x, w.T.contiguous().T)


def test_custom_op_in_a_cuda_graph():
    """torch.ops.kvbuffer.gemv on CUDA, captured once and replayed after x changed in place."""
    x, w = _case(10240, 4096, 1, torch.bfloat16, 3)
    torch.ops.kvbuffer.gemv(x, w)  # the lookup (and JIT compile) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.kvbuffer.gemv(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(y, x.double() @ w.double().T) < TOL[torch.bfloat16]
    assert specs.tune_template(launch.gemv_key(w, x.shape[0])) == "gemv"


PROMPTS = [[5, 17, 3, 44, 9, 61, 2, 30, 11, 7, 12, 90, 4, 21, 33, 8, 70, 1, 15], [8, 1, 33]]


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("compiled", [False, True])
def test_engine_one_row_kernel_follows_torch_gemm(kind, compiled):
    """max_batch 1: every decode step is one token. gemv=True puts every bias-free projection on the
    kernel; its logits follow torch's GEMM within bf16 rounding, and greedy tokens agree except at near
    ties (tests/gpu/test_ops_and_engine.compare_greedy)."""
    from tests.gpu.test_ops_and_engine import compare_greedy
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM
    from kvbuffer.models.layers import one_row_linears

    torch._dynamo.reset()
    kw = dict(device="cuda", dtype=torch.bfloat16, chunk_size=8, max_batch=1, kernels=True, compile=compiled)
    want = LLM(tiny_model(kind, head_dim=64), gemv=False, **kw).generate(PROMPTS, max_new_tokens=24,
                                                                         return_logits=True)
    torch._dynamo.reset()
    llm = LLM(tiny_model(kind, head_dim=64), gemv=True, **kw)
    n = len(one_row_linears(llm.model))
    assert llm.gemv.startswith(f"{n} of {n} projections run one-token forwards") and n >= 3
    got = llm.generate(PROMPTS, max_new_tokens=24, return_logits=True)
    assert any(k.family == "gemv" for k in lookup.loaded_keys())
    compare_greedy(got, want, tol=0.1)
