"""The grouped experts kernel's CPU side: the template's parameter checks and configs (it compiles for
every arch in tests/kernels/test_tiles_compile.py; it runs in tests/gpu/test_grouped_experts.py), the
kernel key, the custom op (CPU: kvbuffer.reference.experts) with its checks and fake, route_to_experts
with `grouped` against the path without it, and the tune shapes a MoE model declares.
"""

import pytest
import torch
import torch.nn.functional as F

from kvbuffer.errors import DTypeError, ExpertIndexError, ShapeError
from kvbuffer.kernels import launch, specs
from kvbuffer.kernels.keys import GemvDims, KernelKey, grouped_fits
from kvbuffer.kernels.specs import spec_for


def _loop(x, w, ends):
    """The definition, one expert at a time, in fp64: (M, N)."""
    starts = [0] + ends.tolist()[:-1]
    return torch.cat([x[s:e].double() @ w[i].double().T for i, (s, e) in enumerate(zip(starts, ends.tolist()))])


def test_template_checks_and_configs():
    from kvbuffer.tiles import grouped

    configs = grouped.get_configs()
    assert configs[0] == grouped.DEFAULT and len(configs) == len({tuple(sorted(c.items())) for c in configs})
    for c in configs:
        grouped.check_grouped(1856, 2688, **c)
    with pytest.raises(ValueError, match="multiple of 64"):
        grouped.check_grouped(64, 96)
    with pytest.raises(ValueError, match="dtype"):
        grouped.check_grouped(64, 128, dtype="float32")
    with pytest.raises(ValueError, match="64 weight rows a warpgroup"):
        grouped.check_grouped(64, 128, block_n=64, threads=256)
    with pytest.raises(ValueError, match="block_t"):
        grouped.check_grouped(64, 128, block_t=8)
    with pytest.raises(ValueError, match="row_blocks"):
        grouped.check_grouped(64, 128, block_t=64, row_blocks=4)  # 256 accumulator columns
    with pytest.raises(ValueError, match="row_blocks"):
        grouped.check_grouped(64, 128, row_blocks=3)
    assert grouped_fits(1856, "bfloat16") and not grouped_fits(32, "bfloat16") and not grouped_fits(64, "float32")


def test_key_names_its_template_record_and_command():
    w = torch.zeros(6, 32, 64, dtype=torch.bfloat16)
    key = launch.grouped_experts_key(w)
    assert key == KernelKey("gemv", "grouped", GemvDims(32, 64), "bfloat16")
    assert specs.tune_template(key) == "grouped_experts" and spec_for(key).kind == "grouped_experts"
    assert specs.record_shapes(key) == [{"family": "grouped", "N": 32, "K": 64, "dtype": "bfloat16"}]
    assert spec_for(key).launch_params(key, {"stages": 4}) == dict(stages=4, N=32, K=64, dtype="bfloat16")
    assert specs.tune_command(key) == "kvbuffer tune --gpu <gpu> --model <model>"
    assert key != launch.gemv_experts_key(w)  # the same experts' weights, another kernel


def test_custom_op_on_cpu_its_checks_and_its_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 24, generator=gen), torch.randn(5, 40, 24, generator=gen)
    ends = torch.tensor([4, 4, 5, 11, 11], dtype=torch.int32)  # empty experts, one of one row
    got = torch.ops.kvbuffer.grouped_experts(x, w, ends)
    assert got.shape == (11, 40)
    torch.testing.assert_close(got.double(), _loop(x, w, ends), rtol=1e-5, atol=1e-5)
    with FakeTensorMode():
        fake = torch.ops.kvbuffer.grouped_experts(torch.empty(7, 24), torch.empty(5, 40, 24),
                                                  torch.empty(5, dtype=torch.int32))
        assert fake.shape == (7, 40)
    with pytest.raises(ExpertIndexError, match=r"to the rows of x \(11\)"):
        torch.ops.kvbuffer.grouped_experts(x, w, ends - 1)
    with pytest.raises(ExpertIndexError, match="decreasing"):
        torch.ops.kvbuffer.grouped_experts(x, w, torch.tensor([4, 3, 5, 11, 11], dtype=torch.int32))
    with pytest.raises(ExpertIndexError, match="names no expert"):
        torch.ops.kvbuffer.grouped_experts(x, w[:0], ends[:0])
    with pytest.raises(ShapeError, match="weight must have shape"):
        torch.ops.kvbuffer.grouped_experts(x, w[..., :8], ends)
    with pytest.raises(DTypeError, match="ends must have dtype"):
        torch.ops.kvbuffer.grouped_experts(x, w, ends.long())
    with pytest.raises(ShapeError, match="ends must have shape"):
        torch.ops.kvbuffer.grouped_experts(x, w, ends[:4])
    assert torch.ops.kvbuffer.grouped_experts(x[:0], w, torch.zeros_like(ends)).shape == (0, 40)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("dtype,acc", [(torch.float32, None), (torch.bfloat16, torch.float32)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_route_to_experts_with_the_grouped_kernel_follows_the_path_without(gated, dtype, acc, tokens, monkeypatch):
    """route_to_experts up to `grouped` tokens calls torch.ops.kvbuffer.grouped_experts for both matmuls
    (on the CPU its reference) and gives the path without it; `one_row` still takes the few-token
    forwards, and more than `grouped` tokens go to torch's path."""
    from kvbuffer.models import layers

    gen = torch.Generator().manual_seed(tokens)
    E, H, I, k = 8, 64, 32, 3
    first = (torch.randn(E, 2 * I if gated else I, H, generator=gen) * H ** -0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(dtype)
    act = (lambda y: F.silu(y[..., :I]) * y[..., I:]) if gated else (lambda y: F.relu(y) ** 2)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    idx = torch.rand(tokens, E, generator=gen).topk(k, dim=-1).indices
    w = torch.rand(tokens, k, generator=gen).to(acc or dtype)
    want = layers.route_to_experts(x, idx, w, first, down, act, acc)
    calls = []
    real = launch.engine_rows
    monkeypatch.setattr(launch, "engine_rows", lambda name, *a: calls.append(name) or real(name, *a))
    got = layers.route_to_experts(x, idx, w, first, down, act, acc, grouped=40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == ["grouped_experts"] * 2
    calls.clear()
    layers.route_to_experts(x, idx, w, first, down, act, acc, one_row=8, grouped=40)
    assert calls == (["gemv_experts"] * 2 if tokens <= 8 else ["grouped_experts"] * 2)
    calls.clear()
    layers.route_to_experts(x, idx, w, first, down, act, acc, grouped=39)  # past the limit: torch's path
    layers.route_to_experts(x[:0], idx[:0], w[:0], first, down, act, acc)  # 0: never, not even empty
    assert calls == (["grouped_experts"] * 2 if tokens <= 39 else [])
    calls.clear()
    empty = layers.route_to_experts(x[:0], idx[:0], w[:0], first, down, act, acc, grouped=40)  # the op's 0 rows
    assert empty.shape == (0, H) and calls == ["grouped_experts"] * 2


def test_a_moe_model_declares_grouped_shapes():
    from kvbuffer.autotune.models import preset_gemv_shapes

    shapes = preset_gemv_shapes("nemotron-3-nano")
    grouped = [s for s in shapes if s["family"] == "grouped"]
    assert grouped == [{"family": "grouped", "N": 1856, "K": 2688, "dtype": "bfloat16"},
                       {"family": "grouped", "N": 2688, "K": 1856, "dtype": "bfloat16"}]
    assert {(s["N"], s["K"]) for s in shapes if s["family"] == "experts"} == {(s["N"], s["K"]) for s in grouped}


def test_tuner_times_an_uneven_load_and_checks_it_in_fp64():
    """The grouped template's timed inputs give experts different row counts (some past a row block of 32,
    where the configs differ), and its fp64 reference is the op's product on them."""
    from kvbuffer.autotune.registry import templates
    from kvbuffer.kernels.gemv import grouped_counts

    (template,) = [t for t in templates("grouped") if t.name == "grouped_experts"]
    shape = {"family": "grouped", "N": 40, "K": 64, "dtype": "float32"}
    args = template.make_inputs(shape, 1, 16, "cpu", torch.Generator().manual_seed(0))
    counts = grouped_counts()
    assert max(counts) > 32 > min(counts) and args["ends"].tolist() == torch.tensor(counts).cumsum(0).tolist()
    want = template.reference(shape, 16, args)["out"]
    got = torch.ops.kvbuffer.grouped_experts(args["x"], args["weight"], args["ends"])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
