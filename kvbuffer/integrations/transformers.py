"""Buffered decoding for Hugging Face transformers' hybrid models, with `generate` called as before.

    import kvbuffer.integrations.transformers as kvb
    model = kvb.enable(AutoModelForCausalLM.from_pretrained(...), chunk_size=16)
    out = model.generate(ids, max_new_tokens=64)        # greedy, sampling, batched, a reused cache=
    kvb.disable(model)

Supported: `Qwen3_5ForCausalLM`, `Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForCausalLM`
(their Gated DeltaNet layers), `Qwen3NextForCausalLM` (its own GDN class) and `NemotronHForCausalLM`
(Mamba-2 mixers); tested with transformers 5.17 and 5.24, whose caches expose the linear-attention
states differently (transformers_cache reads either; docs/integrations.md on versions).

Each linear-attention layer's forward is replaced on that instance by kvbuffer's (see
transformers_layers), which is what transformers' `kernelize` does for a layer named in a kernel
mapping. It is done here directly: `kernelize` needs the `kernels` package and a kernel repository,
and only the Qwen3.5 GDN classes carry a `use_kernel_forward_from_hub` name; Qwen3-Next's GDN and
Nemotron-H's mixer carry none, so they are served the same way.
Prefill stays transformers' own (FLA / mamba_ssm when installed); decode steps run
`torch.ops.kvbuffer.*_buffered_step`: the pure-torch reference on CPU, the compiled kernels on CUDA
(bf16 or fp16 models; `kvbuffer tune --model M --chunk-sizes C`, or `KVBUFFER_JIT=1`).

The buffers live on the cache object (`cache.kvbuffer_buffers`); the cache's recurrent states then
lag by the buffered tokens. Before handing a cache to code that reads those states directly (or
after `disable` on a cache you keep using), call `fold(cache)`. Beam search reorders the cache's
states under kvbuffer's buffers and is refused with a ValueError.
"""

from __future__ import annotations

import types

import torch

import kvbuffer.ops  # noqa: F401  (registers torch.ops.kvbuffer.*)

from .transformers_cache import access_for
from .transformers_layers import (
    CHUNK_ATTRIBUTE,
    BufferedGatedDeltaNet,
    BufferedMamba2Mixer,
    buffer_bytes,
    check_buffer_memory,
)
from .transformers_layers import fold_cache as fold

__all__ = ["enable", "disable", "fold", "enabled_layers"]


def _layer_classes() -> dict[type, type]:
    """transformers' linear-attention layer classes -> kvbuffer's forward for them.

    The forwards read the layered cache's linear-attention states (transformers_cache); a release
    whose `Cache` has neither of the spellings it knows (those before the layered cache kept
    per-model `cache_params.conv_states[i]`) is refused here with an ImportError, not decoded wrongly.
    """
    from transformers.cache_utils import Cache

    access_for(Cache)
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    return {Qwen3_5GatedDeltaNet: BufferedGatedDeltaNet, Qwen3_5MoeGatedDeltaNet: BufferedGatedDeltaNet,
            Qwen3NextGatedDeltaNet: BufferedGatedDeltaNet, NemotronHMamba2Mixer: BufferedMamba2Mixer}


def _check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def enabled_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's linear-attention layers that decode through kvbuffer; TypeError for a non-module."""
    _check_model(model)
    return [m for m in model.modules() if hasattr(m, CHUNK_ATTRIBUTE)]


def enable(model: torch.nn.Module, *, chunk_size: int = 16) -> torch.nn.Module:
    """Make `model`'s linear-attention layers decode through kvbuffer's buffered ops; returns `model`.

    chunk_size (C): buffered tokens folded into the state at once (the buffers hold C + 1 entries);
    call `enable` again between generations to change it. TypeError for a model with no supported layer;
    ValueError, naming chunk_size, where one sequence's buffers would not fit in the model device's free
    memory (a batch's buffers are checked again when a generation makes them).
    """
    _check_model(model)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    table = _layer_classes()
    layers = [(m, table[type(m)]) for m in model.modules() if type(m) in table]
    if not layers:
        raise TypeError(f"model ({type(model).__name__}) has no Gated DeltaNet or Mamba-2 layer kvbuffer supports "
                        f"(supported layer classes: {', '.join(sorted(c.__name__ for c in table))})")
    param = next(model.parameters())
    check_buffer_memory(sum(buffer_bytes(buffered.heads(m), param.dtype, chunk_size) for m, buffered in layers),
                        chunk_size, param.device)
    for module, buffered in layers:
        module.forward = types.MethodType(buffered.forward, module)
        setattr(module, CHUNK_ATTRIBUTE, chunk_size)
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Give the layers back their own forward; returns `model`. Fold kept caches first (`fold`)."""
    _check_model(model)
    for module in enabled_layers(model):
        del module.forward
        delattr(module, CHUNK_ATTRIBUTE)
    return model

