"""Incremental detokenization: text deltas for a stream of token ids, never a broken character.

Decoding one token at a time prints `日本���`: a UTF-8 character spans several byte tokens (and
byte-level BPE pieces), and half of one decodes to U+FFFD. The method is the one servers use
(Hugging Face TGI, vLLM): decode a short window of recent tokens twice, with and without the new
ones, and emit only the difference once it no longer ends in U+FFFD. The window starts a few
tokens back because some tokenizers decode a token differently at the start of a text (a leading
space). Works with any tokenizer that has `decode(ids) -> str` (transformers' or kvbuffer's
ByteTokenizer). Stop strings are matched on the text (StopMatcher), holding back only what could
still become one.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
_CONTEXT = 5  # tokens decoded before the new ones, so that their leading space or merge shows right


def special_ids(tokenizer) -> frozenset[int]:
    """The ids of a tokenizer's special tokens: its named ones (eos, pad, ...) and every added token
    marked special (such as a chat template's `<|im_start|>`, which transformers' `all_special_ids`
    leaves out)."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)


class IncrementalDetokenizer:
    """`add(token) -> new text` (maybe "", while a character is incomplete); `flush()` at the end
    returns what was held back (an incomplete sequence decodes as U+FFFD then, as a full decode would).
    skip_special_tokens: leave special tokens (special_ids) out of the text, as vLLM does by default."""

    def __init__(self, tokenizer, prompt_ids=(), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = special_ids(tokenizer) if skip_special_tokens else frozenset()
        self.ids = [t for t in prompt_ids if t not in self.skip][-_CONTEXT:]
        self.prefix = self.read = len(self.ids)  # ids[prefix:read] was emitted; ids[read:] is pending

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids) if ids else ""

    def add(self, token: int) -> str:
        if token in self.skip:
            return ""
        self.ids.append(token)
        start = max(0, self.prefix - _CONTEXT)
        done = self._decode(self.ids[start:self.read])
        text = self._decode(self.ids[start:])
        if len(text) <= len(done) or text.endswith(REPLACEMENT):
            return ""  # the last token(s) end inside a character: wait for the rest
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        start = max(0, self.prefix - _CONTEXT)
        done = self._decode(self.ids[start:self.read])
        text = self._decode(self.ids[start:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]


class StopMatcher:
    """Cut a text stream at the first stop string: `push(delta) -> (text safe to emit, stopped)`.

    Text that could be the start of a stop string is held back until it cannot be; `flush()` gives
    it back when the stream ends without a stop.
    """

    def __init__(self, stops=()):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def push(self, delta: str) -> tuple[str, bool]:
        text = self.pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return text[:min(hits)], True
        keep = len(text) - self.hold if self.hold else len(text)
        keep = max(keep, 0)
        self.pending = text[keep:]
        return text[:keep], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text
