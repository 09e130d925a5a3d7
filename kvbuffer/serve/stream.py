"""One choice's text as it streams: incremental detokenization, then stop strings."""

from __future__ import annotations

from ..detokenize import IncrementalDetokenizer, StopMatcher


class ChoiceText:
    """`push(token_ids) -> (text to send, stopped on a stop string)`; `finish() -> the rest`.
    skip_special_tokens: special tokens are left out of the text (IncrementalDetokenizer)."""

    def __init__(self, tokenizer, prompt_ids, stops, skip_special_tokens: bool = True):
        self.detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.stops = StopMatcher(stops)
        self.text = ""
        self.stopped = False

    def push(self, token_ids) -> str:
        if self.detok is None or self.stopped:
            return ""
        piece, self.stopped = self.stops.push("".join(self.detok.add(t) for t in token_ids))
        self.text += piece
        return piece

    def finish(self) -> str:
        if self.detok is None or self.stopped:
            return ""
        piece, self.stopped = self.stops.push(self.detok.flush())
        if not self.stopped:
            piece += self.stops.flush()
        self.text += piece
        return piece
