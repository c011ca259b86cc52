"""The OpenAPI document of the HTTP API (GET /openapi.json): the request models that the server validates
bodies with (deploy/protocol.py, with this server's limits: its model's name, vocabulary and context,
--max-messages) and the responses' models here, with the responses each status has. What the document refuses,
the server refuses with a 4xx; what it accepts may still be refused for what a schema cannot say (a prompt
longer than the context once tokenized, a chat template that does not take a role).
tests/deploy/test_api_fuzz.py holds the server to the document with schemathesis.
"""
from typing import Any, Literal

from pydantic import Field
from pydantic.json_schema import models_json_schema

from raymoe.deploy.protocol import Closed, ServedModel, request_models

REF = "#/components/schemas/{model}"
SECURITY_SCHEME = "bearerAuth"


# ---- responses (the same whatever the model) --------------------------------------------------------

class ErrorDetail(Closed):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(Closed):
    """Every error: OpenAI's shape, with a code (README, "Errors")."""
    error: ErrorDetail


class PromptTokensDetails(Closed):
    cached_tokens: int = Field(description="the prompt's tokens that the prefix cache gave")


class SpeculationCounts(Closed):
    """Speculative decoding's drafts (docs/speculative-decoding.md)."""
    draft_tokens: int = Field(description="drafts sent with the request's tokens (speculative decoding)")
    accepted_tokens: int = Field(description="drafts the model agreed with: tokens it gave with no step of their own")
    verify_steps: int = Field(description="steps that checked drafts")
    acceptance_rate: float = Field(description="accepted_tokens / draft_tokens")
    mean_accepted_length: float = Field(description="tokens a verify step gave, its own included")


class Usage(Closed):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    speculation: SpeculationCounts | None = Field(None, description="only where the server speculates "
                                                 "(--speculative-config) and the request's tokens had drafts")


FinishReason = Literal["stop", "length"]


class CompletionLogprobs(Closed):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Closed):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    prompt_token_ids: list[int] = Field(None, description="with return_token_ids")
    token_ids: list[int] = Field(None, description="with return_token_ids")


class Completion(Closed):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(Closed):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Closed):
    content: list[TokenLogprob]
    refusal: None


class AssistantMessage(Closed):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(description="the model's reasoning, apart from its answer (docs/chat.md)")


class ChatChoice(Closed):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    prompt_token_ids: list[int] = Field(None, description="with return_token_ids")
    token_ids: list[int] = Field(None, description="with return_token_ids")


class ChatCompletion(Closed):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(Closed):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    prompt_token_ids: list[int] = Field(None, description="with return_token_ids and echo, in the first chunk")
    token_ids: list[int] = Field(None, description="with return_token_ids")


class CompletionChunk(Closed):
    """One server-sent event of a streamed completion (`data: {...}`); the stream ends with `data: [DONE]`.
    An error mid-stream is an event holding an ErrorResponse."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null, and in the last "
                                                  "chunk (no choices) the request's usage")


class ChatDelta(Closed):
    role: Literal["assistant"] = None
    content: str = None
    reasoning_content: str = None


class ChatChunkChoice(Closed):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] = Field(None, description="with return_token_ids")


class ChatCompletionChunk(Closed):
    """One server-sent event of a streamed chat completion; the stream ends with `data: [DONE]`."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="as in CompletionChunk")


class Model(Closed):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(Closed):
    object: Literal["list"]
    data: list[Model]


class TokenizeResponse(Closed):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] = Field(None, description="with return_token_strs")


class DetokenizeResponse(Closed):
    prompt: str


class PrefixCacheLoad(Closed):
    """The prefix cache's size and use (stages/prefix/cache.py; all zero when it is off)."""
    budget_bytes: int
    bytes: int
    blocks: int
    block_tokens: int
    lookups: int
    hits: int
    lookup_tokens: int
    hit_tokens: int
    evicted_blocks: int
    hit_rate: float


class Health(Closed):
    """The engine's load (cluster.coordinator.Coordinator.load)."""
    status: Literal["ok"]
    model: str
    running: int
    waiting: int
    queued: int
    slots: int
    cache_used: float | None
    max_queued: int | None
    sequences: int
    steps: int
    restarts: int
    prefill_tokens: int
    prefix_cache: PrefixCacheLoad
    speculation: SpeculationCounts
    models: dict[str, Any] = Field(None, description="with several models: each one's load (the fields above "
                                                     "are the first's)")


# ---- /v1/responses (deploy/responses_api.py) ----

ItemStatus = Literal["in_progress", "completed"]


class ReasoningText(Closed):
    type: Literal["reasoning_text"]
    text: str


class OutputText(Closed):
    type: Literal["output_text"]
    text: str
    annotations: list
    logprobs: list


class ReasoningItem(Closed):
    id: str
    type: Literal["reasoning"]
    summary: list
    status: ItemStatus
    content: list[ReasoningText]


class MessageItem(Closed):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class FunctionCallItem(Closed):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = ReasoningItem | MessageItem | FunctionCallItem


class InputTokensDetails(Closed):
    cached_tokens: int = Field(description="the prompt's tokens that the prefix cache gave")


class ResponseUsage(Closed):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails


class IncompleteDetails(Closed):
    reason: Literal["max_output_tokens"]


class Response(Closed):
    """POST /v1/responses: the response, with what it echoes of the request."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem]
    error: None
    incomplete_details: IncompleteDetails | None
    metadata: dict
    previous_response_id: None
    store: bool
    truncation: Literal["disabled"]
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool | None
    temperature: float | None
    top_p: float | None
    tool_choice: Any
    tools: list
    text: dict
    reasoning: dict
    usage: ResponseUsage | None


class _Event(Closed):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: Response


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class _ItemEvent(_Event):
    item_id: str
    output_index: int


class _ContentEvent(_ItemEvent):
    content_index: int


class ContentPartEvent(_ContentEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    part: OutputText | ReasoningText


class TextDeltaEvent(_ContentEvent):
    type: Literal["response.output_text.delta", "response.reasoning_text.delta"]
    delta: str
    logprobs: list = Field(None, description="output_text only")


class TextDoneEvent(_ContentEvent):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    text: str
    logprobs: list = Field(None, description="output_text only")


class ArgumentsDeltaEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.delta"]
    delta: str


class ArgumentsDoneEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.done"]
    name: str
    arguments: str


class ResponseErrorEvent(_Event):
    """An error mid-stream (its last event)."""
    type: Literal["error"]
    code: str
    message: str
    param: str | None


# ---- /v1/messages (deploy/messages_api.py) ----

class TextBlock(Closed):
    type: Literal["text"]
    text: str


class ThinkingBlock(Closed):
    type: Literal["thinking"]
    thinking: str
    signature: str


class ToolUseBlock(Closed):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(Closed):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = Field(description="the prompt's tokens that the prefix cache gave")


class Message(Closed):
    """POST /v1/messages: the assistant's message."""
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class AnthropicErrorDetail(Closed):
    type: str
    message: str


class AnthropicError(Closed):
    """Every error of /v1/messages (and its stream's error event): Anthropic's shape."""
    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageStartEvent(Closed):
    type: Literal["message_start"]
    message: Message


class BlockStartEvent(Closed):
    type: Literal["content_block_start"]
    index: int
    content_block: ContentBlock


class TextDelta(Closed):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(Closed):
    type: Literal["thinking_delta"]
    thinking: str


class InputJsonDelta(Closed):
    type: Literal["input_json_delta"]
    partial_json: str


class BlockDeltaEvent(Closed):
    type: Literal["content_block_delta"]
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class BlockStopEvent(Closed):
    type: Literal["content_block_stop"]
    index: int


class MessageDelta(Closed):
    stop_reason: StopReason | None
    stop_sequence: str | None


class OutputUsage(Closed):
    output_tokens: int


class MessageDeltaEvent(Closed):
    type: Literal["message_delta"]
    delta: MessageDelta
    usage: OutputUsage


class MessageStopEvent(Closed):
    type: Literal["message_stop"]


MESSAGE_EVENTS = [MessageStartEvent, BlockStartEvent, BlockDeltaEvent, BlockStopEvent, MessageDeltaEvent,
                  MessageStopEvent, AnthropicError]
RESPONSE_EVENTS = [ResponseLifecycleEvent, OutputItemEvent, ContentPartEvent, TextDeltaEvent, TextDoneEvent,
                   ArgumentsDeltaEvent, ArgumentsDoneEvent, ResponseErrorEvent]
RESPONSES = [ErrorResponse, Completion, ChatCompletion, CompletionChunk, ChatCompletionChunk, ModelList,
             TokenizeResponse, DetokenizeResponse, Health, Response, *RESPONSE_EVENTS, Message, *MESSAGE_EVENTS]


# ---- the document -----------------------------------------------------------------------------------

def _json(name: str) -> dict:
    return {"application/json": {"schema": {"$ref": REF.format(model=name)}}}


def _error(description: str, model: str = "ErrorResponse") -> dict:
    return {"description": description, "content": _json(model)}


ERRORS = {400: "a request that the server refuses (the error names the field)", 401: "no or a wrong API key",
          404: "an unknown model", 413: "a body larger than --max-body-bytes",
          503: "the server is busy (queue_full), its pipeline is down, it is shutting down, or the replica serving the "
               "request died (replica_unavailable: retry)"}
HEALTH_503 = "the engine cannot serve (it gave up, or it is stalled), or the server is shutting down"


def document_requests(served: list[ServedModel]) -> dict:
    """The request models a document gives: the served model's, or with several, ones that name them all, with
    the largest limits of any (each model's own still apply to its requests)."""
    if len(served) == 1:
        return served[0].requests
    return request_models(tuple(s.name for s in served), max(s.vocab for s in served),
                          max(s.context_length for s in served), served[0].max_messages,
                          max_text_chars=max(s.context_length * s.tokenizer.max_token_bytes for s in served))


def openapi_document(app, served: list[ServedModel], *, api_key: bool, version: str = "0.1.0") -> dict:
    """The document of `app` (deploy.http_app.api) for its served models (api_key: whether it needs a key)."""
    from fastapi.openapi.utils import get_openapi
    doc = get_openapi(title=app.title, version=version, routes=app.routes,
                      description="raymoe's OpenAI-compatible API (README, docs/chat.md)")
    models = [*document_requests(served).values(), *RESPONSES]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    components = doc.setdefault("components", {})
    components["schemas"] = {**components.get("schemas", {}), **defs["$defs"]}
    def events(chunk: str) -> dict:
        """text/event-stream: each event's data a chunk as JSON (an error mid-stream: an ErrorResponse), the last
        one `[DONE]`."""
        payload = {"type": "string", "contentMediaType": "application/json",
                   "contentSchema": {"anyOf": [{"$ref": REF.format(model=chunk)},
                                               {"$ref": REF.format(model="ErrorResponse")}]}}
        return {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"], "properties": {"data": {"anyOf": [{"const": "[DONE]"}, payload]}},
            "description": f"with stream: true, server-sent events `data: <{chunk} as JSON>`, then `data: [DONE]`"}}}

    def generation(request: str, response: str, chunk: str) -> dict:
        return {"body": _json(request), "ok": {**_json(response), **events(chunk)}, "errors": (400, 401, 404, 413, 503),
                "secured": True}

    def named_events(models: list, span: str) -> dict:
        """text/event-stream of named events (`event: <type>`), each one's data an event object of `models`."""
        payload = {"type": "string", "contentMediaType": "application/json",
                   "contentSchema": {"anyOf": [{"$ref": REF.format(model=m.__name__)} for m in models]}}
        return {"text/event-stream": {"schema": {
            "type": "object", "required": ["event", "data"], "properties": {"event": {"type": "string"}, "data": payload},
            "description": f"with stream: true, events `event: <type>` `data: <the event as JSON>`, {span}"}}}

    operations = {
        ("/v1/models", "get"): {"ok": _json("ModelList"), "errors": (401,), "secured": True},
        ("/v1/completions", "post"): generation("CompletionRequest", "Completion", "CompletionChunk"),
        ("/v1/chat/completions", "post"): generation("ChatRequest", "ChatCompletion", "ChatCompletionChunk"),
        ("/v1/responses", "post"): {"body": _json("ResponsesRequest"), "ok": {**_json("Response"), **named_events(
            RESPONSE_EVENTS, "from response.created to response.completed (or response.incomplete, or error)")},
            "errors": (400, 401, 404, 413, 503), "secured": True},
        ("/v1/messages", "post"): {"body": _json("MessagesRequest"), "ok": {**_json("Message"), **named_events(
            MESSAGE_EVENTS, "from message_start to message_stop (or error)")},
            "errors": (400, 401, 404, 413, 503), "secured": True, "error_model": "AnthropicError"},
        ("/tokenize", "post"): {"body": {"application/json": {"schema": {"oneOf": [
            {"$ref": REF.format(model="TokenizePrompt")}, {"$ref": REF.format(model="TokenizeChat")}]}}},
            "ok": _json("TokenizeResponse"), "errors": (400, 401, 404, 413), "secured": True},
        ("/detokenize", "post"): {"body": _json("DetokenizeRequest"), "ok": _json("DetokenizeResponse"),
                                  "errors": (400, 401, 404, 413), "secured": True},
        ("/health", "get"): {"ok": _json("Health"), "errors": (503,), "secured": False},
        ("/metrics", "get"): {"ok": {"text/plain": {"schema": {"type": "string"}}}, "errors": (), "secured": False},
    }
    if api_key:
        components["securitySchemes"] = {SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}}
    for (path, method), op in operations.items():
        entry = doc["paths"][path][method]
        if "body" in op:
            entry["requestBody"] = {"required": True, "content": op["body"]}
        entry["responses"] = {"200": {"description": "OK", "content": op["ok"]},
                              **{str(status): _error(ERRORS[status], op.get("error_model", "ErrorResponse"))
                                 for status in op["errors"] if status != 401 or api_key}}
        if op["secured"] and api_key:
            entry["security"] = [{SECURITY_SCHEME: []}]
    doc["paths"]["/health"]["get"]["responses"]["503"]["description"] = HEALTH_503
    return doc
