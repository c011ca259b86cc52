"""Anthropic's Messages API (POST /v1/messages) over the chat path, so that agents written against it run on a
local model (llama-server answers it too).

A Messages body becomes a chat body: `system` a system message; each message's blocks chat messages (`text`
joined, `tool_use` an assistant's tool_calls, `tool_result` a tool message, `thinking` the assistant's
reasoning_content); tools (`name`, `description`, `input_schema`) function tools; `tool_choice` `auto`, `any`
(required), `tool` (a named function) or `none`; `stop_sequences` stop; `thinking` a reasoning budget
(`enabled` with `budget_tokens`: thinking_token_budget; `disabled`: 0); `output_config` a JSON schema
(`format`) and the template's reasoning_effort (`effort`); temperature, top_p and top_k as the chat's.
deploy/openai_api.py parses it as any chat. The answer's pieces (stages/text/reasoning.py, stages/text/tool_calls.py) become content blocks:
`thinking`, `text` and `tool_use`, with a `stop_reason` (`end_turn`, `max_tokens`, `stop_sequence`,
`tool_use`). A stream sends Anthropic's events: message_start, content_block_start / _delta / _stop per block,
message_delta (the stop reason and the output's usage), message_stop. Errors have Anthropic's shape.
"""
from __future__ import annotations

import json
import uuid

from raymoe.deploy.api_errors import APIError
from raymoe.deploy.answer_events import AnswerEvents
from raymoe.deploy.openai_api import Prepared, parse_chat
from raymoe.deploy.protocol import ServedModel
from raymoe.stages.text.detokenizer import Detokenizer
from raymoe.stages.text.reasoning import REASONING, OutputParser

# a chat field's name in the Messages body, for the errors that parse_chat raises
PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "thinking_token_budget": "thinking",
          "response_format": "output_config", "reasoning_effort": "output_config"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 500: "api_error", 503: "overloaded_error"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def error_body(e: APIError) -> dict:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def _text(blocks) -> str:
    return blocks if isinstance(blocks, str) else "".join(b["text"] for b in blocks or ())


def _messages(body: dict) -> list[dict]:
    """The chat messages of `system` and `messages`: a user turn's tool results as tool messages (before its
    text), an assistant turn's blocks as one assistant message."""
    out = [] if body.get("system") is None else [{"role": "system", "content": _text(body["system"])}]
    for message in body["messages"]:
        content, role = message["content"], message["role"]
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif role == "user":
            out += [{"role": "tool", "tool_call_id": b["tool_use_id"], "content": _text(b.get("content"))}
                    for b in content if b["type"] == "tool_result"]
            texts = [b["text"] for b in content if b["type"] == "text"]
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
        else:
            turn = {"role": "assistant", "content": "".join(b["text"] for b in content if b["type"] == "text")}
            thinking = "".join(b["thinking"] for b in content if b["type"] == "thinking")
            if thinking:
                turn["reasoning_content"] = thinking
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}}
                     for b in content if b["type"] == "tool_use"]
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def _tool_choice(choice: dict | None):
    if choice is None:
        return None
    if choice["type"] == "tool":
        if choice.get("name") is None:
            raise APIError(400, "tool_choice: type tool needs a name", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return TOOL_CHOICES[choice["type"]]


def _budget(thinking: dict | None) -> int | None:
    """thinking_token_budget of a thinking config: disabled 0, enabled its budget_tokens, else the model's own."""
    if thinking is None:
        return None
    if thinking["type"] == "disabled":
        return 0
    return thinking.get("budget_tokens") if thinking["type"] == "enabled" else -1


def _response_format(config: dict) -> dict | None:
    fmt = config.get("format")
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def parse_messages(body: dict, served: ServedModel) -> Prepared:
    """POST /v1/messages: checked, turned into a chat body, and prepared as a chat."""
    served.validate("MessagesRequest", body)
    tools, config = body.get("tools"), body.get("output_config") or {}
    choice = body.get("tool_choice") or {}
    effort = config.get("effort")
    chat = {"model": body.get("model"), "messages": _messages(body), "stream": body.get("stream"),
            "max_completion_tokens": body["max_tokens"], "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "top_k": body.get("top_k"), "stop": body.get("stop_sequences"),
            "tools": None if tools is None else [
                {"type": "function", "function": {"name": t["name"], "description": t.get("description"),
                                                  "parameters": t["input_schema"]}} for t in tools],
            "tool_choice": _tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": None if choice.get("disable_parallel_tool_use") is None
            else not choice["disable_parallel_tool_use"],
            "thinking_token_budget": _budget(body.get("thinking")), "response_format": _response_format(config),
            "reasoning_effort": {"xhigh": "high", "max": "high"}.get(effort, effort)}
    try:
        p = parse_chat({k: v for k, v in chat.items() if v is not None}, served)
    except APIError as e:        # name the field as this body has it
        if e.param in PARAMS:
            e.message = e.message.replace(e.param, PARAMS[e.param], 1)
            e.param = PARAMS[e.param]
        raise
    p.kind, p.id = "message", f"msg_{uuid.uuid4().hex}"
    p.parser = p.parser or OutputParser(served.tokenizer)     # blocks need the pieces, even of a plain answer
    return p


class MessageBlocks(AnswerEvents):
    """One message's content blocks, built from the answer's pieces as they come, with the stream events that
    say so (an unstreamed message takes only the last event's message)."""

    def __init__(self, p: Prepared, tokenizer):
        super().__init__(p)
        self.tokenizer = tokenizer
        self.blocks: list[dict] = []
        self.open: dict | None = None          # the thinking or text block being written

    def message(self, result: dict | None = None) -> dict:
        out = {"id": self.p.id, "type": "message", "role": "assistant", "model": self.p.model,
               "content": self.blocks if result is not None else [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": len(self.p.prompt_ids), "output_tokens": 0, "cache_read_input_tokens": 0}}
        if result is not None:
            out.update(self._stop(result))
            out["usage"].update(output_tokens=result["usage"]["completion_tokens"],
                                cache_read_input_tokens=result["usage"].get("cached_tokens", 0))
        return out

    def _stop(self, result: dict) -> dict:
        """stop_reason and stop_sequence: the stop sequence is the first that the whole output holds where its
        text was cut."""
        if self.called:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if result["finish_reason"] == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        whole = ""
        if self.stops:            # the output's text as the engine wrote it before the cut
            detokenizer = Detokenizer(self.tokenizer)
            whole = "".join(map(detokenizer.add, result["token_ids"])) + detokenizer.finish()
        found = [s for s in self.stops if whole.startswith(s, len(result["text"]))]
        if found:
            return {"stop_reason": "stop_sequence", "stop_sequence": found[0]}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": self.message()}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _add(self, block: dict, shown: dict) -> list[dict]:
        out = self._close()
        self.blocks.append(block)
        return out + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": shown}]

    def _text(self, field: str, text: str) -> list[dict]:
        kind = "thinking" if field == REASONING else "text"
        out = []
        if self.open is None or self.open["type"] != kind:
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            out += self._add(block, dict(block))
            self.open = block
        self.open[kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return out + [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def _call(self, call: dict) -> list[dict]:
        function = call["function"]
        block = {"type": "tool_use", "id": call["id"], "name": function["name"],
                 "input": json.loads(function["arguments"] or "{}")}
        out = self._add(block, {**block, "input": {}})
        index = len(self.blocks) - 1
        return out + [{"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}},
                      {"type": "content_block_stop", "index": index}]

    def _end(self, result: dict) -> list[dict]:
        message = self.message(result)
        return [{"type": "message_delta", "delta": {k: message[k] for k in ("stop_reason", "stop_sequence")},
                 "usage": {"output_tokens": message["usage"]["output_tokens"]}},
                {"type": "message_stop", "message": message}]


def message_body(p: Prepared, result: dict, tokenizer) -> dict:
    """The unstreamed message: the blocks a stream of the same result would build."""
    return MessageBlocks(p, tokenizer).update({"token_ids": result.get("token_ids", []), "finished": result})[-1]["message"]


def message_sse(event: dict) -> str:
    """A Messages stream event, its type as the SSE event name (message_stop goes without its message)."""
    data = {"type": "message_stop"} if event["type"] == "message_stop" else event
    return f"event: {event['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
