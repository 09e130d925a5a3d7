"""Argument checks for the engine's config and `LLM.generate(...)`, run before anything is loaded.

Each raises TypeError/ValueError naming the argument and what it expects (bools are not counts,
NaN is not a temperature), so a rejected call leaves the engine as it was.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Collection, Mapping

SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes a 64-bit seed; the engine adds the prompt index

# The smallest positive temperature (0 is greedy): logits / T stay finite for every |logit| below
# 3.4e36, where a tiny T (1e-40, or 1.2e-38, an ordinary fp32 value) overflows and leaves no distribution.
MIN_TEMPERATURE = 1e-2


def check_temperature(value) -> None:
    """A temperature: 0 (greedy) or a finite number >= MIN_TEMPERATURE; TypeError/ValueError naming it."""
    check_finite("temperature", value)
    if value != 0 and not value >= MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or a number >= {MIN_TEMPERATURE}, got {value!r}")


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


def free_memory(device) -> int:
    """Bytes that can still be allocated on `device` (None: the engine's default device): free memory
    on a CUDA device, MemAvailable on the host (free pages where /proc/meminfo is missing)."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_stop_ids(stop_token_ids, vocab_size: int | None = None) -> tuple[int, ...] | None:
    """stop_token_ids (None, or a list, tuple or set of token ids) as a tuple of ints: TypeError for
    anything else (a string, a dict, a generator, a float id), ValueError for an id outside [0, vocab_size)."""
    if stop_token_ids is None:
        return None
    if isinstance(stop_token_ids, (str, bytes, Mapping)) or not isinstance(stop_token_ids, Collection):
        raise TypeError(f"stop_token_ids must be a list of token ids or None, got {describe(stop_token_ids)}")
    for t in stop_token_ids:
        check_int("stop_token_ids entry", t, 0, None if vocab_size is None else vocab_size - 1)
    return tuple(int(t) for t in stop_token_ids)


def token_ids(prompt, what: str, expected: str = "a list of token ids") -> list[int]:
    """One prompt of token ids as a list of ints: a list or tuple of ints, or a 1-D integer tensor
    holding values (not on the meta device). TypeError naming `what` otherwise: int(3.7) would
    silently feed token 3, and a 0-d tensor is one number, not a prompt."""
    import torch

    if isinstance(prompt, torch.Tensor):
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool or prompt.dim() != 1:
            raise TypeError(f"{what} must be a 1-D integer tensor of token ids, got {prompt.dtype} "
                            f"{tuple(prompt.shape)}")
        if prompt.is_meta:
            raise TypeError(f"{what} is a tensor on the meta device, which holds no token ids")
        return prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"{what} must be {expected}, got {describe(prompt)}")
    if all(type(t) is int for t in prompt):  # the common case, checked at C speed: a long prompt's ids
        return list(prompt)
    for t in prompt:
        if not is_int(t):
            raise TypeError(f"{what} has token id {describe(t)}; token ids must be ints")
    return [int(t) for t in prompt]


def check_text(text: str, what: str) -> None:
    """ValueError naming `what` for a string that UTF-8 cannot hold: a lone surrogate (what a JSON
    "\\ud800" escape or a broken decode leaves), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid text: {text[e.start]!r} at index {e.start} is a lone surrogate; "
                         f"send UTF-8 text or token ids") from None


def check_generate_args(*, stop_token_ids, return_logits, on_token, vocab_size: int) -> None:
    """Raise TypeError/ValueError naming the first bad `generate(...)` argument that SamplingParams
    does not check (the prompts are checked as they are encoded)."""
    check_stop_ids(stop_token_ids, vocab_size)
    if not isinstance(return_logits, bool):
        raise TypeError(f"return_logits must be True or False, got {describe(return_logits)}")
    if on_token is not None and not callable(on_token):
        raise TypeError(f"on_token must be a callable(index, token_id) or None, got {describe(on_token)}")
