"""The engine's configuration: one frozen dataclass, validated once, from which the CLI's engine
options are generated (kvbuffer.cli.engine_options).

Each field carries its default, a help text and its check in its metadata; `LLM(model, config)` and
`LLM(model, **kwargs)` build the same `EngineConfig`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..defaults import DEFAULT_CHUNK_SIZE, MAX_DRAFT_TOKENS, MODES
from .validate import check_device, check_int, check_switch, describe, device_memory, is_int

METHODS = ("ngram", "mtp")
DTYPES = ("float32", "bfloat16", "float16")


def _option(default, help: str, check=None, *, cli: str | None = None, kind: str = "int", **more):
    """A config field: `cli` is its option name (None: not on the command line); `kind` says how the
    command line spells its value: int, str, choice (more["choices"]), switch or dtype."""
    return field(default=default, metadata=dict(help=help, check=check, cli=cli, kind=kind, **more))


def _count(low: int, optional: bool = False):
    return lambda name, value: check_int(name, value, low, optional=optional)


def _budget(name, value):
    if value is not None:  # "must be an int": None is the default, not an alternative worth naming
        check_int(name, value, 1)


def _choice(choices):
    def check(name, value):
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return check


def _dtype(name, value):
    import torch  # here, not at import: the CLI builds its options from this module without loading torch

    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.bfloat16, or None; got {describe(value)}")


def _unbuffered_rows(name, value):
    if value != "auto":
        check_int(name, value, 0)


def _check_fields(obj, prefix: str = "") -> None:
    for f in fields(obj):
        if f.metadata.get("check") is not None:
            f.metadata["check"](prefix + f.name, getattr(obj, f.name))


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: `method` drafts `num_draft_tokens` per step, verified in one forward."""

    method: str = _option(None, "Speculative decoding: n-gram prompt lookup, or the checkpoint's MTP head.",
                          cli="--speculative", kind="choice", choices=METHODS)
    num_draft_tokens: int = _option(4, "Draft tokens per step with --speculative.", cli="--draft-tokens")
    ngram_max: int = _option(3, "Longest suffix the n-gram drafter tries to match.")
    ngram_min: int = _option(1, "Shortest suffix the n-gram drafter tries to match.")
    disable_above_batch: int | None = _option(
        None, "With --speculative ngram: steps with more running requests decode plainly (a verify's GEMMs turn "
              "compute-bound at large batch, where speculating costs more than it saves).",
        cli="--disable-speculation-above")

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_draft_tokens", "ngram_max", "ngram_min"):
            value = getattr(self, name)
            if not is_int(value):
                raise TypeError(f"speculative {name} must be an int, got {describe(value)}")
        limit = self.disable_above_batch
        if limit is not None and not is_int(limit):
            raise TypeError(f"speculative disable_above_batch must be an int or None, got {describe(limit)}")
        if limit is not None and limit < 1:
            raise ValueError(f"speculative disable_above_batch must be >= 1, got {limit}")
        if limit is not None and self.method == "mtp":
            raise ValueError("speculative disable_above_batch needs method 'ngram': the MTP head drafts from "
                             "every step's hidden states, which a plain decode step does not keep")
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"speculative ngram sizes need 1 <= ngram_min <= ngram_max, got "
                             f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}")

    @classmethod
    def from_dict(cls, d: Mapping | None) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, or a dict with at least method and num_draft_tokens."""
        if d is None or isinstance(d, cls):
            return d
        if not isinstance(d, Mapping):
            raise TypeError(f"speculative must be a dict such as {{'method': 'ngram', 'num_draft_tokens': 4}} "
                            f"or None, got {describe(d)}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown speculative options {sorted(unknown, key=str)}")
        missing = {"method", "num_draft_tokens"} - set(d)
        if missing:
            raise ValueError(f"speculative lacks {sorted(missing)}")
        return cls(**d)

    @property
    def fed(self) -> int:
        """Tokens a verify feeds per request: the real one and the drafts."""
        return self.num_draft_tokens + 1


@dataclass(frozen=True)
class EngineConfig:
    """How `LLM` builds its engine; every field is checked when the config is made."""

    device: Any = _option(None, "cpu, cuda, cuda:1 ... (default: cuda when available).",
                          lambda name, value: check_device(value), cli="--device", kind="str")
    dtype: Any = _option(None, "Weights' dtype (default: the checkpoint's).", _dtype, cli="--dtype", kind="dtype")
    mode: str = _option("kvbuffer", "kvbuffer (buffered linear layers) or recurrent (today's servers' scheme).",
                        _choice(MODES), cli="--mode", kind="choice", choices=MODES)
    chunk_size: int | None = _option(
        None, f"Buffer entries folded into the state per flush (C) [default: the tuned policy, else "
              f"{DEFAULT_CHUNK_SIZE}].", _count(1, optional=True), cli="--chunk-size")
    max_batch: int = _option(16, "Requests decoded together (request slots).", _count(1), cli="--max-batch")
    max_states: int | None = _option(
        None, "Recurrent state slots [default: max_batch]; requests wait for one when all are taken.",
        _count(1, optional=True), cli="--max-states")
    max_len: int = _option(2048, "Longest context (prompt + output) per request; a request that reaches it stops "
                                 "there with finish_reason 'length'.", _count(1), cli="--max-len")
    max_prefill_tokens: int = _option(
        2048, "Prompt tokens one engine step feeds, shared among the prompts in progress (a longer prompt "
              "continues over the next steps while the other requests decode; with none decoding, a step feeds "
              "until a prompt is done); also the most one prefill forward feeds.", _count(1),
        cli="--max-prefill-tokens")
    prefill_tokens_while_decoding: int | None = _option(
        None, "Prompt tokens one engine step feeds while other requests decode [default: max_prefill_tokens, "
              "which it may not exceed]: fewer keep the decoding streams' gaps between tokens short while a long "
              "prompt is read, at the cost of that prompt's time to first token.", _count(1, optional=True),
        cli="--prefill-tokens-while-decoding")
    speculative: SpeculativeConfig | None = _option(None, "Speculative decoding (SpeculativeConfig or its dict).",
                                                    kind="nested")
    memory_budget: int | None = _option(None, "Bytes for the per-request caches: as many requests as fit are "
                                              "admitted (overrides max_batch and max_states).", _budget,
                                        cli="--memory-budget")
    kernels: bool | str = _option(
        "auto", "Run the linear layers on the compiled kernels: true, false (the reference ops) or auto (on CUDA "
                "where every kernel needed loads).", check_switch, cli="--kernels", kind="switch", bare=True)
    cuda_graphs: bool | str = _option(
        "auto", "Replay decode steps as CUDA graphs: auto (on CUDA with the compiled kernels; also the flag "
                "alone), true or false.", check_switch, cli="--cuda-graphs", kind="switch", bare="auto")
    compile: bool | str = _option(
        "auto", "Run the decode and verify forwards under torch.compile (a faster step; its first use compiles, "
                "from seconds to a minute for a large model, said on one line), and on CUDA a prompt's elementwise "
                "work as compiled regions: auto (on CUDA with CUDA graphs), true (also the flag alone) or false.",
        check_switch, cli="--compile", kind="switch", bare=True)
    overlap: bool | str = _option(
        "auto", "Queue each decode step before reading the last one's tokens back: true, false or auto (on CUDA).",
        check_switch, cli="--overlap", kind="switch", bare=True)
    unbuffered_rows: int | str = _option(
        "auto", "Decode steps of at most this many rows step the recurrence unbuffered (auto: the tuning record's "
                "choice on the kernels, else 0).", _unbuffered_rows)
    gemv: bool | str = _option(
        "auto", "One-token forwards' projections and routed experts' few-token ones on kvbuffer's one-row kernels: "
                "true, false or auto (with the compiled kernels, where each kernel loads).",
        check_switch, cli="--gemv", kind="switch", bare=True)

    def __post_init__(self):
        object.__setattr__(self, "speculative", SpeculativeConfig.from_dict(self.speculative))
        _check_fields(self)
        if (self.prefill_tokens_while_decoding or 0) > self.max_prefill_tokens:
            raise ValueError(f"prefill_tokens_while_decoding ({self.prefill_tokens_while_decoding}) must not exceed "
                             f"max_prefill_tokens ({self.max_prefill_tokens}), the most one prefill forward feeds")
        if self.memory_budget is not None:
            have = device_memory(self.device)
            if self.memory_budget > have:
                raise ValueError(f"memory_budget {self.memory_budget} B is more than the device has ({have} B)")

    @classmethod
    def from_kwargs(cls, config: "EngineConfig | None" = None, **kwargs) -> "EngineConfig":
        """`config` (default: the defaults) with the given fields replaced; TypeError for an unknown one."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option {unknown[0]!r}; options: {', '.join(sorted(names))}")
        if config is None:
            return cls(**kwargs)
        if not isinstance(config, cls):
            raise TypeError(f"config must be an EngineConfig or None, got {describe(config)}")
        return dataclasses.replace(config, **kwargs) if kwargs else config

    @property
    def decoding_prefill_tokens(self) -> int:
        """The prompt tokens a step feeds while other requests decode."""
        return self.prefill_tokens_while_decoding or self.max_prefill_tokens

    @property
    def fed(self) -> int:
        """Tokens a decode step feeds per request (1, or a verify's real token and drafts)."""
        return self.speculative.fed if self.speculative is not None else 1


def check_model(model) -> None:
    """LLM's `model`: a checkpoint directory or a kvbuffer model."""
    import torch

    if not isinstance(model, (str, os.PathLike, torch.nn.Module)):
        raise TypeError(f"model must be a checkpoint directory or a kvbuffer model, got {describe(model)}")
