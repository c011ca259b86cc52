"""Tool calls read from a chat answer, after reasoning went apart from it (stages/text/reasoning.py).

A `ToolCalls` reader takes the (field, text) pieces that SplitText gives (stop strings already applied)
and gives events: (REASONING or CONTENT, text) as before, and (TOOL_CALLS, call) for each call, the
call in OpenAI's shape {"id": "call_...", "type": "function", "function": {"name", "arguments"}}
with `arguments` a JSON object's text. Two formats:

* Text (Qwen2.5, Qwen3, Qwen3.5): a call in the answer is `<tool_call>...</tool_call>`, holding either
  Qwen3.5's (and Qwen3-Coder's) XML, `<function=NAME>` then `<parameter=ARG>\\nVALUE\\n</parameter>` for
  each argument then `</function>`, or Qwen2.5/3's JSON, `{"name": NAME, "arguments": {...}}`. An XML
  value is text; it becomes a JSON number, boolean, null, array or object when the function's schema
  gives the argument such a type (not "string") and the text parses as one. Whitespace before a call
  and after one goes with it (the template writes it back), other text is content.
* Harmony (gpt-oss): a message to `functions.NAME` (`<|start|>assistant<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|>`); its body is the arguments. The
  HarmonyParser labels it (CallBody, CALL_END).

A call is given once it is whole (its end read and its arguments a JSON object), so a stream and a
whole answer agree: what a call would be is held back meanwhile, and a call that is malformed, or
left unfinished by max_tokens or a stop string, is content as the model wrote it. Without
parallel_tool_calls only the first call is given (later ones are dropped, as vLLM drops them).
"""
from __future__ import annotations

import json
import re
import uuid

from raymoe.stages.text.reasoning import (CALL_END, CONTENT, REASONING, CallBody, HarmonyParser, OutputParser, SplitText, output_parser,
                        split_result)
from raymoe.stages.text.tools import FUNCTION_NAME, ToolRequest, tool_request

TOOL_CALLS = "tool_calls"
START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^\s>]+)>(.*)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^\s>]+)>(.*?)</parameter>", re.S)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def _loads(text: str):
    """JSON (NaN and Infinity refused: they are not JSON), or ValueError."""
    return json.loads(text, parse_constant=_reject_constant)


def _json_object(text: str) -> dict | None:
    try:
        value = _loads(text)
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


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of text could begin marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _value(text: str, schema) -> object:
    """An XML argument's value: text, unless the schema's type is another JSON type and the text is one."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or "string" in types:
        return text
    try:
        value = _loads(text)
    except ValueError:
        return text
    kinds = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
             "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
             "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
             "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}
    return value if any(kinds.get(t, lambda v: False)(value) for t in types) else text


def parse_text_call(block: str, tools: ToolRequest) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of `<tool_call>...</tool_call>`, or None when it is malformed."""
    inner = block[len(START):-len(END)].strip()
    if inner.startswith("{"):                    # Qwen2.5/3: JSON
        call = _json_object(inner)
        if call is None or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = _json_object(arguments)
        if not isinstance(arguments, dict) or not FUNCTION_NAME.fullmatch(call["name"]):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)
    function = _FUNCTION.fullmatch(inner)        # Qwen3.5 / Qwen3-Coder: XML
    if function is None or not FUNCTION_NAME.fullmatch(function.group(1)):
        return None
    name, body = function.groups()
    properties = tools.parameters(name).get("properties")
    properties = properties if isinstance(properties, dict) else {}
    arguments, at = {}, 0
    for parameter in _PARAMETER.finditer(body):
        if body[at:parameter.start()].strip():
            return None                          # text between parameters: not this format
        value = parameter.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[parameter.group(1)] = _value(value, properties.get(parameter.group(1)))
        at = parameter.end()
    if body[at:].strip():
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


class TextToolCalls(ToolCalls):
    """`<tool_call>...</tool_call>` in the answer's text (Qwen)."""

    def __init__(self, tools: ToolRequest):
        super().__init__(tools)
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
                call = parse_text_call(block, self.tools)
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
            text = self.pending[:len(self.pending) - _partial(self.pending, START)].rstrip()
            out += self._text(text)
            self.pending = self.pending[len(text):]
            return out


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
                if name is not None and FUNCTION_NAME.fullmatch(name) and _json_object(body) is not None:
                    out += self._call(name, body.strip())
                elif body:
                    out.append((CONTENT, body))
            else:
                out.append((field, text))
        return out

    def finish(self) -> list[tuple]:
        body, self.name, self.body = self.body, None, None
        return [(CONTENT, body)] if body else []


def chat_parsers(tokenizer, prompt_ids: list[int], tools: ToolRequest | None):
    """(the OutputParser of the answer, or None; the ToolCalls reader, or None without active tools)."""
    active = tools is not None and tools.active
    parser = output_parser(tokenizer, prompt_ids, tool_calls=active)
    if not active:
        return parser, None
    if parser is None:
        parser = OutputParser(tokenizer)
    return parser, tool_calls_reader(parser, tools)


def tool_calls_reader(parser: OutputParser, tools: ToolRequest) -> ToolCalls:
    """A fresh reader of calls in the format of `parser`'s answers."""
    return HarmonyToolCalls(tools) if isinstance(parser, HarmonyParser) else TextToolCalls(tools)


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
