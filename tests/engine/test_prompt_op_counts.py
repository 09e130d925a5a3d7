"""How many device ops and host syncs one prompt piece's forward asks for, counted on the CPU through the
kernel Backend's code path (tests/support/op_counts.py): upper bounds per layer kind, so that a change that
adds launches or a read-back to the prompt path shows here.

The tiny 9B-shaped (qwen3_5) and Nano-shaped (nemotron_h) models in bf16, as served on CUDA, with the
short conv on its op, the prompt's attention on each backend's stand-ins (cuDNN, as on Hopper: one call
fresh, two and their merge after a cached prefix; FlashAttention-2) and the RMS norms counted as CUDA
fuses them. A piece that ends on a flush
point (fill 0, whole chunks: what every piece but a prompt's last is) and a last piece (after a buffered
fill, a rest shorter than C left as verify chunks), one row and three. Bounds are per layer: the linear
layers' Backend.prefill ("prompt path"), each linear mixer in all, each attention mixer, the forward.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.op_counts import OpCounter, count_prompt_piece, mixer_scopes
from tests.support.tiny_models import tiny_model

# (kind, piece) -> (prompt path, linear mixer, attention mixer, forward): ops at most, per prompt backend
BOUNDS = {
    "cudnn": {
        ("qwen3_5", "whole chunks"): (19, 30, 31, 212),
        ("qwen3_5", "last piece"): (37, 47, 52, 293),
        ("nemotron_h", "whole chunks"): (6, 19, 12, 77),
        ("nemotron_h", "last piece"): (22, 33, 30, 129),
    },
    "flash": {
        ("qwen3_5", "whole chunks"): (19, 30, 32, 213),
        ("qwen3_5", "last piece"): (37, 47, 40, 281),
        ("nemotron_h", "whole chunks"): (6, 19, 12, 77),
        ("nemotron_h", "last piece"): (22, 33, 18, 117),
    },
}
PIECES = {"whole chunks": (256, 0), "last piece": (100, 5)}  # tokens, fill (C = 16)
ATTENTION_READBACKS = 0  # the prompt attention slices its rows from ForwardBatch.host_slots / host_cached


@pytest.mark.parametrize("backend", list(BOUNDS))
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind,piece", list(BOUNDS["cudnn"]), ids=lambda v: str(v).replace(" ", "-"))
def test_prompt_piece_ops_and_syncs_stay_within_bounds(kind, piece, rows, backend):
    tokens, fill = PIECES[piece]
    counter = count_prompt_piece(kind, tokens, fill, rows=rows, dtype=torch.bfloat16, prompt_backend=backend)
    layers = {k: len(v) for k, v in mixer_scopes(tiny_model(kind)).items()}
    per_layer = {
        "prompt path": counter.ops["linear_attention.prefill"] / layers["linear_attention"],
        "linear mixer": counter.total(prefix="linear_attention") / layers["linear_attention"],
        "attention mixer": counter.ops["full_attention"] / layers["full_attention"],
        "forward": counter.total(),
    }
    for (name, got), bound in zip(per_layer.items(), BOUNDS[backend][kind, piece]):
        assert got <= bound, f"{name}: {got} ops, bound {bound} ({counter.calls})"
    assert counter.total("syncs", "linear_attention") == 0, dict(counter.syncs)
    assert counter.total("syncs", "rest") == 0, dict(counter.syncs)
    assert counter.total("syncs", "full_attention") <= ATTENTION_READBACKS * layers["full_attention"], \
        dict(counter.syncs)


def test_counter_sees_read_backs_uploads_and_value_shapes():
    x = torch.randn(6, 4)
    counter = OpCounter()
    with counter:
        with counter.scoped("a"):
            y = (x * 2).relu().t().contiguous()
            float(y.sum()), y.tolist(), y.cpu()
        with counter.scoped("b"):
            x[x > 0], torch.nonzero(x), torch.tensor([1, 2]), torch.repeat_interleave(torch.arange(3))
    assert counter.ops["a"] == 5 and counter.views["a"] == 1  # mul, relu, contiguous's copy, sum, the read; t
    assert counter.syncs["a"] == {"_local_scalar_dense.default": 1, ".tolist()": 1, ".cpu()": 1}
    assert counter.syncs["b"] == {"boolean index": 1, "nonzero.default": 1, "upload of host data": 1,
                                  "repeat_interleave without output_size": 1}


def test_counter_counts_a_custom_op_once_and_not_its_reference():
    import kvbuffer.kernels.torch_ops  # noqa: F401  (registers torch.ops.kvbuffer.*)

    state, slots = torch.randn(3, 2, 5), torch.tensor([2, 0], dtype=torch.int32)
    counter = OpCounter()
    with counter:
        torch.ops.kvbuffer.conv1d_update(torch.randn(2, 4, 2), state, slots, torch.randn(2, 3), None, "advance", True)
    assert counter.calls["rest"]["conv1d_update"] == 1 and counter.total("syncs") == 0, (counter.calls, counter.syncs)


def test_prompt_batches_carry_their_rows_on_the_host():
    """Every eager prompt forward's ForwardBatch has its slots and cached as host lists, equal to the device's;
    decode forwards have none."""
    from kvbuffer import LLM

    model = tiny_model("qwen3_5")
    llm = LLM(model, device="cpu", chunk_size=4, max_batch=2, max_prefill_tokens=6)
    seen, forward = [], model.forward

    def watched(ids, batch, caches, **kw):
        seen.append((batch.phase, batch.host_slots, batch.host_cached, batch.slots.tolist(), batch.cached.tolist()))
        return forward(ids, batch, caches, **kw)
    model.forward = watched
    llm.generate([list(range(3, 20)), list(range(40, 49))], max_new_tokens=2)
    prompts = [s for s in seen if s[0] == "prefill"]
    assert len(prompts) >= 3 and any(any(c) for *_, c in prompts)  # pieces after the first have cached tokens
    for _, host_slots, host_cached, slots, cached in prompts:
        assert (host_slots, host_cached) == (slots, cached)
    assert all(s[1] is None for s in seen if s[0] == "decode")


def test_counter_records_each_ops_operands_when_asked():
    x = torch.randn(4, 6).bfloat16()
    counter = OpCounter(operands=True)
    with counter:
        (x[:, :3] * 2).float()
    assert counter.signatures["rest"] == {"mul(bf16[4, 3]s) -> bf16[4, 3]c": 1,
                                          "_to_copy(bf16[4, 3]c) -> f32[4, 3]c": 1}
    assert not OpCounter().signatures
