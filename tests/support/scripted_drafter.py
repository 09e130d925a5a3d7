"""A drafter for tests: proposes a known continuation, right or deliberately wrong by pattern."""

from kvbuffer.engine.drafters import Drafter


class ScriptedDrafter(Drafter):
    """Proposes the plain-decoding continuation, corrupted by pattern: 'all' drafts right, 'none'
    all wrong, 'some' right except every third. strict=False: past the end of the references (a
    run that chose another token at a near tie) it proposes zeros instead of failing."""

    def __init__(self, references, pattern, vocab, strict=True):
        self.refs, self.pattern, self.vocab, self.strict = references, pattern, vocab, strict

    def propose(self, reqs, count):
        return [self._one(r.context, count) for r in reqs]

    def _one(self, context, count):
        for prompt, cont in self.refs:
            full = prompt + cont
            if context == full[: len(context)]:
                nxt = full[len(context): len(context) + count]
                return [self._corrupt(i, t) for i, t in enumerate(nxt, start=len(context))]
        if self.strict:
            raise AssertionError("context left the reference continuation")
        return [0] * count  # bf16 runs may leave it at a near tie (the caller compares margins)

    def _corrupt(self, pos, token):
        wrong = (token + 1) % self.vocab
        if self.pattern == "none" or (self.pattern == "some" and pos % 3 == 0):
            return wrong
        return token
