"""What a chat format provides: a parser of the model's output (reasoning apart from the answer), a reader
of the tool calls in it, and the grammar of an output whose answer is forced (a JSON schema, a call)."""
from __future__ import annotations

from raymoe.stages.text.grammar import Writer
from raymoe.stages.text.reasoning import OutputParser
from raymoe.stages.text.tool_calls import ToolCalls
from raymoe.stages.text.tools import ToolRequest


class ChatFormat:
    """One chat format. `name` is what a family declares (Family.chat_format); `template_marks`: text
    that only a chat template of this format holds, so that a model served with another template is
    read in that template's format."""
    name: str = ""
    template_marks: tuple[str, ...] = ()

    def parser(self, tokenizer, prompt_ids: list[int], tool_calls: bool = False) -> OutputParser | None:
        """The parser of an answer to prompt_ids, or None when the tokenizer lacks the format's tokens.
        With tool_calls, it marks the calls for `tool_calls`'s reader."""
        raise NotImplementedError

    def tool_calls(self, tools: ToolRequest) -> ToolCalls:
        """A fresh reader of the calls in one answer that this format's parser labelled."""
        raise NotImplementedError

    def reasons(self, parser: OutputParser) -> bool:
        """Whether an output that `parser` starts reading may hold reasoning (a budget then bounds it)."""
        return False

    def grammar(self, w: Writer, parser: OutputParser, rules: list[str], call: bool, end: str) -> str:
        """The Lark grammar of the whole output, in the state `parser` starts in (reasoning first where the
        prompt leaves it to the model), around `rules`, whose first defines `answer`: the JSON (call False)
        or a call (call_rules); then `end`, the end token by id, where the format ends an answer with it. Reasoning
        is written as the rule grammar.REASONING_RULE, which the caller defines (its budget)."""
        raise NotImplementedError

    def call_rules(self, w: Writer, tools: ToolRequest, names: list[str]) -> list[str]:
        """Rules, `answer` first, of a call to one of `names` in the form this format's template teaches
        (with parallel_tool_calls and tool_choice "required": one or more calls where the format allows)."""
        raise NotImplementedError
