"""Chat messages -> prompt text: the checkpoint tokenizer's chat template, else a plain fallback.

The fallback (for tokenizers without a template, such as the demo model's byte tokenizer) writes
each message as "<role>: <content>" on its own line and ends with "assistant: ", the cue for the
model to answer. It is documented in the README, so that users know what the model sees.
"""

from __future__ import annotations

FALLBACK_TEMPLATE = "{role}: {content}\n"
FALLBACK_CUE = "assistant: "


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """messages: [{"role": ..., "content": text}]; returns the text to encode."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(FALLBACK_TEMPLATE.format(**m) for m in messages) + FALLBACK_CUE
