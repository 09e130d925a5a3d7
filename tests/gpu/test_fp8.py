"""FP8 projections on CUDA (kvbuffer.models.quant): which torch._scaled_mm scalings this torch serves
(printed: run with -s), each FP8 GEMM path against its emulation in fp64 (activations quantized the same
way, weights dequantized) within the output's bf16 rounding and against the dequantized product within
FP8's activation error; and FP8 checkpoints of both families through the engine (CUDA graphs, compile,
both modes) against their dequantized models: logits within FP8 tolerance, greedy tokens equal but for
near ties. A one-token forward's FP8 projections run on the FP8 one-row kernel.
"""

import pytest
import torch

from kvbuffer import LLM, ops
from kvbuffer.kernels.keys import fp8_gemv_fits
from kvbuffer.models.layers import one_row_linears
from kvbuffer.models.quant.fp8 import (FP8, FP8_MAX, GROUP, K_BLOCKS, dequantize, device_support, fp8_linear,
                                       gemm_path, quantize, quantize_activations)
from kvbuffer.models.quant.linear import FP8Linear, FP8PackedLinear
from kvbuffer.models.quant.write import dequantize_checkpoint, write_checkpoint
from tests.support.tiny_models import CONFIGS, tiny_model

pytestmark = pytest.mark.gpu

ROUNDING = 4e-3  # relative (norm) error of a bf16 output against its fp64 emulation
ACTIVATION = 4e-2  # relative (norm) error FP8 activations add against the dequantized product
SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288), (1024, 2688), (256, 128)]  # (N, K)
ROWS = [1, 7, 256]

# multiples of 128 everywhere, and of 512 in the hidden and intermediate sizes, so that block FP8 takes the
# block-wise GEMM where this torch has it (fp8.K_BLOCKS)
QWEN_128 = dict(CONFIGS["qwen3_5"], hidden_size=512, intermediate_size=512, num_attention_heads=4, head_dim=64,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128)
NEMOTRON_16 = dict(CONFIGS["nemotron_h"], hidden_size=512, intermediate_size=512, mamba_head_dim=32,
                   layers_block_type=["mamba", "moe", "attention", "mamba", "mlp"])


def _rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


def test_device_support_is_reported(capsys):
    rowwise, blockwise = device_support(torch.device("cuda"))
    with capsys.disabled():
        print(f"\n{torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name()}: "
              f"row-wise _scaled_mm {rowwise}, block-wise _scaled_mm {blockwise}")
    assert rowwise == (torch.cuda.get_device_capability() >= (8, 9))


def _weight(N, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(N, K, generator=g, device="cuda") * K ** -0.5, torch.randn(max(ROWS), K, generator=g, device="cuda")


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_rowwise_gemm_against_its_emulation(N, K, rows):
    if not device_support(torch.device("cuda"))[0]:
        pytest.skip("no FP8 tensor cores here")
    w, x = _weight(N, K, N + K)
    x = x[:rows].bfloat16()
    q, s = quantize(w, (N, K))
    scale = s.reshape(1, 1).expand(N, 1).contiguous()
    input_scale = x.float().abs().max() / FP8_MAX
    lin = FP8Linear(q, scale, (1, K), input_scale)
    assert lin.path(x) == "rowwise"
    y = torch.full((rows, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    y.copy_(lin(x))
    xq = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).double() * input_scale.double()
    w64 = dequantize(q, scale, (1, K), torch.float64)
    assert _rel(y, xq @ w64.t()) <= ROUNDING
    assert _rel(y, x.double() @ w64.t()) <= ACTIVATION


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_blockwise_gemm_against_its_emulation(N, K, rows):
    rowwise, blockwise = device_support(torch.device("cuda"))
    w, x = _weight(N, K, N * K)
    x = x[:rows].bfloat16()
    q, s = quantize(w, (GROUP, GROUP))
    lin = FP8Linear(q, s, (GROUP, GROUP))
    blockwise = blockwise and K % (GROUP * K_BLOCKS) == 0
    assert lin.path(x) == ("blockwise" if blockwise else "dequantize")
    y = lin(x)
    w64 = dequantize(q, s, (GROUP, GROUP), torch.float64)
    if blockwise:
        xq, xs = quantize_activations(x)
        assert _rel(y, dequantize(xq, xs, (1, GROUP), torch.float64) @ w64.t()) <= ROUNDING
    assert _rel(y, x.double() @ w64.t()) <= ACTIVATION


def test_other_sizes_and_dtypes_dequantize():
    support = device_support(torch.device("cuda"))
    q, s = quantize(torch.randn(100, 128, device="cuda"), (GROUP, GROUP))
    x = torch.randn(3, 128, device="cuda", dtype=torch.bfloat16)
    assert gemm_path(x, q, (GROUP, GROUP), None, support) == "dequantize"  # N = 100
    q2, _ = quantize(torch.randn(128, 256, device="cuda"), (GROUP, GROUP))
    assert gemm_path(x.new_ones(3, 256), q2, (GROUP, GROUP), None, support) == "dequantize"  # K / 128 = 2
    q, s = quantize(torch.randn(128, 128, device="cuda"), (GROUP, GROUP))
    assert gemm_path(x.float(), q, (GROUP, GROUP), None, support) == "dequantize"  # fp32 activations
    y = fp8_linear(x.float(), q, s, (GROUP, GROUP), support=support)
    torch.testing.assert_close(y, x.float() @ dequantize(q, s, (GROUP, GROUP)).t())


def test_moving_a_model_keeps_fp8_and_learns_the_device(tmp_path):
    path = write_checkpoint(_model("qwen3_5", QWEN_128), QWEN_128, tmp_path / "fp8", "block")
    llm = LLM(path, device="cuda", kernels=False)
    fp8 = [m for m in llm.model.modules() if isinstance(m, FP8Linear)]
    assert fp8 and all(m.weight.is_cuda and m.weight.dtype == FP8 and m.weight_scale.dtype == torch.float32 for m in fp8)
    assert all(m.support == device_support(torch.device("cuda")) for m in fp8)


def _model(kind, config, seed=0):
    base = CONFIGS[kind]
    return tiny_model(kind, seed=seed, **{k: v for k, v in config.items() if base.get(k) != v})


CASES = [("qwen3_5", QWEN_128, "block"), ("qwen3_5", QWEN_128, "modelopt"), ("nemotron_h", NEMOTRON_16, "modelopt"),
         ("nemotron_h", NEMOTRON_16, "block")]


@pytest.fixture(scope="module")
def jit():
    ops.allow_jit(True)
    yield
    ops.allow_jit(None)


def _generate(llm, prompts):
    return (llm.generate(prompts, max_new_tokens=8, return_logits=True)
            + llm.generate(prompts[1:2], max_new_tokens=8, return_logits=True))


@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
@pytest.mark.parametrize("kind, config, fmt", CASES, ids=[f"{k}-{f}" for k, _, f in CASES])
def test_fp8_checkpoint_through_the_engine(tmp_path, jit, kind, config, fmt, mode):
    """Default engine options (kernels, CUDA graphs, compile where they resolve so) with bf16 activations,
    as the published checkpoints run, against the dequantized model run the same way in bf16: at each
    position the logits' error is within 2 x FP8's activation error, or within 2 x the error of the same
    FP8 checkpoint on the reference ops (kernels=False, no kernels) at that position or an earlier one,
    whichever is larger: through the layers of a random model, quantized activations alone move the logits
    by more than one projection's error, and the kernels' run has an FP8 error of its own of that size (its
    one-row decode projections do not quantize x), so it may sit on the far side of the dequantized model. Greedy tokens equal up to the first near tie; a lone
    prompt too, whose decode steps run the FP8 projections on the one-row kernel (it takes bf16 / fp16
    activations, not the tiny model's fp32)."""
    path = write_checkpoint(_model(kind, config), config, tmp_path / "fp8", fmt)
    reference = dequantize_checkpoint(path, tmp_path / "dequantized")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 9, 40)]
    llm = LLM(path, device="cuda", mode=mode, dtype=torch.bfloat16)
    assert any(isinstance(m, (FP8Linear, FP8PackedLinear)) for m in llm.model.modules())
    fp8 = [m for m in llm.model.modules() if isinstance(m, FP8Linear) and m.bias is None]
    assert fp8 and all(m.one_row for m in fp8 if fp8_gemv_fits(m.in_features, m.block, "bfloat16"))
    assert not any(isinstance(m, (FP8Linear, FP8PackedLinear)) for m in one_row_linears(llm.model))
    got = _generate(llm, prompts)
    plain = _generate(LLM(path, device="cuda", mode=mode, dtype=torch.bfloat16, kernels=False), prompts)
    want = _generate(LLM(reference, device="cuda", mode=mode, dtype=torch.bfloat16), prompts)
    for a, p, b in zip(got, plain, want):
        bound = 2 * ACTIVATION
        for i, (la, lb) in enumerate(zip(a.logits, b.logits)):
            if p.token_ids[:i] == b.token_ids[:i]:  # the reference ops' run saw the same tokens (else: its last bound)
                bound = max(bound, 2 * _rel(p.logits[i].float(), lb.double()))
            assert _rel(la.float(), lb.double()) <= bound, (i, _rel(la.float(), lb.double()), bound)
            if a.token_ids[i] != b.token_ids[i]:  # a near tie: the two best of the reference within that error
                top = torch.topk(lb.float(), 2).values
                assert float(top[0] - top[1]) <= bound * float(lb.float().abs().max())
                break
