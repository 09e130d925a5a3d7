"""Argument checks for the engine's config and `LLM.generate(...)`, run before anything is loaded.

Each raises TypeError/ValueError naming the argument and what it expects (bools are not counts,
NaN is not a temperature), so a rejected call leaves the engine as it was.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Collection

SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes a 64-bit seed; the engine adds the prompt index


def is_int(value) -> bool:
    """An integer that is not a bool: True is an int to Python but never a count to a user."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def describe(value) -> str:
    return f"{type(value).__name__} {value!r}"


def check_int(name: str, value, low: int, high: int | None = None, *, optional: bool = False) -> None:
    """`value` is an int in [low, high] (None allowed when optional)."""
    if value is None and optional:
        return
    if not is_int(value):
        raise TypeError(f"{name} must be an int{' or None' if optional else ''}, got {describe(value)}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def check_finite(name: str, value) -> None:
    """`value` is a finite real number (ints and floats, not bools)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {describe(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def check_switch(name: str, value) -> None:
    """True, False or "auto"; `1 in (True, False)` holds, so compare by identity."""
    if not (value is True or value is False or (isinstance(value, str) and value == "auto")):
        raise ValueError(f"{name} must be True, False or 'auto', got {describe(value)}")


def check_seed(seed) -> None:
    """None, or a Python int that torch.Generator.manual_seed takes (it refuses numpy ints)."""
    if seed is not None and not isinstance(seed, int):
        raise TypeError(f"seed must be a Python int or None, got {describe(seed)}")
    check_int("seed", seed, 0, SEED_LIMIT - 1, optional=True)


def check_device(device) -> None:
    """None, or a CPU or CUDA device that exists on this machine."""
    if device is None:
        return
    import torch  # here, not at import: the CLI builds its options from the engine's config without torch

    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device such as 'cpu' or 'cuda:0', got {describe(device)}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asks for CUDA, but torch sees no CUDA GPU here; use device='cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def device_memory(device) -> int:
    """Total bytes of memory on `device` (None: the engine's default device)."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_generate_args(prompts, *, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, return_logits,
                        on_token, vocab_size: int) -> None:
    """Raise TypeError/ValueError naming the first bad `generate(...)` argument (the vocabulary
    range of prompt tokens is the engine's encoder's to check)."""
    check_int("max_new_tokens", max_new_tokens, 1)
    check_finite("temperature", temperature)
    check_int("top_k", top_k, 0)
    check_finite("top_p", top_p)
    check_seed(seed)
    if stop_token_ids is not None:
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Collection):
            raise TypeError(f"stop_token_ids must be a list of token ids or None, got {describe(stop_token_ids)}")
        for t in stop_token_ids:
            check_int("stop_token_ids entry", t, 0, vocab_size - 1)
    if not isinstance(return_logits, bool):
        raise TypeError(f"return_logits must be True or False, got {describe(return_logits)}")
    if on_token is not None and not callable(on_token):
        raise TypeError(f"on_token must be a callable(index, token_id) or None, got {describe(on_token)}")
    _check_prompt_tokens(prompts)


def _check_prompt_tokens(prompts) -> None:
    """Token-id prompts hold ints: int(3.7) would silently feed token 3."""
    import torch

    if isinstance(prompts, list) and prompts and isinstance(prompts[0], numbers.Number):
        prompts = [prompts]  # one prompt given as a flat list of token ids
    if not isinstance(prompts, (list, tuple)):
        return  # a single string, or something the encoder rejects with its own message
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            if p.is_floating_point() or p.is_complex() or p.dtype == torch.bool or p.dim() > 1:
                raise TypeError(f"prompt {i} must be a 1-D integer tensor of token ids, got {p.dtype} {tuple(p.shape)}")
        elif isinstance(p, (list, tuple)):
            for t in p:
                if not is_int(t):
                    raise TypeError(f"prompt {i} has token id {describe(t)}; token ids must be ints")
        elif not isinstance(p, str):
            raise TypeError(f"prompt {i} must be a string or a list of token ids, got {describe(p)}")
