"""The glue of a decode step: how many torch ops a tiny model launches outside the linear mixers.

At serving batches a decode step pays for its small launches more than for their math (about
1,300 on a Qwen3.5-9B shape at batch 256), so their number is pinned here as an upper bound that a
change adding glue (a per-step cast of a parameter, a .contiguous() copy, a rotary table per
layer) trips. Counted on the CPU with torch.profiler: top-level aten ops of the model's forward,
leaving out views, casts that copy nothing and everything under the short conv and the linear
mixers (the reference ops here, the compiled kernels on CUDA). It is a proxy for CUDA launches:
there an RMS norm is one kernel, here transformers' formula is six ops.
"""

import functools

import pytest
import torch
from tests.support.tiny_models import tiny_model

from kvbuffer import LLM
from kvbuffer.models import layers
from kvbuffer.runtime import mixing

NEMOTRON_MOE = {"layers_block_type": ["mamba", "moe", "attention", "mamba", "mlp"], "n_group": 2, "topk_group": 1}
# top-level ops per decode step, measured when the glue was last trimmed (before: 268, 146, 182)
BOUNDS = {"qwen3_5": 243, "nemotron_h": 137, "nemotron_h+moe": 168}

NO_LAUNCH = {"view", "reshape", "_reshape_alias", "_unsafe_view", "transpose", "permute", "t", "split",
             "split_with_sizes", "chunk", "unbind", "select", "slice", "narrow", "alias", "expand", "as_strided",
             "unsqueeze", "squeeze", "detach", "detach_", "lift_fresh", "promote_types", "result_type", "empty",
             "empty_like", "empty_strided", "resolve_conj", "resolve_neg"}
COPY_IF_ANY = {"to", "reshape", "contiguous", "type_as", "float", "clone"}  # count only when they copy


def _labelled(label, fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return inner


def decode_ops(kind: str, monkeypatch, **overrides) -> int:
    """Top-level aten ops of one bf16 decode step of 4 rows, outside the short conv and the mixers."""
    for name in ("short_conv", "gated_delta_mix", "mamba2_mix"):
        monkeypatch.setattr(mixing, name, _labelled("MIXER", getattr(mixing, name)))
    llm = LLM(tiny_model(kind, **overrides), device="cpu", dtype=torch.bfloat16, max_batch=4, chunk_size=4,
              max_len=64)
    llm.model.forward = _labelled("MODEL", llm.model.forward)
    profiles, decode = [], llm.runner.decode

    def profiled(reqs):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = decode(reqs)
        profiles.append(prof)
        return out

    llm.runner.decode = profiled
    llm.generate([[1, 2, 3], [4, 5], [6], [7, 8, 9]], max_new_tokens=3)  # the last step decodes every row
    count = 0
    for e in profiles[-1].events():
        op = e.name.removeprefix("aten::")
        if op == e.name or op in NO_LAUNCH:
            continue
        if op in COPY_IF_ANY and not any(c.name.startswith("aten::") for c in e.cpu_children):
            continue
        parents, p = [], e.cpu_parent
        while p is not None:
            parents.append(p.name)
            p = p.cpu_parent
        if "MODEL" in parents and "MIXER" not in parents and not any(n.startswith("aten::") for n in parents):
            count += 1
    return count


@pytest.mark.parametrize("case", sorted(BOUNDS))
def test_decode_step_glue_is_bounded(case, monkeypatch):
    kind, _, moe = case.partition("+")
    count = decode_ops(kind, monkeypatch, **(NEMOTRON_MOE if moe else {}))
    assert count <= BOUNDS[case], f"{case}: {count} ops per decode step, bound {BOUNDS[case]} (new glue?)"
    assert count > BOUNDS[case] // 2, f"{case}: only {count} ops counted: is the profile still read right?"


def test_kept_fp32_parameters_follow_their_source():
    """layers.derived keeps 1 + w and fp32 copies across steps: an in-place write, a cast or a
    move of the parameter must show in the next forward."""
    norm = layers.RMSNorm(8, 1e-6, zero_centered=True)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        first = norm(x)
        with torch.no_grad():
            norm.weight.add_(0.5)
        torch.testing.assert_close(norm(x), layers.rms_normalize(x, 1e-6, torch.full((8,), 1.5)), rtol=0, atol=0)
        assert not torch.equal(norm(x), first)
        norm.to(torch.float64)
        assert norm(x.double()).dtype == torch.float64 and layers.fp32(norm, "weight").dtype == torch.float32
    # where autograd records, nothing is kept (a kept tensor would cut the graph)
    norm(x.double()).sum().backward()
    assert norm.weight.grad is not None


def test_rotary_with_the_sign_in_sin_equals_rotate_half():
    """apply_rotary's folded sign gives transformers' q * cos + rotate_half(q) * sin bit for bit, in bf16."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 4, 32, generator=gen).bfloat16()
    positions = torch.tensor([[5, 6], [0, 1], [900, 901]])
    cos, sin = layers.rotary_cos_sin(positions, 16, 10000.0, torch.bfloat16)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    emb = torch.cat([positions[..., None].float() * inv_freq] * 2, dim=-1)
    c, s = emb.cos().bfloat16()[:, :, None], emb.sin().bfloat16()[:, :, None]
    rot = q[..., :16]
    want = rot * c + torch.cat([-rot[..., 8:], rot[..., :8]], dim=-1) * s
    torch.testing.assert_close(layers.apply_rotary(q, cos, sin), torch.cat([want, q[..., 16:]], -1), rtol=0, atol=0)
