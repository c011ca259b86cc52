"""The OpenAPI document of the HTTP API (GET /openapi.json), from pydantic models used for documentation only.

The handlers read raw bodies (deploy/http_app.py: the body-size and JSON-depth limits come first) and
deploy/openai_api.py validates them, with its own error messages. The models here say the same in JSON
Schema, with this server's own limits (its model's name, vocabulary and context, --max-messages), and the
responses each status has. What the document refuses, the server refuses with a 4xx; what it accepts may
still be refused for what a schema cannot say (a prompt longer than the context once tokenized, a chat
template that does not take a role). tests/deploy/test_api_fuzz.py holds the server to the document with
schemathesis.
"""
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from raymoe.deploy.openai_api import CHAT_ROLES
from raymoe.stages.text.chat import MAX_TEMPLATE_KWARGS
from raymoe.stages.errors import RequestError
from raymoe.stages.text.requests import chat_prompt
from raymoe.stages.text.tools import MAX_TOOLS
from raymoe.stages.text.sampling_params import (MAX_BIAS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_PENALTY,
                                                MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_STOPS, REPETITION_RANGE)

REF = "#/components/schemas/{model}"
SECURITY_SCHEME = "bearerAuth"


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")       # additionalProperties: false (unknown fields are refused)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- responses (the same whatever the model) --------------------------------------------------------

class ErrorDetail(_Closed):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(_Closed):
    """Every error: OpenAI's shape, with a code (README, "Errors")."""
    error: ErrorDetail


class Usage(_Closed):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class CompletionLogprobs(_Closed):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Closed):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    prompt_token_ids: list[int] = Field(None, description="with return_token_ids")
    token_ids: list[int] = Field(None, description="with return_token_ids")


class Completion(_Closed):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Closed):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Closed):
    content: list[TokenLogprob]
    refusal: None


class AssistantMessage(_Closed):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(description="the model's reasoning, apart from its answer (docs/chat.md)")


class ChatChoice(_Closed):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    prompt_token_ids: list[int] = Field(None, description="with return_token_ids")
    token_ids: list[int] = Field(None, description="with return_token_ids")


class ChatCompletion(_Closed):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(_Closed):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    prompt_token_ids: list[int] = Field(None, description="with return_token_ids and echo, in the first chunk")
    token_ids: list[int] = Field(None, description="with return_token_ids")


class CompletionChunk(_Closed):
    """One server-sent event of a streamed completion (`data: {...}`); the stream ends with `data: [DONE]`.
    An error mid-stream is an event holding an ErrorResponse."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null, and in the last "
                                                  "chunk (no choices) the request's usage")


class ChatDelta(_Closed):
    role: Literal["assistant"] = None
    content: str = None
    reasoning_content: str = None


class ChatChunkChoice(_Closed):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] = Field(None, description="with return_token_ids")


class ChatCompletionChunk(_Closed):
    """One server-sent event of a streamed chat completion; the stream ends with `data: [DONE]`."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="as in CompletionChunk")


class Model(_Closed):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Closed):
    object: Literal["list"]
    data: list[Model]


class TokenizeResponse(_Closed):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] = Field(None, description="with return_token_strs")


class DetokenizeResponse(_Closed):
    prompt: str


class PrefixCacheLoad(_Closed):
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


class Health(_Closed):
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


# ---- /v1/responses (deploy/responses_api.py) ----

ItemStatus = Literal["in_progress", "completed"]


class ReasoningText(_Closed):
    type: Literal["reasoning_text"]
    text: str


class OutputText(_Closed):
    type: Literal["output_text"]
    text: str
    annotations: list
    logprobs: list


class ReasoningItem(_Closed):
    id: str
    type: Literal["reasoning"]
    summary: list
    status: ItemStatus
    content: list[ReasoningText]


class MessageItem(_Closed):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class FunctionCallItem(_Closed):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = ReasoningItem | MessageItem | FunctionCallItem


class ResponseUsage(_Closed):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class IncompleteDetails(_Closed):
    reason: Literal["max_output_tokens"]


class Response(_Closed):
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


class _Event(_Closed):
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


RESPONSE_EVENTS = [ResponseLifecycleEvent, OutputItemEvent, ContentPartEvent, TextDeltaEvent, TextDoneEvent,
                   ArgumentsDeltaEvent, ArgumentsDoneEvent, ResponseErrorEvent]
RESPONSES = [ErrorResponse, Completion, ChatCompletion, CompletionChunk, ChatCompletionChunk, ModelList,
             TokenizeResponse, DetokenizeResponse, Health, Response, *RESPONSE_EVENTS]


# ---- requests (with this server's limits) -------------------------------------------------------------

def request_models(model_name: str, vocab: int, context_length: int, max_messages: int, *,
                   max_text_chars: int, min_text_chars: int = 0, roles: tuple[str, ...] = CHAT_ROLES
                   ) -> list[type[BaseModel]]:
    """The request bodies' models for a server of `model_name` (its vocabulary and context) and --max-messages;
    prompt text of fewer than min_text_chars characters has no tokens, text longer than max_text_chars cannot
    fit the context whatever its tokens; `roles`: those the chat template takes."""
    TokenId = Annotated[int, Field(ge=0, le=vocab - 1)]
    ModelName = Literal[model_name, ""]          # "": the served model too
    TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=context_length - 1)]
    StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
    Anything = Any
    SchemaName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]

    class TextPart(_Open):
        type: Literal["text"]
        text: str

    class Message(_Open):
        """A chat message; other fields (name, tool_call_id, ...) go to the chat template as they are."""
        role: Literal[roles] = Field(description="those of OpenAI's that the model's chat template takes")
        content: str | list[TextPart] | None = None
        reasoning_content: str | None = Field(None, description="reasoning of an earlier assistant turn "
                                                                "(also as `thinking` or `reasoning`)")
        thinking: str | None = None
        reasoning: str | None = None

    TemplateKwargs = Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS,
                                                     description="variables of the chat template (identifiers)")]
    Messages = Annotated[list[Message], Field(min_length=1, max_length=max_messages)]

    class StreamOptions(_Closed):
        include_usage: bool | None = None

    class Sampling(_Closed):
        model: ModelName | None = Field(None, description="the served model (GET /v1/models)")
        n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
        stream: bool | None = None
        stream_options: StreamOptions | None = Field(None, description="only with stream: true")
        max_tokens: Annotated[int, Field(ge=1, le=context_length)] | None = None
        temperature: Annotated[float, Field(ge=0, le=100)] | None = None
        top_p: Annotated[float, Field(gt=0, le=1)] | None = None
        top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="0 or -1: off")
        min_p: Annotated[float, Field(ge=0, le=1)] | None = None
        seed: Annotated[int, Field(ge=0, le=2 ** 63 - 1)] | None = None
        stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
        stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
        ignore_eos: bool | None = None
        presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
        frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
        repetition_penalty: Annotated[float, Field(ge=REPETITION_RANGE[0], le=REPETITION_RANGE[1])] | None = None
        logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,19}$")],
                                   Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]],
                              Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
            None, description="token id (a decimal string) -> bias")
        return_token_ids: bool | None = None
        user: Anything = Field(None, description="accepted and ignored (as are metadata, store, service_tier)")
        metadata: Anything = None
        store: Anything = None
        service_tier: Anything = None

    class CompletionRequest(Sampling):
        """POST /v1/completions."""
        prompt: (Annotated[str, Field(min_length=min_text_chars, max_length=max_text_chars)] | TokenIds
                 | Annotated[list[Annotated[str, Field(min_length=min_text_chars, max_length=max_text_chars)]],
                    Field(min_length=1, max_length=1)]
                 | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]) = Field(
            description="text, or token ids (or a list of one of either)")
        echo: bool | None = None
        logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
        suffix: Literal[""] | None = Field(None, description="not supported")
        best_of: Literal[1] | None = None

    class PlainFormat(_Closed):
        type: Literal["text", "json_object"]

    class JsonSchema(_Closed):
        name: SchemaName
        schema_: dict[str, Any] = Field(None, alias="schema", description="a JSON schema (llguidance compiles it)")
        strict: bool | None = None
        description: str | None = None

    class SchemaFormat(_Closed):
        type: Literal["json_schema"]
        json_schema: JsonSchema

    ResponseFormat = PlainFormat | SchemaFormat

    class FunctionDefinition(_Open):
        name: SchemaName
        description: str | None = None
        parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
        strict: bool | None = None

    class ChatTool(_Open):
        type: Literal["function"] = "function"
        function: FunctionDefinition

    class FunctionName(_Open):
        name: SchemaName

    class ToolChoiceFunction(_Open):
        type: Literal["function"]
        function: FunctionName

    class ChatRequest(Sampling):
        """POST /v1/chat/completions."""
        messages: Messages
        max_completion_tokens: Annotated[int, Field(ge=1, le=context_length)] | None = None
        logprobs: bool | None = None
        top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(None, description="with logprobs")
        tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = Field(
            None, description="function tools, distinct names (docs/chat.md)")
        functions: Annotated[list, Field(max_length=0)] | None = Field(None, description="not supported: tools")
        tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = Field(
            None, description="a named function must be one of tools; required needs tools")
        function_call: Literal["none"] | None = None
        parallel_tool_calls: bool | None = None
        response_format: ResponseFormat | None = Field(None, description="structured outputs (docs/chat.md)")
        chat_template_kwargs: TemplateKwargs | None = None
        reasoning_effort: Literal["low", "medium", "high"] | None = None

    class Tokenize(_Closed):
        model: ModelName | None = None
        add_generation_prompt: bool | None = None
        add_special_tokens: bool | None = None
        return_token_strs: bool | None = None
        chat_template_kwargs: TemplateKwargs | None = None
        reasoning_effort: Literal["low", "medium", "high"] | None = None

    class TokenizePrompt(Tokenize):
        prompt: str

    class TokenizeChat(Tokenize):
        messages: Messages

    class DetokenizeRequest(_Closed):
        """POST /detokenize."""
        model: ModelName | None = None
        tokens: list[TokenId]

    class FunctionTool(_Closed):
        type: Literal["function"]
        name: SchemaName
        description: str | None = None
        parameters: dict[str, Any] | None = None
        strict: bool | None = None

    class NamedTool(_Closed):
        type: Literal["function"]
        name: str

    class ReasoningOptions(_Closed):
        effort: Literal["low", "medium", "high"] | None = None
        summary: Anything = Field(None, description="accepted, ignored: the reasoning is given whole")
        generate_summary: Anything = None

    class TextSchemaFormat(_Closed):
        type: Literal["json_schema"]
        name: SchemaName
        schema_: dict[str, Any] = Field(None, alias="schema")
        strict: bool | None = None
        description: str | None = None

    class TextOptions(_Closed):
        format: PlainFormat | TextSchemaFormat | None = None
        verbosity: Anything = Field(None, description="accepted, ignored")

    class ResponsesRequest(_Closed):
        """POST /v1/responses (only function tools; no stored responses)."""
        model: ModelName | None = None
        input: (Annotated[str, Field(max_length=max_text_chars)]
                | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=max_messages)]) = Field(
            description="text, or message, function_call, function_call_output and reasoning items")
        instructions: str | None = None
        reasoning: ReasoningOptions | None = None
        tools: list[FunctionTool] | None = None
        tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
        parallel_tool_calls: bool | None = None
        max_output_tokens: Annotated[int, Field(ge=1, le=context_length)] | None = None
        temperature: Annotated[float, Field(ge=0, le=100)] | None = None
        top_p: Annotated[float, Field(gt=0, le=1)] | None = None
        stream: bool | None = None
        text: TextOptions | None = None
        previous_response_id: None = Field(None, description="not supported")
        background: Literal[False] | None = None
        user: Anything = Field(None, description="accepted and ignored (as are metadata, store, service_tier)")
        metadata: Anything = None
        store: Anything = None
        service_tier: Anything = None

    return [CompletionRequest, ChatRequest, TokenizePrompt, TokenizeChat, DetokenizeRequest, ResponsesRequest]


# ---- the document -----------------------------------------------------------------------------------

def _json(name: str) -> dict:
    return {"application/json": {"schema": {"$ref": REF.format(model=name)}}}


def _error(description: str) -> dict:
    return {"description": description, "content": _json("ErrorResponse")}


ERRORS = {400: "a request that the server refuses (the error names the field)", 401: "no or a wrong API key",
          404: "an unknown model", 413: "a body larger than --max-body-bytes",
          503: "the server is busy (queue_full), its pipeline is down, it is shutting down, or the replica serving the "
               "request died (replica_unavailable: retry)"}
HEALTH_503 = "the engine cannot serve (it gave up, or it is stalled), or the server is shutting down"


def template_roles(tokenizer) -> tuple[str, ...]:
    """The roles (of CHAT_ROLES) that the model's chat template renders, each as a chat of one message."""
    roles = []
    for role in CHAT_ROLES:
        try:
            chat_prompt([{"role": role, "content": "x"}], tokenizer)
            roles.append(role)
        except RequestError:
            pass
    return tuple(roles) or CHAT_ROLES       # no template: every chat is refused, whatever its roles


def openapi_document(app, *, model_name: str, tokenizer, vocab: int, context_length: int, max_messages: int,
                     api_key: bool, version: str = "0.1.0") -> dict:
    """The document of `app` (deploy.http_app.api) for one server (api_key: whether it needs one)."""
    from fastapi.openapi.utils import get_openapi
    doc = get_openapi(title=app.title, version=version, routes=app.routes,
                      description="raymoe's OpenAI-compatible API (README, docs/chat.md)")
    requests = request_models(model_name, vocab, context_length, max_messages,
                              max_text_chars=context_length * tokenizer.max_token_bytes,
                              min_text_chars=0 if tokenizer.encode("") else 1, roles=template_roles(tokenizer))
    _, defs = models_json_schema([(m, "validation") for m in requests + RESPONSES], ref_template=REF)
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

    def response_events() -> dict:
        """text/event-stream of /v1/responses: named events (`event: <type>`), each one's data an event object."""
        payload = {"type": "string", "contentMediaType": "application/json",
                   "contentSchema": {"anyOf": [{"$ref": REF.format(model=m.__name__)} for m in RESPONSE_EVENTS]}}
        return {"text/event-stream": {"schema": {
            "type": "object", "required": ["event", "data"], "properties": {"event": {"type": "string"}, "data": payload},
            "description": "with stream: true, events `event: <type>` `data: <the event as JSON>`, from "
                           "response.created to response.completed (or response.incomplete, or error)"}}}

    operations = {
        ("/v1/models", "get"): {"ok": _json("ModelList"), "errors": (401,), "secured": True},
        ("/v1/completions", "post"): generation("CompletionRequest", "Completion", "CompletionChunk"),
        ("/v1/chat/completions", "post"): generation("ChatRequest", "ChatCompletion", "ChatCompletionChunk"),
        ("/v1/responses", "post"): {"body": _json("ResponsesRequest"), "ok": {**_json("Response"), **response_events()},
                                    "errors": (400, 401, 404, 413, 503), "secured": True},
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
                              **{str(status): _error(ERRORS[status]) for status in op["errors"]
                                 if status != 401 or api_key}}
        if op["secured"] and api_key:
            entry["security"] = [{SECURITY_SCHEME: []}]
    doc["paths"]["/health"]["get"]["responses"]["503"]["description"] = HEALTH_503
    return doc
