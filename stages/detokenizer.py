"""Text of a growing list of token ids, decoded a few tokens at a time.

Decoding the whole output again for every new token costs O(n) per token. Here each new token
decodes only a short window: the tokens since the last clean end (`read`) plus the ones before
them back to `prefix`, so that decoders which treat a token differently at the start of the text
(a leading space) see the same context as a full decode. Text that may still change — U+FFFD at
the end, an incomplete UTF-8 character — is held back until more tokens arrive or the sequence
ends (finish), so the text only ever grows and, finished, equals a full decode.
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0     # the window: ids[prefix:read] context already emitted, ids[read:] new
        self.emitted = 0                # characters of the window's text emitted so far

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append one token; returns the text it makes certain (often "", sometimes several tokens' worth)."""
        self.ids.append(token)
        text = self._decode(self.ids[self.prefix:])
        stable = len(text.rstrip("\ufffd"))
        new = text[self.emitted:stable]
        self.emitted = max(self.emitted, stable)
        if stable == len(text):         # a clean end: the window moves on, its first tokens as context
            self.prefix, self.read = self.read, len(self.ids)
            self.emitted = len(self._decode(self.ids[self.prefix:]))
        return new

    def finish(self) -> str:
        """The held-back rest, as a full decode gives it (an incomplete character stays U+FFFD)."""
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        new, self.emitted = text[self.emitted:], 0
        return new
