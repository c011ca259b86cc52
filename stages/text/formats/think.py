"""Think tags (Qwen3, Qwen3.5, Qwen3-Next): reasoning between `<think>` and `</think>`, the answer after;
tool calls in the answer as `<tool_call>...</tool_call>`. The base of the two formats that differ in
what a call holds (qwen_xml.py, hermes.py).

Qwen3.5's generation prompt opens the block itself (`<|im_start|>assistant\\n<think>\\n`), so the output
starts in reasoning and holds only `</think>`; with `enable_thinking: false` the prompt holds an empty,
closed block and the whole output is answer. So the prompt decides where the output starts: in
reasoning when its last tag (since the last `<|im_start|>`) is an open `<think>`. As vLLM's qwen3
parser, the text keeps its newlines (reasoning usually ends in "\\n", the answer starts "\\n\\n").
The tags are read by id, as are `<tool_call>` and `</tool_call>` where the tokenizer has them as tokens
(whether it calls them special, which decode to nothing, or not)."""
from __future__ import annotations

from raymoe.stages.text.formats.base import ChatFormat
from raymoe.stages.text.grammar import REASONING_RULE, Writer
from raymoe.stages.text.reasoning import CALL_END, CALL_START, CONTENT, HIDDEN, REASONING, OutputParser, last_index
from raymoe.stages.text.tool_calls import END, START, TextToolCalls, ToolCalls
from raymoe.stages.text.tools import ToolRequest


class ThinkParser(OutputParser):
    """`<think>reasoning</think>answer`, with the call tags marked when the request offers tools."""

    def __init__(self, chat_format: ChatFormat, tokenizer, prompt_ids: list[int], start: int, end: int,
                 turn_starts: set[int], call_tags: tuple[int, int] | None):
        super().__init__(tokenizer)
        self._args = (chat_format, tokenizer, prompt_ids, start, end, turn_starts, call_tags)
        self.chat_format = chat_format
        self.start, self.end = start, end
        self.call_tags = call_tags or (None, None)
        last = last_index(prompt_ids, {start, end, *turn_starts})
        self.field = REASONING if last >= 0 and prompt_ids[last] == start else CONTENT

    def _token(self, token: int) -> list[tuple]:
        if token == self.start:
            self.field = REASONING
            return self.runs.add(HIDDEN, token)
        if token == self.end:
            self.field = CONTENT
            return self.runs.add(HIDDEN, token)
        if token in self.call_tags and self.field == CONTENT:
            mark = CALL_START if token == self.call_tags[0] else CALL_END
            return self.runs.close() + [(mark, "")] + self.runs.add(HIDDEN, token)
        return self.runs.add(self.field, token)


class ThinkFormat(ChatFormat):
    """A think-tag format; a subclass says what a call holds: parse_call reads one, call_body writes its grammar."""

    def parser(self, tokenizer, prompt_ids: list[int], tool_calls: bool = False) -> OutputParser | None:
        start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
        if start is None or end is None:
            return None
        specials = tokenizer.special_tokens
        turn_starts = {specials[name] for name in ("<|im_start|>",) if name in specials}
        tags = (tokenizer.token_to_id(START), tokenizer.token_to_id(END))
        return ThinkParser(self, tokenizer, prompt_ids, start, end, turn_starts,
                           tags if tool_calls and None not in tags else None)

    def tool_calls(self, tools: ToolRequest) -> ToolCalls:
        return TextToolCalls(tools, self.parse_call)

    def parse_call(self, inner: str, tools: ToolRequest) -> tuple[str, str] | None:
        """(name, arguments as JSON text) of the text between a call's tags, or None when it is malformed."""
        raise NotImplementedError

    def call_body(self, w: Writer, tools: ToolRequest, names: list[str]) -> list[str]:
        """Rules, `body` first, of what a call to one of `names` holds between its tags."""
        raise NotImplementedError

    def call_rules(self, w: Writer, tools: ToolRequest, names: list[str]) -> list[str]:
        more = f" ({w.text(chr(10))} call)*" if tools.parallel and tools.choice == "required" else ""
        return [f"answer: call{more}", f"call: {w.text(START + chr(10))} body {w.text(chr(10) + END)}",
                *self.call_body(w, tools, names)]

    def reasons(self, parser: OutputParser) -> bool:
        return isinstance(parser, ThinkParser) and parser.field == REASONING

    def grammar(self, w: Writer, parser: OutputParser, rules: list[str], call: bool, end: str) -> str:
        if isinstance(parser, ThinkParser) and parser.field == REASONING:
            # the generation prompt opened <think>: free reasoning, </think>, then the answer
            start = f"start: {REASONING_RULE} <[{parser.end}]> /\\n{{0,2}}/ answer {end}"
        else:
            start = f"start: answer {end}"
        return "\n".join([start, *rules])
