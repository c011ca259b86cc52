"""A chat answer in its parts: reasoning, content and tool calls, read in the model's chat format
(stages/text/formats/), for the server's responses and the batch job's lines."""
from __future__ import annotations

from raymoe.stages.text.formats.qwen_xml import QwenXML
from raymoe.stages.text.formats.registry import chat_format
from raymoe.stages.text.reasoning import CONTENT, REASONING, OutputParser, SplitText, split_answer
from raymoe.stages.text.tool_calls import TOOL_CALLS, ToolCalls
from raymoe.stages.text.tools import ToolRequest, tool_request

PLAIN_CALLS = QwenXML()       # calls in a plain-text answer: `<tool_call>` holding either form


def output_parser(tokenizer, prompt_ids: list[int], tool_calls: bool = False) -> OutputParser | None:
    """The parser for a chat answer to `prompt_ids` in the model's chat format; None for plain text. With
    tool_calls, the calls are marked for tool_calls_reader."""
    fmt = chat_format(tokenizer)
    return None if fmt is None else fmt.parser(tokenizer, prompt_ids, tool_calls)


def tool_calls_reader(parser: OutputParser, tools: ToolRequest) -> ToolCalls:
    """A fresh reader of calls in the format of `parser`'s answers."""
    return (parser.chat_format or PLAIN_CALLS).tool_calls(tools)


def chat_parsers(tokenizer, prompt_ids: list[int], tools: ToolRequest | None):
    """(the OutputParser of the answer, or None; the ToolCalls reader, or None without active tools)."""
    active = tools is not None and tools.active
    parser = output_parser(tokenizer, prompt_ids, tool_calls=active)
    if not active:
        return parser, None
    if parser is None:
        parser = OutputParser(tokenizer)
    return parser, tool_calls_reader(parser, tools)


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


def split_message(parser: OutputParser, calls: ToolCalls | None, token_ids, text: str) -> dict:
    """A whole answer as {"reasoning_content": text or None, "content": text, "tool_calls": [calls]}
    (content None when there are calls and no other text, as OpenAI's); with calls None, tool_calls is []."""
    events = SplitText(parser).final(token_ids, text)
    if calls is not None:
        events = calls.feed(events) + calls.finish()
    fields = {REASONING: [], CONTENT: []}
    found = []
    for event in events:
        if event[0] == TOOL_CALLS:
            found.append(event[1])
        else:
            fields[event[0]].append(event[1])
    content = "".join(fields[CONTENT])
    return {REASONING: "".join(fields[REASONING]) or None, CONTENT: content if content or not found else None,
            TOOL_CALLS: found}


def split_chat_result(result: dict, tokenizer, request: dict) -> dict:
    """A chat line's engine result (deploy.generate) with `text` the answer alone, `reasoning_content`
    beside it and, when the line offers tools (stages/text/tools.py), `tool_calls` after it (finish_reason
    "tool_calls" when there are some); errors and non-chat formats pass unchanged."""
    if "error" in result:
        return result
    tools = tool_request(request)
    if tools is None or not tools.active:
        return split_result(result, tokenizer)
    parser, calls = chat_parsers(tokenizer, result["prompt_token_ids"], tools)
    fields = split_message(parser, calls, result["token_ids"], result["text"])
    out = {}
    for key, value in result.items():      # reasoning_content (and tool_calls) right after text
        out[key] = (fields[CONTENT] or "") if key == "text" else value
        if key == "text":
            out[REASONING] = fields[REASONING]
            if calls is not None:
                out[TOOL_CALLS] = fields[TOOL_CALLS]
    if fields[TOOL_CALLS]:
        out["finish_reason"] = TOOL_CALLS
    return out
