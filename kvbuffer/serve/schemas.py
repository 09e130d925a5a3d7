"""The OpenAI request bodies kvbuffer accepts, checked by pydantic: a field kvbuffer does not know is
an error (HTTP 400 naming it), never silently ignored, and values are never coerced (strict mode):
an int field takes only JSON integers (not `true`, `1.0` or `"1"`), a float field JSON numbers, a
bool field only `true`/`false`, a token-id prompt only integers. Sampling values that pass here are
checked again by SamplingParams (the engine's rules, such as the smallest temperature) when the
request is built."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints. Some are not in OpenAI's API but in vLLM's: top_k (0 or -1 = off),
    repetition_penalty (1 = off), skip_special_tokens (special tokens left out of the text, default on)
    and ignore_eos (generate max_tokens whatever the model says, for benchmarks)."""
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    skip_special_tokens: bool = True
    stop: Union[str, list[Union[str, int]], None] = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list):
            if len(v) > 16:
                raise ValueError("at most 16 stop sequences")
            if any(isinstance(s, int) and s < 0 for s in v):
                raise ValueError("stop token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if isinstance(s, str)]

    def stop_token_ids(self) -> list[int]:
        return [s for s in self.stop if isinstance(s, int)] if isinstance(self.stop, list) else []


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=1)  # only the sampled token's is cheap

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict]]
    name: str | None = None

    def text(self) -> str:
        """The message's text (content parts of type "text" joined)."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only content parts of type 'text' are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=0)  # only the sampled token's is cheap
