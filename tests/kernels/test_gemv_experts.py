"""The one-token experts kernel on the CPU: the template (tiles/gemv.py `gemv_experts`) lowered for
sm_90a and run through tests/support/simt_emulator.py against the products in fp64 (outputs
NaN-poisoned; Nemotron's ragged K, several rows and experts per row, an id outside the experts); the
kernel key; the custom op (CPU: the reference) and its fake; route_to_experts' one-token path against
the grouped one (gated and ungated, the models' accumulation dtypes); the engine switch off CUDA.
The GPU tests are tests/gpu/test_gemv_experts.py.
"""

import importlib.util
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvbuffer.errors import DTypeError, ExpertIndexError, ShapeError
from kvbuffer.kernels import launch, specs
from kvbuffer.kernels.keys import GemvDims, KernelKey
from kvbuffer.kernels.specs import spec_for

_BUILD = importlib.util.find_spec("tilelang") is not None and bool(
    shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")) and bool(shutil.which("g++"))


def _loop(x, w, ids):
    """The definition, one expert at a time, in fp64: (S, J, N)."""
    return torch.stack([torch.stack([w[e].double() @ x[s].double() for e in ids[s].tolist()])
                        for s in range(x.shape[0])])


@pytest.mark.tilelang
@pytest.mark.slow
@pytest.mark.skipif(not _BUILD, reason="needs TileLang, nvcc and g++")
@pytest.mark.parametrize("S,J,E,N,K,tunables", [
    (1, 3, 5, 37, 2688, {}),                                      # Nemotron's K: the last pass is ragged
    (2, 2, 4, 50, 72, dict(per_warp=4, threads=64, unroll=16)),   # N not a multiple of a block's 8 columns
    (3, 1, 3, 16, 512, dict(per_warp=1, threads=64, unroll=4)),   # the down projection's form: J = 1, passes
])
def test_template_matches_fp64_emulated(S, J, E, N, K, tunables):
    from kvbuffer.gpus import get_gpu
    from kvbuffer.tiles import gemv

    from tests.support.simt_emulator import emulated

    t = dict(gemv.DEFAULT, **tunables)
    emu = emulated(gemv.gemv_experts(N, K, **t), get_gpu("h200").target)
    gen = torch.Generator().manual_seed(N + K + J)
    x = torch.randn(S, K, generator=gen).to(torch.bfloat16)
    w = (torch.randn(E, N, K, generator=gen) * K ** -0.5).to(torch.bfloat16)
    ids = torch.randint(0, E, (S, J), generator=gen)
    y = torch.full((S, J, N), float("nan")).to(torch.bfloat16)
    per_block = t["threads"] // 32 * t["per_warp"]
    emu((-(-N // per_block), S * J, 1), t["threads"], x=x, weight=w, expert=ids, y=y,
        rows=S, experts_per_row=J, experts=E)
    ref = _loop(x, w, ids)
    assert bool(torch.isfinite(y).all())
    assert float((y.double() - ref).norm() / ref.norm()) < 4e-3
    bad = ids.clone()
    bad[0, 0] = E  # outside the experts: read as zero weights, never out of bounds
    emu((-(-N // per_block), S * J, 1), t["threads"], x=x, weight=w, expert=bad, y=y,
        rows=S, experts_per_row=J, experts=E)
    assert bool((y[0, 0] == 0).all())


def test_key_names_its_template_record_and_command():
    w = torch.zeros(6, 32, 64, dtype=torch.bfloat16)
    key = launch.gemv_experts_key(w)
    assert key == KernelKey("gemv", "experts", GemvDims(32, 64), "bfloat16")
    assert specs.tune_template(key) == "gemv_experts" and spec_for(key).kind == "gemv_experts"
    assert specs.record_shapes(key) == [{"family": "experts", "N": 32, "K": 64, "dtype": "bfloat16"}]
    assert spec_for(key).launch_params(key, {"threads": 128}) == dict(threads=128, N=32, K=64, dtype="bfloat16")
    assert specs.tune_command(key) == "kvbuffer tune --gpu <gpu> --model <model>"
    assert key != launch.gemv_key(w[0])  # the same weight shape, another kernel


def test_custom_op_on_cpu_its_checks_and_its_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 24, generator=gen), torch.randn(5, 40, 24, generator=gen)
    ids = torch.tensor([[4, 0], [1, 1], [3, 2]])
    got = torch.ops.kvbuffer.gemv_experts(x, w, ids)
    assert got.shape == (3, 2, 40)
    torch.testing.assert_close(got.double(), _loop(x, w, ids), rtol=1e-5, atol=1e-5)
    with FakeTensorMode():
        fake = torch.ops.kvbuffer.gemv_experts(torch.empty(1, 24), torch.empty(5, 40, 24),
                                               torch.empty(1, 6, dtype=torch.int64))
        assert fake.shape == (1, 6, 40)
    with pytest.raises(ExpertIndexError, match=r"id 5, outside \[0, 5\)"):
        torch.ops.kvbuffer.gemv_experts(x, w, ids + 1)
    with pytest.raises(ShapeError, match="weight must have shape"):
        torch.ops.kvbuffer.gemv_experts(x, w[..., :8], ids)
    with pytest.raises(DTypeError, match="expert must have dtype"):
        torch.ops.kvbuffer.gemv_experts(x, w, ids.int())
    with pytest.raises(ShapeError, match="expert must have shape"):
        torch.ops.kvbuffer.gemv_experts(x, w, ids[:2])


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("dtype,acc", [(torch.float32, None), (torch.bfloat16, torch.float32)], ids=["fp32", "bf16"])
def test_one_token_path_follows_the_grouped_path(gated, dtype, acc):
    """route_to_experts with `one_row` at one token (torch.ops.kvbuffer.gemv_experts: on the CPU its
    reference) against the sorted, grouped path, for both experts' forms; more tokens keep the grouped
    path."""
    from kvbuffer.models import layers

    gen = torch.Generator().manual_seed(1)
    E, H, I, k = 8, 64, 32, 3
    first = (torch.randn(E, 2 * I if gated else I, H, generator=gen) * H ** -0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(dtype)
    act = (lambda y: F.silu(y[..., :I]) * y[..., I:]) if gated else (lambda y: F.relu(y) ** 2)
    for tokens in (1, 2):
        x = torch.randn(tokens, H, generator=gen).to(dtype)
        idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
        w = torch.rand(tokens, k, generator=gen).to(acc or dtype)
        want = layers.route_to_experts(x, idx, w, first, down, act, acc)
        got = layers.route_to_experts(x, idx, w, first, down, act, acc, one_row=True)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got, want, **tol)
        assert got.dtype == x.dtype


def test_the_models_expose_their_experts_and_the_switch_stays_off_cpu():
    from tests.support.tiny_models import tiny_model

    from kvbuffer.engine.one_row import use_one_row_kernel
    from kvbuffer.models.layers import RoutedExperts, one_row_experts

    model = tiny_model("nemotron_h", layers_block_type=["mamba", "moe", "attention", "mamba", "moe"])
    experts = one_row_experts(model)
    assert len(experts) == 2 and all(isinstance(m, RoutedExperts) for m in experts)
    first, down = experts[0].expert_weights()
    assert first.shape[1:] == (32, 64) and down.shape[1:] == (64, 32)
    assert use_one_row_kernel(model, "auto", kernels=False) == "the linear layers run on the reference ops"
    assert not any(m.one_row for m in experts)
    assert use_one_row_kernel(model, False, kernels=True) == "gemv=False"


def test_tune_shapes_of_a_moe_model_include_its_experts():
    from kvbuffer.autotune import models

    got = {(s["family"], s["N"], s["K"]) for s in models.preset_gemv_shapes("nemotron-3-nano")}
    assert {("experts", 1856, 2688), ("experts", 2688, 1856)} <= got
    assert not any(s["family"] == "experts" for s in models.preset_gemv_shapes("qwen3.5-9b"))


def test_the_switch_off_never_reaches_the_kernel_and_ids_of_any_int_dtype_go_in(monkeypatch):
    """one_row 0 / False keeps every forward (an empty one too) on the grouped path; the router's ids
    reach the kernel as int64 whatever integer dtype they come in."""
    from kvbuffer.models import layers

    gen = torch.Generator().manual_seed(2)
    first, down = torch.randn(4, 8, 16, generator=gen), torch.randn(4, 16, 8, generator=gen)
    act = lambda y: F.relu(y) ** 2  # noqa: E731
    real = launch.engine_rows
    calls = []
    monkeypatch.setattr(launch, "engine_rows", lambda name, *a: calls.append(a[2].dtype) or real(name, *a))
    for off in (0, False):
        layers.route_to_experts(torch.randn(0, 16), torch.zeros(0, 2, dtype=torch.int64), torch.rand(0, 2),
                                first, down, act, one_row=off)
        layers.route_to_experts(torch.randn(1, 16), torch.tensor([[1, 3]]), torch.rand(1, 2), first, down, act,
                                one_row=off)
    assert calls == []
    x, w = torch.randn(1, 16, generator=gen), torch.rand(1, 2, generator=gen)
    want = layers.route_to_experts(x, torch.tensor([[1, 3]]), w, first, down, act)
    got = layers.route_to_experts(x, torch.tensor([[1, 3]], dtype=torch.int32), w, first, down, act, one_row=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [torch.int64, torch.int64]


def test_the_switch_sets_the_experts_token_limit_and_counts_layers(monkeypatch):
    """With every kernel loadable (faked here), use_one_row_kernel puts the projections on the one-row
    kernel and the routed experts on the experts kernel up to EXPERT_TOKENS tokens and on the grouped
    kernel past them, and its line counts expert layers, not tokens."""
    from tests.support.tiny_models import tiny_model

    from kvbuffer.engine import one_row
    from kvbuffer.models.layers import one_row_experts, one_row_linears

    model = tiny_model("nemotron_h", layers_block_type=["mamba", "moe", "attention", "mamba", "moe"])
    monkeypatch.setattr(one_row, "_fits", lambda weight, fits=None: True)
    monkeypatch.setattr(one_row, "_missing", lambda keys: set())
    n = len(one_row_linears(model))
    assert one_row.use_one_row_kernel(model, "auto", kernels=True) == (
        f"{n} of {n} projections run one-token forwards on the one-row kernel; of 2 expert layers, 2 run "
        f"forwards of up to {one_row.EXPERT_TOKENS} tokens on the one-row experts kernel and 2 of up to "
        f"{one_row.GROUPED_TOKENS} on the grouped experts kernel")
    assert all(m.one_row is True for m in one_row_linears(model))
    assert [m.one_row for m in one_row_experts(model)] == [one_row.EXPERT_TOKENS] * 2
    assert [m.grouped for m in one_row_experts(model)] == [one_row.GROUPED_TOKENS] * 2
    assert one_row.use_one_row_kernel(model, False, kernels=True) == "gemv=False"
    assert not any(m.one_row for m in (*one_row_linears(model), *one_row_experts(model)))
    assert not any(m.grouped for m in one_row_experts(model))


def test_an_empty_forward_keeps_the_grouped_path_and_warm_up_passes_the_token_limit(monkeypatch):
    """A forward of no tokens never takes the experts kernel (even with it on); an engine whose
    experts take it warms one row count past EXPERT_TOKENS (and past GROUPED_TOKENS where they take the
    grouped kernel), so a compiled step that grows past a limit is not a recompilation in front of
    running requests."""
    from tests.support.tiny_models import tiny_model

    from kvbuffer import LLM
    from kvbuffer.engine.one_row import EXPERT_TOKENS
    from kvbuffer.models import layers

    first, down = torch.randn(4, 8, 16), torch.randn(4, 16, 8)
    monkeypatch.setattr(launch, "engine_rows", lambda *a: pytest.fail("the kernel ran for no tokens"))
    out = layers.route_to_experts(torch.randn(0, 16), torch.zeros(0, 2, dtype=torch.int64), torch.rand(0, 2),
                                  first, down, lambda y: F.relu(y) ** 2, one_row=EXPERT_TOKENS)
    assert out.shape == (0, 16)
    monkeypatch.undo()

    llm = LLM(tiny_model("nemotron_h", layers_block_type=["mamba", "moe", "attention", "mamba", "moe"]),
              device="cpu", chunk_size=4, max_batch=16, max_len=64)
    seen = []
    monkeypatch.setattr(llm.runner, "warm_up", lambda rows, windows: seen.extend(rows))
    llm.warm_up()
    assert EXPERT_TOKENS + 1 not in seen  # the experts are off on the CPU
    for m in layers.one_row_experts(llm.model):
        m.one_row = EXPERT_TOKENS
    seen.clear()
    llm.warm_up()
    assert EXPERT_TOKENS + 1 in seen and 12 not in seen
    from kvbuffer.engine import llm as engine_llm

    monkeypatch.setattr(engine_llm, "GROUPED_TOKENS", 11)  # within this engine's 16 rows
    for m in layers.one_row_experts(llm.model):
        m.grouped = 11
    seen.clear()
    llm.warm_up()
    assert 12 in seen  # and past the grouped kernel's limit too
