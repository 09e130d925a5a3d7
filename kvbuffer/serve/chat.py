"""Chat messages -> prompt text: the server's --chat-template, else the checkpoint tokenizer's chat
template, else a plain fallback.

The fallback (for tokenizers without a template, such as the demo model's byte tokenizer) writes
each message as "<role>: <content>" on its own line and ends with "assistant: ", the cue for the
model to answer. It is documented in the README, so that users know what the model sees.
"""

from __future__ import annotations

from pathlib import Path

FALLBACK_TEMPLATE = "{role}: {content}\n"
FALLBACK_CUE = "assistant: "


class ChatTemplate:
    """A Jinja chat template given to the server (as vLLM's --chat-template): rendered with
    transformers' apply_chat_template where the tokenizer has it, else in a Jinja sandbox with the
    same settings and variables (messages, add_generation_prompt, bos_token, eos_token)."""

    def __init__(self, text: str):
        self.text = text
        self.compiled = _compile(text)

    @classmethod
    def load(cls, value: str) -> "ChatTemplate":
        """--chat-template's value: a file's path (`~` expanded), or an inline template (it holds `{`
        or a newline). ValueError for a path that is no file, or a template that does not compile."""
        path = Path(value).expanduser()
        if path.is_file():
            return cls(path.read_text(encoding="utf-8"))
        if "{" in value or "\n" in value:
            return cls(value)
        raise ValueError(f"chat template {value!r} is not a file (nor an inline Jinja template)")

    def render(self, tokenizer, messages: list[dict]) -> str:
        """The prompt text; ValueError where the template fails on these messages."""
        try:
            if hasattr(tokenizer, "apply_chat_template"):
                return tokenizer.apply_chat_template(messages, chat_template=self.text, tokenize=False,
                                                     add_generation_prompt=True)
            return self.compiled.render(messages=messages, add_generation_prompt=True,
                                        bos_token=_token(tokenizer, "bos"), eos_token=_token(tokenizer, "eos"))
        except ValueError:
            raise
        except Exception as e:  # jinja2's errors (an undefined name, a bad filter) are the template's
            raise ValueError(f"chat template: {type(e).__name__}: {e}") from None


def _token(tokenizer, name: str) -> str:
    token = getattr(tokenizer, f"{name}_token", None)
    return token if isinstance(token, str) else ""


def _raise(message):
    raise ValueError(f"chat template: {message}")


def _compile(text: str):
    try:
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("a chat template needs jinja2: pip install jinja2") from e
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat template: line {e.lineno}: {e.message}") from None


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt(tokenizer, messages: list[dict], template: ChatTemplate | None = None) -> str:
    """messages: [{"role": ..., "content": text}]; returns the text to encode (`template` first, then
    the tokenizer's own, then the fallback)."""
    if template is not None:
        return template.render(tokenizer, messages)
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(FALLBACK_TEMPLATE.format(**m) for m in messages) + FALLBACK_CUE
