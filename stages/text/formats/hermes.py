"""Think tags with hermes calls (Qwen3, Qwen2.5, Qwen3-Next): a call is `<tool_call>` then the JSON
{"name": NAME, "arguments": {...}} then `</tool_call>`."""
from __future__ import annotations

import json

from raymoe.stages.text.formats.think import ThinkFormat
from raymoe.stages.text.grammar import Writer, call_schema, json_rule
from raymoe.stages.text.tool_calls import json_object
from raymoe.stages.text.tools import FUNCTION_NAME, ToolRequest


def parse_json_call(inner: str, tools: ToolRequest) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a hermes call's JSON, or None when it is not one."""
    call = json_object(inner)
    if call is None or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json_object(arguments)
    if not isinstance(arguments, dict) or not FUNCTION_NAME.fullmatch(call["name"]):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def json_call_body(w: Writer, tools: ToolRequest, names: list[str]) -> list[str]:
    """The JSON {"name", "arguments"} of a call to one of `names`, as one JSON schema."""
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": call_schema(tools, n)},
              "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    return [f"body: {json_rule(calls[0] if len(calls) == 1 else {'anyOf': calls})}"]


class Hermes(ThinkFormat):
    name = "hermes"
    template_marks = ("<tool_call>",)

    def parse_call(self, inner: str, tools: ToolRequest) -> tuple[str, str] | None:
        return parse_json_call(inner, tools)

    def call_body(self, w: Writer, tools: ToolRequest, names: list[str]) -> list[str]:
        return json_call_body(w, tools, names)
