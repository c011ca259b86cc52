"""Reasoning kept apart from the answer in a chat model's output, over its token ids.

A parser labels each generated token with the field its text belongs to: `reasoning_content`,
`content`, or None (markup that nobody reads: tags, message headers, channel names). Consecutive
tokens of one field are decoded together, a few at a time (stages.text.detokenizer), so a stream and a
whole answer decode alike. Two formats:

* Think tags (Qwen3, Qwen3.5): reasoning between `<think>` and `</think>`, the answer after. Qwen3.5's
  generation prompt opens the block itself (`<|im_start|>assistant\\n<think>\\n`), so the output starts
  in reasoning and holds only `</think>`; with `enable_thinking: false` the prompt holds an empty,
  closed block and the whole output is answer. So the prompt decides where the output starts: in
  reasoning when its last tag (since the last `<|im_start|>`) is an open `<think>`. As vLLM's qwen3
  parser, the text keeps its newlines (reasoning usually ends in "\\n", the answer starts "\\n\\n").
* Harmony (gpt-oss): messages `<|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>`, the last ended by
  `<|return|>` (or `<|call|>`, a tool call). The generation prompt ends in `<|start|>assistant`, so
  the output begins with a header. The `analysis` channel is reasoning; `final` and `commentary` are
  answer (commentary holds preambles and tool calls). Headers (role, channel, recipient `to=...`,
  `<|constrain|>` type) are never shown. Output that is not harmony at all (no header ends within
  MAX_HEADER_TOKENS tokens) is answer. When the request offers tools (`tool_calls=True`), the body of
  a message to `functions.NAME` is labelled CallBody(NAME), and the end of such a message (`<|call|>`,
  `<|end|>`, `<|return|>`) gives an empty CALL_END piece, for stages/text/tool_calls.py to read as a call;
  otherwise a call's arguments are answer.

  The reference parser, the `openai-harmony` package, loads the o200k_harmony vocabulary by
  downloading it on first use; it cannot run on a machine without network access (its wheel has no
  vocabulary, and loading fails offline). This parser works over the token ids with the special
  tokens of the model's own tokenizer instead, and needs nothing else.

`SplitText` turns the pieces into what a client sees: the answer with its stop strings applied (the
engine cuts its own text at a stop string; the same cut applies to the pieces), streamed in pieces
whose concatenation per field equals the whole answer's.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass

from raymoe.stages.text.detokenizer import Detokenizer

REASONING, CONTENT = "reasoning_content", "content"
HIDDEN = None
CALL_END = "call_end"         # an empty piece: the harmony tool call before it is complete


@dataclass(frozen=True)
class CallBody:
    """The field of a harmony tool call's body (its arguments): a call to the function `name`."""
    name: str


_RECIPIENT = re.compile(r"(?:^|\s)to=functions\.([^\s<]+)")
MAX_HEADER_TOKENS = 64        # a harmony header longer than this is not one: the output is plain text
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
    prompt (a request's other choices)."""

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


def _last_index(ids: list[int], wanted: set[int]) -> int:
    """The index of the last token of `wanted` among the last _SCAN_LIMIT of ids, or -1."""
    stop = max(-1, len(ids) - 1 - _SCAN_LIMIT)
    for i in range(len(ids) - 1, stop, -1):
        if ids[i] in wanted:
            return i
    return -1


class ThinkParser(OutputParser):
    """`<think>reasoning</think>answer` (Qwen3, Qwen3.5)."""

    def __init__(self, tokenizer, prompt_ids: list[int], start: int, end: int, turn_starts: set[int]):
        super().__init__(tokenizer)
        self._args = (tokenizer, prompt_ids, start, end, turn_starts)
        self.start, self.end = start, end
        last = _last_index(prompt_ids, {start, end, *turn_starts})
        self.field = REASONING if last >= 0 and prompt_ids[last] == start else CONTENT

    def _token(self, token: int) -> list[tuple]:
        if token == self.start:
            self.field = REASONING
            return self.runs.add(HIDDEN, token)
        if token == self.end:
            self.field = CONTENT
            return self.runs.add(HIDDEN, token)
        return self.runs.add(self.field, token)


class HarmonyParser(OutputParser):
    """gpt-oss's harmony messages (see the module's docstring)."""

    def __init__(self, tokenizer, prompt_ids: list[int], specials: dict[str, int], tool_calls: bool = False):
        super().__init__(tokenizer)
        self._args = (tokenizer, prompt_ids, specials, tool_calls)
        self.tokenizer, self.tool_calls = tokenizer, tool_calls
        self.start, self.message, self.channel = specials["<|start|>"], specials["<|message|>"], specials["<|channel|>"]
        self.ends = {specials[name] for name in ("<|end|>", "<|return|>", "<|call|>") if name in specials}
        self.markup = {self.channel, specials.get("<|constrain|>", self.channel)}
        self.header: list[int] | None = None      # tokens of the header being read (None: in a message body)
        self.held: list[int] = []                 # the generated ones among them, not yet labelled
        self.opened = False                       # the header began with a generated <|start|>
        self.field = CONTENT
        last = _last_index(prompt_ids, {self.start, self.message, *self.ends})
        if last < 0:
            return                                # not a harmony prompt: the output is a plain answer
        if prompt_ids[last] == self.message:      # the prompt opened a message: the output continues it
            begin = _last_index(prompt_ids[:last], {self.start, *self.ends})
            self.field = self._field(prompt_ids[begin + 1:last])
        else:
            self.header = prompt_ids[last + 1:] if prompt_ids[last] == self.start else []

    def _field(self, header: list[int]):
        """The field of a message from its header: a tool call's body (with tools) when it goes to
        `functions.NAME`, else reasoning on the analysis channel, else answer."""
        if self.tool_calls:
            parts, part = [], []
            for token in header:
                if token in self.markup:
                    parts.append(part)
                    part = []
                else:
                    part.append(token)
            text = " ".join(self.tokenizer.decode(p, skip_special_tokens=True) for p in [*parts, part])
            recipient = _RECIPIENT.search(text)
            if recipient:
                return CallBody(recipient.group(1))
        if self.channel in header:
            after = header[header.index(self.channel) + 1:]
            name = []
            for token in after:
                if token in self.markup:
                    break
                name.append(token)
            words = self.tokenizer.decode(name, skip_special_tokens=True).split()
            if words and words[0] == "analysis":
                return REASONING
        return CONTENT

    def _flush_held(self) -> list[tuple]:
        """The generated tokens of a header that ends without a message: hidden (a header cut short)
        unless they cannot be one, having no <|start|> of their own and no channel (plain text: answer)."""
        held, self.held = self.held, []
        field = HIDDEN if self.opened or self.markup.intersection(held) else CONTENT
        return [piece for t in held for piece in self.runs.add(field, t)]

    def _token(self, token: int) -> list[tuple]:
        if self.header is None:                   # in a message body
            if token == self.start or token in self.ends:
                self.header, self.opened = [], token == self.start
                if token in self.ends and isinstance(self.field, CallBody):
                    return self.runs.close() + [(CALL_END, "")] + self.runs.add(HIDDEN, token)
                return self.runs.add(HIDDEN, token)
            return self.runs.add(HIDDEN if token in self.markup or token == self.message else self.field, token)
        if token == self.message:
            self.field = self._field(self.header)
            self.header = None
            held, self.held = self.held, []
            return [piece for t in held + [token] for piece in self.runs.add(HIDDEN, t)]
        if token == self.start or token in self.ends:
            out = self._flush_held() + self.runs.add(HIDDEN, token)
            self.header, self.opened = [], token == self.start
            return out
        self.header.append(token)
        self.held.append(token)
        if len(self.header) > MAX_HEADER_TOKENS:  # no header after all: plain text, an answer
            held, self.held, self.header, self.field = self.held, [], None, CONTENT
            return [piece for t in held for piece in self.runs.add(CONTENT, t)]
        return []

    def finish(self) -> list[tuple]:
        return self._flush_held() + self.runs.close()


def output_parser(tokenizer, prompt_ids: list[int], tool_calls: bool = False) -> OutputParser | None:
    """The parser for a chat answer to `prompt_ids` in the tokenizer's format (harmony when it has
    harmony's special tokens, think tags when it has <think> and </think>); None for neither. With
    tool_calls, harmony's tool calls are labelled (CallBody, CALL_END) for stages/text/tool_calls.py."""
    specials = tokenizer.special_tokens
    if all(name in specials for name in ("<|start|>", "<|message|>", "<|channel|>", "<|end|>")):
        return HarmonyParser(tokenizer, prompt_ids, specials, tool_calls)
    start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    if start is not None and end is not None:
        turn_starts = {specials[name] for name in ("<|im_start|>",) if name in specials}
        return ThinkParser(tokenizer, prompt_ids, start, end, turn_starts)
    return None


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


def split_result(result: dict, tokenizer) -> dict:
    """A chat line's engine result with `text` the answer alone and `reasoning_content` beside it
    (None when the model wrote no reasoning); errors and non-chat formats pass unchanged."""
    if "error" in result:
        return result
    parser = output_parser(tokenizer, result["prompt_token_ids"])
    if parser is None:
        return result
    fields = split_answer(parser, result["token_ids"], result["text"])
    out = {}
    for key, value in result.items():      # reasoning_content right after text
        out[key] = fields[CONTENT] if key == "text" else value
        if key == "text":
            out[REASONING] = fields[REASONING]
    return out
