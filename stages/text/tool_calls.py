"""Tool calls read from a chat answer, after reasoning went apart from it (stages/text/reasoning.py): what
the formats' readers share (each format's own reader: stages/text/formats/).

A `ToolCalls` reader takes the (field, text) pieces that SplitText gives (stop strings already applied)
and gives events: (REASONING or CONTENT, text) as before, and (TOOL_CALLS, call) for each call, the
call in OpenAI's shape {"id": "call_...", "type": "function", "function": {"name", "arguments"}}
with `arguments` a JSON object's text. `TextToolCalls` reads the formats that write a call in the
answer's text as `<tool_call>...</tool_call>` (Qwen's, hermes): its tags found in the text, or as
CALL_START / CALL_END marks where the tokenizer has them as tokens (read by id: a special token decodes
to nothing); the format gives the parser of one block. Whitespace before a call and after one goes
with it (the template writes it back), other text is content.

A call is given once it is whole (its end read and its arguments a JSON object), so a stream and a
whole answer agree: what a call would be is held back meanwhile, and a call that is malformed, or
left unfinished by max_tokens or a stop string, is content as the model wrote it. Without
parallel_tool_calls only the first call is given (later ones are dropped, as vLLM drops them).
"""
from __future__ import annotations

import json
import uuid
from typing import Callable

from raymoe.stages.text.reasoning import CALL_END, CALL_START, CONTENT, hold_back
from raymoe.stages.text.tools import ToolRequest

TOOL_CALLS = "tool_calls"
START, END = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def loads(text: str):
    """JSON (NaN and Infinity refused: they are not JSON), or ValueError."""
    return json.loads(text, parse_constant=_reject_constant)


def json_object(text: str) -> dict | None:
    try:
        value = loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ToolCalls:
    """The calls of one answer (see the module's docstring); `calls` holds those given so far."""

    def __init__(self, tools: ToolRequest):
        self.tools = tools
        self.calls: list[dict] = []

    def feed(self, pieces) -> list[tuple]:
        raise NotImplementedError

    def finish(self) -> list[tuple]:
        raise NotImplementedError

    def _call(self, name: str, arguments: str) -> list[tuple]:
        if self.calls and not self.tools.parallel:
            return []
        call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        self.calls.append(call)
        return [(TOOL_CALLS, call)]


class TextToolCalls(ToolCalls):
    """`<tool_call>...</tool_call>` in the answer's text (Qwen, hermes); parse_block: (the text between the tags,
    the request's tools) -> (name, arguments as JSON text), or None when it is malformed."""

    def __init__(self, tools: ToolRequest, parse_block: Callable[[str, ToolRequest], tuple[str, str] | None]):
        super().__init__(tools)
        self.parse_block = parse_block
        self.pending = ""          # answer text not given yet: a call being read, or what could begin one
        self.held = ""             # whitespace before the call being read: dropped if it is one
        self.in_call = False
        self.after_call = False    # at the start of the text after a call: its leading whitespace is dropped

    def feed(self, pieces) -> list[tuple]:
        out = []
        for field, text in pieces:
            if field == CONTENT:
                self.pending += text
                out += self._scan(final=False)
            elif field in (CALL_START, CALL_END):     # a tag read by id: as its text here
                self.pending += START if field == CALL_START else END
                out += self._scan(final=False)
            else:
                out.append((field, text))
        return out

    def finish(self) -> list[tuple]:
        return self._scan(final=True)

    def _text(self, text: str) -> list[tuple]:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return []
            self.after_call = False
        return [(CONTENT, text)] if text else []

    def _scan(self, final: bool) -> list[tuple]:
        out = []
        while True:
            if self.in_call:
                end = self.pending.find(END)
                if end < 0:
                    if final:                    # unfinished: text
                        out += self._text(self.held + self.pending)
                        self.pending = self.held = ""
                        self.in_call = False
                    return out
                block, self.pending = self.pending[:end + len(END)], self.pending[end + len(END):]
                self.in_call = False
                call = self.parse_block(block[len(START):-len(END)].strip(), self.tools)
                if call is None:
                    out += self._text(self.held + block)
                else:
                    out += self._call(*call)
                    self.after_call = True
                self.held = ""
                continue
            start = self.pending.find(START)
            if start >= 0:
                before = self.pending[:start]
                text = before.rstrip()
                out += self._text(text)
                self.held = "" if self.after_call else before[len(text):]
                self.pending, self.in_call = self.pending[start:], True
                continue
            if final:
                out += self._text(self.pending)
                self.pending = ""
                return out
            # give what cannot begin a call, but hold trailing whitespace (it goes if a call follows)
            text = self.pending[:len(self.pending) - hold_back(self.pending, [START])].rstrip()
            out += self._text(text)
            self.pending = self.pending[len(text):]
            return out
