"""OpenAI's Responses API (POST /v1/responses), which gpt-oss clients use, over the chat path.

A Responses body becomes a chat body (`input` and `instructions` become messages, function tools and
`tool_choice` their chat forms, `max_output_tokens` max_completion_tokens, `text.format` response_format,
`reasoning.effort` reasoning_effort) that deploy/openai_api.py parses as any chat; the answer's pieces
(reasoning, text, tool calls: stages/text/reasoning.py, stages/text/tool_calls.py) become output items:
`reasoning` (its text as `reasoning_text` content), `message` (`output_text`) and `function_call`. A
stream sends the Responses events (`response.created`, `response.output_item.added`,
`response.reasoning_text.delta`, `response.output_text.delta`, `response.function_call_arguments.delta`,
..., `response.completed`), and its last event holds the body that the same request unstreamed gets.
Only function tools: hosted ones (web search, file search, ...) are refused by name.
"""
from __future__ import annotations

import json
import uuid

from raymoe.deploy.api_errors import UNSUPPORTED, APIError
from raymoe.deploy.answer_events import AnswerEvents
from raymoe.deploy.openai_api import Prepared, parse_chat
from raymoe.deploy.protocol import ServedModel
from raymoe.stages.text.reasoning import REASONING, OutputParser

# a chat field's name in the Responses body, for the errors that parse_chat raises
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
          "reasoning_effort": "reasoning"}
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content, where: str) -> str:
    """Message or tool-output content: text, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}: only text parts are supported", param="input", code=UNSUPPORTED)
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"{where} must be text or a list of text parts", param="input")


def _messages(body: dict) -> list[dict]:
    """`instructions` (a system message) and `input` (text, or a list of message, function_call,
    function_call_output and reasoning items) as chat messages; a reasoning item goes with the assistant
    turn after it, as its reasoning_content."""
    instructions, given = body.get("instructions"), body["input"]
    messages = [] if instructions is None else [{"role": "system", "content": instructions}]
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}]
    reasoning = None

    def assistant() -> dict:
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or reasoning is not None:
            last = {"role": "assistant", "content": ""}
            if reasoning is not None:
                last["reasoning_content"], reasoning = reasoning, None
            messages.append(last)
        return last

    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise APIError(400, f"{where}.role must be one of {', '.join(INPUT_ROLES)}, got {repr(role)[:40]}",
                               param="input")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                message = assistant()
                message["content"] += text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise APIError(400, f"{where}: a function_call needs call_id, name and arguments (strings)",
                               param="input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}.call_id must be a string", param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise APIError(400, f"{where}.content must be a list of reasoning_text parts", param="input")
            reasoning = "".join(p["text"] for p in parts)
        else:
            raise APIError(400, f"{where}.type {repr(kind)[:40]} is not supported (message, function_call, "
                                f"function_call_output, reasoning)", param="input", code=UNSUPPORTED)
    return messages


def _tools(body: dict):
    """Responses' function tools ({"type": "function", "name", ...}) and tool_choice in their chat forms."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        tools = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in tools]
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _response_format(text: dict):
    """text.format as a chat response_format ({"type": "json_schema", "name", "schema", ...} flat here)."""
    fmt = text.get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def parse_responses(body: dict, served: ServedModel) -> Prepared:
    """POST /v1/responses: checked, turned into a chat body, and prepared as a chat."""
    tools = body.get("tools") if isinstance(body, dict) else None
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if isinstance(tool, dict) and tool.get("type") != "function":     # named before the schema's error
            raise APIError(400, f"tools[{i}]: {repr(tool.get('type'))[:40]} tools are not supported: this server "
                                f"runs no hosted tools, only function tools", param="tools", code=UNSUPPORTED)
    served.validate("ResponsesRequest", body)
    reasoning, text = body.get("reasoning") or {}, body.get("text") or {}
    tools, tool_choice = _tools(body)
    chat = {"model": body.get("model"), "messages": _messages(body), "stream": body.get("stream"),
            "max_completion_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "tools": tools, "tool_choice": tool_choice,
            "parallel_tool_calls": body.get("parallel_tool_calls"), "reasoning_effort": reasoning.get("effort"),
            "response_format": _response_format(text)}
    try:
        p = parse_chat({k: v for k, v in chat.items() if v is not None}, served)
    except APIError as e:        # name the field as this body has it
        if e.param in PARAMS:
            e.message = e.message.replace(e.param, PARAMS[e.param], 1) if e.message.startswith(e.param) else e.message
            e.param = PARAMS[e.param]
        raise
    p.kind, p.id = "response", _new_id("resp")
    p.parser = p.parser or OutputParser(served.tokenizer)     # items need the pieces, even of a plain answer
    p.response_fields = {
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": p.tools.parallel if p.tools else body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "text": {"format": text.get("format") or {"type": "text"}},
        "reasoning": {"effort": reasoning.get("effort"), "summary": None}}
    return p


class ResponseItems(AnswerEvents):
    """One response's output items, built from the answer's pieces as they come, with the stream events
    that say so (`events` is what a stream sends; an unstreamed response takes only `body`)."""

    def __init__(self, p: Prepared):
        super().__init__(p)
        self.items: list[dict] = []
        self.open: dict | None = None          # the reasoning or message item being written
        self.sequence = 0

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def body(self, status: str = "completed", result: dict | None = None) -> dict:
        out = {"id": self.p.id, "object": "response", "created_at": self.p.created, "status": status,
               "model": self.p.model, "output": self.items if status != "in_progress" else [], "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "metadata": {}, "previous_response_id": None, "store": False, "truncation": "disabled",
               **self.p.response_fields, "usage": None}
        if result is not None:
            prompt, output = result["usage"]["prompt_tokens"], result["usage"]["completion_tokens"]
            out["usage"] = {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output,
                            "input_tokens_details": {"cached_tokens": result["usage"].get("cached_tokens", 0)}}
        return out

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.body("in_progress")),
                self._event("response.in_progress", response=self.body("in_progress"))]

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, part = len(self.items) - 1, item["content"][0]
        item["status"] = "completed"
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        return [self._event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=_copy(item))]

    def _text(self, field: str, text: str) -> list[dict]:
        kind = "reasoning" if field == REASONING else "message"
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            if kind == "reasoning":
                item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                        "content": []}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._add(item)
            item["content"].append(part)
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                   content_index=0, part=dict(part)))
            self.open = item
        self.open["content"][0]["text"] += text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self._event(delta, item_id=self.open["id"], output_index=len(self.items) - 1, content_index=0,
                                  delta=text, **extra)]

    def _call(self, call: dict) -> list[dict]:
        function = call["function"]
        item = {"id": _new_id("fc"), "type": "function_call", "call_id": call["id"], "name": function["name"],
                "arguments": "", "status": "in_progress"}
        out = self._close() + self._add(item)
        index = len(self.items) - 1
        item.update(arguments=function["arguments"], status="completed")
        return out + [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=function["arguments"]),
                      self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=function["name"], arguments=function["arguments"]),
                      self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _end(self, result: dict) -> list[dict]:
        status = "incomplete" if result["finish_reason"] == "length" and not self.called else "completed"
        return [self._event(f"response.{status}", response=self.body(status, result))]


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


def response_body(p: Prepared, result: dict) -> dict:
    """The unstreamed response: the items a stream of the same result would build."""
    return ResponseItems(p).update({"token_ids": result.get("token_ids", []), "finished": result})[-1]["response"]


def response_sse(event: dict) -> str:
    """A Responses stream event: its type as the SSE event name, as OpenAI sends them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def error_event(e: APIError, sequence: int) -> dict:
    return {"type": "error", "sequence_number": sequence, "code": e.code, "message": e.message, "param": e.param}
