"""Function tools in a chat request: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` (an API
body's fields, or a batch line's keys), checked and bounded, and the tool calls of the history
(assistant `tool_calls`) shaped as transformers' callers pass them to a chat template.

The model's own calls are read from its output by stages/text/tool_calls.py.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from raymoe.stages.errors import RequestError, check_json_size

MAX_TOOLS = 128                      # OpenAI's own bound
MAX_TOOLS_BYTES = 256 * 1024         # the tools as JSON: they are rendered into every prompt of the request
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")     # OpenAI's rule for a function's name
TOOL_CHOICES = ("auto", "none", "required")
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools. choice: "auto", "none", "required", or "function" (the function
    `name`, OpenAI's {"type": "function", "function": {"name": ...}})."""
    tools: tuple = ()
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether tools reach the template and calls are read from the output."""
        return bool(self.tools) and self.choice != "none"

    def template_tools(self) -> list[dict] | None:
        """The `tools` variable of the chat template: None without tools or with tool_choice none, only
        the named function with a named tool_choice (so that the prompt offers it alone), else all."""
        if not self.active:
            return None
        if self.name is not None:
            return [t for t in self.tools if t["function"]["name"] == self.name]
        return list(self.tools)

    def parameters(self, name: str) -> dict:
        """The JSON schema of the function's parameters ({} when it has none or is not offered)."""
        for tool in self.tools:
            if tool["function"]["name"] == name:
                parameters = tool["function"].get("parameters")
                return parameters if isinstance(parameters, dict) else {}
        return {}


def _check_tool(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise RequestError(f"{where} must be an object {{\"type\": \"function\", \"function\": {{...}}}}")
    kind = tool.get("type", "function")
    if kind != "function":
        raise RequestError(f"{where}.type: only function tools are supported, got {_short(kind)}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise RequestError(f"{where}.function must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise RequestError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {_short(name)}")
    out = {"name": name}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise RequestError(f"{where}.function.description must be a string")
        out["description"] = description
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise RequestError(f"{where}.function.parameters must be a JSON schema (an object)")
        out["parameters"] = parameters
    strict = function.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise RequestError(f"{where}.function.strict must be a boolean")
        out["strict"] = strict
    return {"type": "function", "function": out}


def check_tools(tools) -> tuple:
    """The tools as fresh dicts of OpenAI's shape, or RequestError naming what is wrong: a list of at most
    MAX_TOOLS function tools with distinct names, MAX_TOOLS_BYTES as JSON."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise RequestError(f"tools must be a list of function tools, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed")
    check_json_size(tools, "tools", MAX_TOOLS_BYTES)
    out, seen = [], set()
    for i, tool in enumerate(tools):
        tool = _check_tool(tool, i)
        name = tool["function"]["name"]
        if name in seen:
            raise RequestError(f"tools[{i}].function.name: {name!r} is given twice")
        seen.add(name)
        out.append(tool)
    return tuple(out)


def tool_request(request: dict) -> ToolRequest | None:
    """The tools of a request (an API body or a batch line), or None when it offers none; RequestError
    (its message starting with the field's name) for a bad value."""
    tools = check_tools(request.get("tools"))
    choice, name = request.get("tool_choice"), None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        if (choice.get("type") != "function" or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)):
            raise RequestError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                               f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {_short(choice)}")
        choice, name = "function", function["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise RequestError(f"tool_choice names the function {name!r}, which tools does not offer")
    elif choice not in TOOL_CHOICES:
        raise RequestError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                           f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {_short(choice)}")
    if choice == "required" and not tools:
        raise RequestError("tool_choice 'required' needs tools")
    parallel = request.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    elif not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls must be a boolean, got {_short(parallel)}")
    if not tools:
        return None
    return ToolRequest(tools, choice, name, parallel)


def history_tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's `tool_calls` for the template: fresh dicts whose `function.arguments` is a
    mapping (the JSON text OpenAI's clients send, parsed, as transformers' callers pass it)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise RequestError(f"{where} must be a list")
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise RequestError(f"{where}[{j}] must be an object with a function {{\"name\", \"arguments\"}}")
        function = call["function"]
        if not isinstance(function.get("name"), str):
            raise RequestError(f"{where}[{j}].function.name must be a string")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as e:
                raise RequestError(f"{where}[{j}].function.arguments is not valid JSON ({e})") from None
        if not isinstance(arguments, dict):
            raise RequestError(f"{where}[{j}].function.arguments must be a JSON object")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out
