"""Harmony (gpt-oss): messages `<|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>`, the last ended by
`<|return|>` (or `<|call|>`, a tool call).

The generation prompt ends in `<|start|>assistant`, so the output begins with a header. The `analysis`
channel is reasoning; `final` and `commentary` are answer (commentary holds preambles and tool calls).
Headers (role, channel, recipient `to=...`, `<|constrain|>` type) are never shown. Output that is not
harmony at all (no header ends within MAX_HEADER_TOKENS tokens) is answer. When the request offers
tools, the body of a message to `functions.NAME` is labelled CallBody(NAME), and the end of such a
message (`<|call|>`, `<|end|>`, `<|return|>`) gives an empty CALL_END piece, for HarmonyToolCalls to read
as a call (`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|>`);
otherwise a call's arguments are answer.

The reference parser, the `openai-harmony` package, loads the o200k_harmony vocabulary by downloading it
on first use; it cannot run on a machine without network access. This parser works over the token ids
with the special tokens of the model's own tokenizer instead, and needs nothing else.
"""
from __future__ import annotations

import re

from raymoe.stages.text.formats.base import ChatFormat
from raymoe.stages.text.grammar import REASONING_RULE, Writer, call_schema, json_rule
from raymoe.stages.text.reasoning import CALL_END, CONTENT, HIDDEN, REASONING, CallBody, OutputParser, last_index
from raymoe.stages.text.tool_calls import ToolCalls, json_object
from raymoe.stages.text.tools import FUNCTION_NAME, ToolRequest

_RECIPIENT = re.compile(r"(?:^|\s)to=functions\.([^\s<]+)")
MAX_HEADER_TOKENS = 64        # a harmony header longer than this is not one: the output is plain text
TOKENS = ("<|start|>", "<|message|>", "<|channel|>", "<|end|>")


class HarmonyParser(OutputParser):
    """gpt-oss's harmony messages (see the module's docstring)."""

    def __init__(self, chat_format: ChatFormat, tokenizer, prompt_ids: list[int], specials: dict[str, int],
                 tool_calls: bool = False):
        super().__init__(tokenizer)
        self._args = (chat_format, tokenizer, prompt_ids, specials, tool_calls)
        self.chat_format = chat_format
        self.tokenizer, self.tool_calls = tokenizer, tool_calls
        self.start, self.message, self.channel = specials["<|start|>"], specials["<|message|>"], specials["<|channel|>"]
        self.ends = {specials[name] for name in ("<|end|>", "<|return|>", "<|call|>") if name in specials}
        self.markup = {self.channel, specials.get("<|constrain|>", self.channel)}
        self.header: list[int] | None = None      # tokens of the header being read (None: in a message body)
        self.held: list[int] = []                 # the generated ones among them, not yet labelled
        self.opened = False                       # the header began with a generated <|start|>
        self.field = CONTENT
        last = last_index(prompt_ids, {self.start, self.message, *self.ends})
        if last < 0:
            return                                # not a harmony prompt: the output is a plain answer
        if prompt_ids[last] == self.message:      # the prompt opened a message: the output continues it
            begin = last_index(prompt_ids[:last], {self.start, *self.ends})
            self.field = self._field(prompt_ids[begin + 1:last])
        else:
            self.header = prompt_ids[last + 1:] if prompt_ids[last] == self.start else []

    def _field(self, header: list[int]):
        """The field of a message from its header: a tool call's body (with tools) when it goes to
        `functions.NAME`, else reasoning on the analysis channel, else answer."""
        if self.tool_calls:
            parts: list[list[int]] = []
            part: list[int] = []
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


class HarmonyToolCalls(ToolCalls):
    """Messages to `functions.NAME` (gpt-oss), as the HarmonyParser labels them."""

    def __init__(self, tools: ToolRequest):
        super().__init__(tools)
        self.name: str | None = None
        self.body: str | None = None             # the arguments of the call being read

    def feed(self, pieces) -> list[tuple]:
        out = []
        for field, text in pieces:
            if isinstance(field, CallBody):
                if self.body is not None and field.name != self.name:
                    out += self.finish()         # another call began before this one ended
                self.name, self.body = field.name, (self.body or "") + text
            elif field == CALL_END:
                name, body = self.name, self.body or ""
                self.name = self.body = None
                if name is not None and FUNCTION_NAME.fullmatch(name) and json_object(body) is not None:
                    out += self._call(name, body.strip())
                elif body:
                    out.append((CONTENT, body))
            else:
                out.append((field, text))
        return out

    def finish(self) -> list[tuple]:
        body, self.name, self.body = self.body, None, None
        return [(CONTENT, body)] if body else []

class Harmony(ChatFormat):
    name = "harmony"
    template_marks = ("<|channel|>",)

    def parser(self, tokenizer, prompt_ids: list[int], tool_calls: bool = False) -> OutputParser | None:
        specials = tokenizer.special_tokens
        if not all(name in specials for name in TOKENS):
            return None
        return HarmonyParser(self, tokenizer, prompt_ids, specials, tool_calls)

    def tool_calls(self, tools: ToolRequest) -> ToolCalls:
        return HarmonyToolCalls(tools)

    def call_rules(self, w: Writer, tools: ToolRequest, names: list[str]) -> list[str]:
        """A harmony message to functions.NAME on the commentary channel, its body the arguments (gpt-oss
        ends its turn at <|call|>: one call)."""
        rules = [f"answer: {' | '.join(f'call_{i}' for i in range(len(names)))}"]
        for i, n in enumerate(names):
            rules.append(f"call_{i}: {w.token('<|channel|>')} {w.text(f'commentary to=functions.{n} ')} "
                         f"{w.token('<|constrain|>')} {w.text('json')} {w.token('<|message|>')} "
                         f"{json_rule(call_schema(tools, n))} {w.token('<|call|>')}")
        return rules

    def reasons(self, parser: OutputParser) -> bool:
        return isinstance(parser, HarmonyParser) and (parser.header is not None or parser.field == REASONING)

    def grammar(self, w: Writer, parser: OutputParser, rules: list[str], call: bool, end: str) -> str:
        """An optional analysis message, then a final message holding the JSON, ended by <|return|> (or the
        call, ended by <|call|>), whatever state the prompt leaves the output in."""
        assert isinstance(parser, HarmonyParser)
        start, message, channel, close = (w.token(t) for t in ("<|start|>", "<|message|>", "<|channel|>", "<|end|>"))
        next_message = f"{close} {start} {w.text('assistant')}"
        if call:
            body = "answer"
        else:
            constrain = f"({w.text(' ')} {w.token('<|constrain|>')} {w.text('json')})?"
            body = f"{channel} {w.text('final')} {constrain} {message} answer {w.token('<|return|>')}"
        analysis = f"{channel} {w.text('analysis')} {message} {REASONING_RULE} {next_message}"
        if parser.header is not None:     # at a header: the prompt ended in <|start|>assistant (or a message's end)
            opening = "" if parser.header else f"{start} {w.text('assistant')} "
            top = f"start: {opening}({analysis})? {body}"
        elif parser.field == REASONING or call:  # inside an analysis message, or another one before a call: end it
            top = f"start: {REASONING_RULE} {next_message} {body}"
        else:                                  # inside the final message: the JSON continues it
            top = f"start: answer {w.token('<|return|>')}"
        return "\n".join([top, *rules])
