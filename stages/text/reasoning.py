"""Reasoning kept apart from the answer in a chat model's output, over its token ids: what every chat
format's parser shares (the formats themselves: stages/text/formats/).

A parser labels each generated token with the field its text belongs to: `reasoning_content`,
`content`, or None (markup that nobody reads: tags, message headers, channel names). Consecutive
tokens of one field are decoded together, a few at a time (stages.text.detokenizer), so a stream and a
whole answer decode alike. When the request offers tools, a parser also marks where a tool call's
markup begins and ends (CALL_START, CALL_END: empty pieces, whatever the tags decode to), and a harmony
call's body (CallBody), for the format's tool-call reader (stages/text/tool_calls.py).

`SplitText` turns the pieces into what a client sees: the answer with its stop strings applied (the
engine cuts its own text at a stop string; the same cut applies to the pieces), streamed in pieces
whose concatenation per field equals the whole answer's.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from raymoe.stages.text.detokenizer import Detokenizer

REASONING, CONTENT = "reasoning_content", "content"
HIDDEN = None
CALL_START = "call_start"     # an empty piece: a tool call's markup begins (its opening tag, read by id)
CALL_END = "call_end"         # an empty piece: the tool call before it is complete


@dataclass(frozen=True)
class CallBody:
    """The field of a harmony tool call's body (its arguments): a call to the function `name`."""
    name: str


_SCAN_LIMIT = 4096            # prompt tokens looked at (backwards) for the state the output starts in


class _Runs:
    """Consecutive tokens of one field, decoded together as they come."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.field: str | None = HIDDEN
        self.detokenizer: Detokenizer | None = None

    def add(self, field, token: int) -> list[tuple]:
        out = []
        if self.detokenizer is None or field != self.field:
            out = self.close()
            self.field, self.detokenizer = field, Detokenizer(self.tokenizer)
        text = self.detokenizer.add(token)
        if text:
            out.append((field, text))
        return out

    def close(self) -> list[tuple]:
        if self.detokenizer is None:
            return []
        text, field = self.detokenizer.finish(), self.field
        self.detokenizer = None
        return [(field, text)] if text else []


class OutputParser:
    """The output of one chat sequence as (field, text) pieces, in order; the texts of all pieces,
    hidden ones too, concatenate to the output's decoded text (special tokens decode to nothing).
    A parser holds the state of one output: `fresh()` gives another for the next output of the same
    prompt (a request's other choices). `chat_format`: the format it reads (None: plain text)."""

    chat_format: Any = None       # a formats.base.ChatFormat (which builds on this module)

    def __init__(self, tokenizer):
        self.runs = _Runs(tokenizer)
        self._args = (tokenizer,)

    def fresh(self) -> "OutputParser":
        """A parser of the same prompt and format, at the start of an output."""
        return type(self)(*self._args)

    def feed(self, token_ids) -> list[tuple]:
        out = []
        for token in token_ids:
            out += self._token(token)
        return out

    def finish(self) -> list[tuple]:
        return self.runs.close()

    def _token(self, token: int) -> list[tuple]:
        return self.runs.add(CONTENT, token)


def last_index(ids: list[int], wanted: set[int]) -> int:
    """The index of the last token of `wanted` among the last _SCAN_LIMIT of ids, or -1."""
    stop = max(-1, len(ids) - 1 - _SCAN_LIMIT)
    for i in range(len(ids) - 1, stop, -1):
        if ids[i] in wanted:
            return i
    return -1


def hold_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could be the start of a stop string."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return hold


class SplitText:
    """One chat answer's fields, as a stream of (field, text) pieces (`update`, then `final`) or whole
    (`final` alone). The engine cuts its text at the first stop string; so that the pieces never
    outrun that cut, a tail of the output that could begin a stop string is held back until more
    tokens (or the end) tell, and the final text's length cuts the rest. Per field, the pieces
    concatenate to the whole answer's field."""

    def __init__(self, parser: OutputParser, stops: list[str] | None = None):
        self.parser = parser
        self.stops = [s for s in (stops or []) if s]
        self.text = ""                       # the whole output text so far (hidden pieces too)
        self.pending: deque = deque()        # pieces not sent yet
        self.sent = 0                        # characters of self.text sent (or dropped, when hidden)

    def _add(self, pieces):
        for field, text in pieces:
            self.text += text
            self.pending.append((field, text))

    def _take(self, upto: int) -> list[tuple]:
        out = []
        # an empty piece (CALL_END) passes once the text before it has: it lies before the cut
        while self.pending and (self.sent < upto or not self.pending[0][1]):
            field, text = self.pending[0]
            if not text:
                self.pending.popleft()
                if field is not HIDDEN:
                    out.append((field, text))
                continue
            n = min(len(text), upto - self.sent)
            if n == len(text):
                self.pending.popleft()
            else:
                self.pending[0] = (field, text[n:])
            self.sent += n
            if field is HIDDEN:
                continue
            if out and out[-1][0] == field:
                out[-1] = (field, out[-1][1] + text[:n])
            else:
                out.append((field, text[:n]))
        return out

    def update(self, token_ids) -> list[tuple]:
        """The pieces that the new tokens make certain (hidden ones left out, same fields joined)."""
        self._add(self.parser.feed(token_ids))
        upto = len(self.text) - hold_back(self.text, self.stops)
        for stop in self.stops:         # (the engine ends at a whole stop string: nothing after it is sent)
            at = self.text.find(stop, max(0, self.sent - len(stop) + 1))
            if at >= 0:
                upto = min(upto, at)
        return self._take(upto)

    def final(self, token_ids, text: str) -> list[tuple]:
        """The rest, after the last tokens, cut where the engine's final `text` ends (a stop string)."""
        self._add(self.parser.feed(token_ids))
        self._add(self.parser.finish())
        cut = len(text) if self.text != text and self.text.startswith(text) else len(self.text)
        out = self._take(cut)
        self.pending.clear()
        return out


def split_answer(parser: OutputParser, token_ids, text: str) -> dict:
    """{"reasoning_content": text or None, "content": text} of a whole answer."""
    fields = {REASONING: [], CONTENT: []}
    for field, piece in SplitText(parser).final(token_ids, text):
        fields[field].append(piece)
    return {REASONING: "".join(fields[REASONING]) or None, CONTENT: "".join(fields[CONTENT])}
