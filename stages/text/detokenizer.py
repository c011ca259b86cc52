"""Text of a growing list of token ids, decoded a few tokens at a time.

Decoding the whole output again for every new token costs O(n) per token. Here each new token
decodes only a window of the last few tokens (at most WINDOW, restarted at a clean end), whose
first tokens, already emitted, give the new ones the context of a full decode (decoders treat a
token at the start of the text differently: a leading space); only what follows the window's
emitted characters is new. Text that may still change — U+FFFD at
the end, an incomplete UTF-8 character — is held back until more tokens arrive or the sequence
ends (finish), so the text only ever grows and, finished, equals a full decode.
"""
from __future__ import annotations


WINDOW = 16     # tokens decoded at most per step, but for the few after a held-back character


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0                 # the window decoded each step: ids[prefix:]
        self.emitted = 0                # characters of the window's text emitted so far
        self.clean = 0                  # ids[:clean] end cleanly (nothing held back)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append one token; returns the text it makes certain (often "", sometimes several tokens' worth)."""
        self.ids.append(token)
        text = self._decode(self.ids[self.prefix:])
        stable = len(text.rstrip("\ufffd"))
        new = text[self.emitted:stable]
        self.emitted = max(self.emitted, stable)
        if stable == len(text):
            if len(self.ids) - self.prefix > WINDOW:    # restart the window at the previous clean end
                self.prefix = self.clean
                self.emitted = len(self._decode(self.ids[self.prefix:]))
            self.clean = len(self.ids)
        return new

    def finish(self) -> str:
        """The held-back rest, as a full decode gives it (an incomplete character stays U+FFFD)."""
        new = self._decode(self.ids[self.prefix:])[self.emitted:]
        self.prefix = self.clean = len(self.ids)
        self.emitted = 0
        return new
