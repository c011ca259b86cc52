"""Think tags with Qwen3.5's XML calls (Qwen3.5, Qwen3-Coder): a call is `<tool_call>`, then
`<function=NAME>`, `<parameter=ARG>\\nVALUE\\n</parameter>` for each argument, `</function>`, then
`</tool_call>`, each part on its own line, as the template writes a call back. A value is text when the
function's schema makes the argument a string (or says nothing), else JSON. The reader also takes the
hermes JSON form inside the tags, which these models sometimes write."""
from __future__ import annotations

import json
import re

from raymoe.stages.text.formats.hermes import parse_json_call
from raymoe.stages.text.formats.think import ThinkFormat
from raymoe.stages.text.grammar import Writer, call_schema, json_rule
from raymoe.stages.text.tool_calls import loads
from raymoe.stages.text.tools import FUNCTION_NAME, ToolRequest

_FUNCTION = re.compile(r"<function=([^\s>]+)>(.*)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^\s>]+)>(.*?)</parameter>", re.S)
PARAMETER_END = "\n</parameter>\n"
MAX_BOUNDED_TEXT = 4096          # a string argument's maxLength up to this bounds its text in the grammar
_KINDS = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
          "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}


def _types(schema) -> list | None:
    types = schema.get("type") if isinstance(schema, dict) else None
    return [types] if isinstance(types, str) else types


def _is_text(schema) -> bool:
    """Whether an argument is written as text: a string, or a schema that gives no type."""
    types = _types(schema)
    return not isinstance(types, list) or not types or "string" in types


def _value(text: str, schema) -> object:
    """An argument's value: text, unless the schema's type is another JSON type and the text is one."""
    types = _types(schema)
    if _is_text(schema) or types is None:
        return text
    try:
        value = loads(text)
    except ValueError:
        return text
    return value if any(_KINDS.get(t, lambda v: False)(value) for t in types) else text


def parse_xml_call(inner: str, tools: ToolRequest) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of `<function=NAME>...</function>`, or None when it is malformed."""
    function = _FUNCTION.fullmatch(inner)
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


def _value_rule(w: Writer, rule: str, schema) -> str:
    """The rule `rule` of an argument's value and the line end and `</parameter>` after it."""
    schema = schema if isinstance(schema, dict) else {}
    literals = schema["enum"] if isinstance(schema.get("enum"), list) else \
        [schema["const"]] if "const" in schema else None
    if literals is not None and all(isinstance(v, str) for v in literals) and _is_text(schema):
        return f"{rule}: ({' | '.join(w.text(v) for v in literals)}) {w.text(PARAMETER_END)}"
    if not _is_text(schema):
        return f"{rule}: {json_rule(schema)} {w.text(PARAMETER_END)}"
    bound = schema.get("maxLength")
    repeat = f"{{0,{bound}}}" if isinstance(bound, int) and 0 <= bound <= MAX_BOUNDED_TEXT else "*"
    # lazy: the text ends where the model writes the line end and </parameter> (which it cannot hold)
    return f"{rule}[stop={json.dumps(PARAMETER_END)}]: /(.|\\n){repeat}/"


class QwenXML(ThinkFormat):
    name = "qwen_xml"
    template_marks = ("<function=",)

    def parse_call(self, inner: str, tools: ToolRequest) -> tuple[str, str] | None:
        return parse_xml_call(inner, tools) if inner.startswith("<function=") else parse_json_call(inner, tools)

    def call_body(self, w: Writer, tools: ToolRequest, names: list[str]) -> list[str]:
        rules = [f"body: {' | '.join(f'function_{i}' for i in range(len(names)))}"]
        for i, name in enumerate(names):
            schema = call_schema(tools, name)
            properties = schema.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            required = schema.get("required")
            required = required if isinstance(required, list) else []
            parts = []
            for j, (arg, arg_schema) in enumerate(properties.items()):
                rules.append(f"parameter_{i}_{j}: {w.text(f'<parameter={arg}>' + chr(10))} value_{i}_{j}")
                rules.append(_value_rule(w, f"value_{i}_{j}", arg_schema))
                parts.append(f"parameter_{i}_{j}" + ("" if arg in required else "?"))
            rules.append(f"function_{i}: {w.text(f'<function={name}>' + chr(10))} {' '.join(parts)} "
                         f"{w.text('</function>')}")
        return rules
