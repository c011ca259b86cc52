"""The HTTP API's request bodies as pydantic models, one set per served model (its name, vocabulary, context
and --max-messages). The server validates every body with them before anything else reads it
(deploy/openai_api.py, deploy/responses_api.py), and GET /openapi.json is written from them
(deploy/api_schema.py): what the document refuses, the server refuses with a 400 naming the field.

The models say what a schema can say: types, ranges, lengths, known fields. What it cannot (a prompt longer
than the context once tokenized, a chat template that does not take a role, a tool_choice naming no tool, a
grammar that does not compile) the parsers check after them. The models are strict: "5" is not 5 and true
is not 1, as in the JSON the client sent.
"""
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError
from pydantic_core import PydanticCustomError

from raymoe.deploy.api_errors import UNKNOWN, UNSUPPORTED, APIError
from raymoe.stages.text.chat import MAX_TEMPLATE_KWARGS
from raymoe.stages.text.sampling_params import (MAX_BIAS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_PENALTY,
                                                MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_STOPS, REPETITION_RANGE)
from raymoe.stages.text.tools import MAX_TOOLS

MAX_MESSAGES = 1024                 # messages (or input items) per request: --max-messages
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")     # OpenAI's (the template may take fewer)
# fields a client may send only with a value that asks for nothing: any other is refused as unsupported
UNSUPPORTED_FIELDS = frozenset(("suffix", "best_of", "functions", "function_call", "previous_response_id",
                                "background"))
# the few fields that only feed OpenAI's own bookkeeping: accepted and ignored
IGNORED_FIELDS = frozenset(("user", "metadata", "store", "service_tier"))


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")       # additionalProperties: false (unknown fields are refused)


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Request(Closed):
    model_config = ConfigDict(extra="forbid", strict=True)


class _OpenRequest(Open):
    model_config = ConfigDict(extra="allow", strict=True)


def exactly(*values):
    """A Literal of `values` that takes only values of the same JSON type (Literal[1] alone takes true)."""
    def check(value):
        if not any(type(value) is type(v) and value == v for v in values):
            raise PydanticCustomError("literal_error", "Input should be {expected}",
                                      {"expected": " or ".join(repr(v) for v in values)})
        return value
    return Annotated[Literal[values], BeforeValidator(check)]


def by_type(*models: type[BaseModel]):
    """A union of models told apart by their `type` field, so that an error is the chosen one's alone. (The
    document says oneOf, with no discriminator mapping: two values that map to one model confuse fuzzers.)"""
    names = {value: m.__name__ for m in models for value in get_args(m.model_fields["type"].annotation)}

    def kind(value):
        tag = value.get("type") if isinstance(value, dict) else None
        return names.get(tag, models[0].__name__) if isinstance(tag, str) else models[0].__name__
    return Annotated[Union[tuple(Annotated[m, Tag(m.__name__)] for m in models)], Discriminator(kind)]


def in_vocabulary(vocab: int):
    """A check that names the vocabulary when a token id is outside it."""
    def check(value):
        if type(value) is int and not 0 <= value < vocab:
            raise PydanticCustomError("token_id", "token id {id} is outside the vocabulary (0..{last})",
                                      {"id": value, "last": vocab - 1})
        return value
    return check


def request_models(model_name: str | tuple[str, ...], vocab: int, context_length: int, max_messages: int, *,
                   max_text_chars: int, min_text_chars: int = 0) -> dict[str, type[BaseModel]]:
    """The request bodies' models, by name, for a server of `model_name` (or several: the document of a
    server of several models, with the largest vocabulary and context) and
    --max-messages; prompt text of fewer than min_text_chars characters has no tokens, text longer than
    max_text_chars cannot fit the context whatever its tokens."""
    TokenId = Annotated[int, Field(ge=0, le=vocab - 1), BeforeValidator(in_vocabulary(vocab))]
    names = (model_name,) if isinstance(model_name, str) else model_name
    ModelName = Literal[(*names, "")]            # "": the (first) served model too
    TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=context_length - 1)]
    StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
    Anything = Any
    SchemaName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    Effort = Literal["low", "medium", "high"]
    # the values of the unsupported fields that ask for nothing
    NoSuffix, OneBest, NoFunctionCall, NotInBackground = exactly(""), exactly(1), exactly("none"), exactly(False)

    class TextPart(_OpenRequest):
        type: Literal["text"]
        text: str

    class Message(_OpenRequest):
        """A chat message; other fields (name, tool_call_id, ...) go to the chat template as they are."""
        role: Literal[CHAT_ROLES] = Field(description="OpenAI's (a chat template may refuse some)")
        content: str | list[TextPart] | None = None
        reasoning_content: str | None = Field(None, description="reasoning of an earlier assistant turn "
                                                                "(also as `thinking` or `reasoning`)")
        thinking: str | None = None
        reasoning: str | None = None

    TemplateKwargs = Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS,
                                                     description="variables of the chat template (identifiers)")]
    Messages = Annotated[list[Message], Field(min_length=1, max_length=max_messages)]

    class StreamOptions(_Request):
        include_usage: bool | None = None

    class Sampling(_Request):
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

    PromptText = Annotated[str, Field(min_length=min_text_chars, max_length=max_text_chars)]

    class CompletionRequest(Sampling):
        """POST /v1/completions."""
        prompt: (PromptText | TokenIds | Annotated[list[PromptText], Field(min_length=1, max_length=1)]
                 | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]) = Field(
            description="text, or token ids (or a list of one of either)")
        echo: bool | None = None
        logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
        suffix: NoSuffix | None = Field(None, description="not supported")
        best_of: OneBest | None = None

    class PlainFormat(_Request):
        type: Literal["text", "json_object"]

    class JsonSchema(_Request):
        name: SchemaName
        schema_: dict[str, Any] = Field(None, alias="schema", description="a JSON schema (llguidance compiles it)")
        strict: bool | None = None
        description: str | None = None

    class SchemaFormat(_Request):
        type: Literal["json_schema"]
        json_schema: JsonSchema

    ResponseFormat = by_type(PlainFormat, SchemaFormat)

    class FunctionDefinition(_OpenRequest):
        name: SchemaName
        description: str | None = None
        parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
        strict: bool | None = None

    class ChatTool(_OpenRequest):
        type: Literal["function"] = "function"
        function: FunctionDefinition

    ChatTools = Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)]

    class FunctionName(_OpenRequest):
        name: SchemaName

    class ToolChoiceFunction(_OpenRequest):
        type: Literal["function"]
        function: FunctionName

    class ChatRequest(Sampling):
        """POST /v1/chat/completions."""
        messages: Messages
        max_completion_tokens: Annotated[int, Field(ge=1, le=context_length)] | None = None
        logprobs: bool | None = None
        top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(None, description="with logprobs")
        tools: ChatTools | None = Field(None, description="function tools, distinct names (docs/chat.md)")
        functions: Annotated[list, Field(max_length=0)] | None = Field(None, description="not supported: tools")
        tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = Field(
            None, description="a named function must be one of tools; required needs tools")
        function_call: NoFunctionCall | None = None
        parallel_tool_calls: bool | None = None
        response_format: ResponseFormat | None = Field(None, description="structured outputs (docs/chat.md)")
        chat_template_kwargs: TemplateKwargs | None = None
        reasoning_effort: Effort | None = None
        thinking_token_budget: Annotated[int, Field(ge=-1, le=context_length)] | None = Field(
            None, description="the most tokens of reasoning; the engine then ends it (-1: none; default: the "
                              "server's --reasoning-budget)")

    class Tokenize(_Request):
        model: ModelName | None = None
        add_generation_prompt: bool | None = None
        add_special_tokens: bool | None = None
        return_token_strs: bool | None = None
        chat_template_kwargs: TemplateKwargs | None = None
        reasoning_effort: Effort | None = None

    class TokenizePrompt(Tokenize):
        prompt: str

    class TokenizeChat(Tokenize):
        messages: Messages
        tools: ChatTools | None = None

    class DetokenizeRequest(_Request):
        """POST /detokenize."""
        model: ModelName | None = None
        tokens: list[TokenId]

    class FunctionTool(_Request):
        type: Literal["function"]
        name: SchemaName
        description: str | None = None
        parameters: dict[str, Any] | None = None
        strict: bool | None = None

    class NamedTool(_Request):
        type: Literal["function"]
        name: str

    class ReasoningOptions(_Request):
        effort: Effort | None = None
        summary: Anything = Field(None, description="accepted, ignored: the reasoning is given whole")
        generate_summary: Anything = None

    class TextSchemaFormat(_Request):
        type: Literal["json_schema"]
        name: SchemaName
        schema_: dict[str, Any] = Field(None, alias="schema")
        strict: bool | None = None
        description: str | None = None

    class TextOptions(_Request):
        format: by_type(PlainFormat, TextSchemaFormat) | None = None
        verbosity: Anything = Field(None, description="accepted, ignored")

    class ResponsesRequest(_Request):
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
        background: NotInBackground | None = None
        user: Anything = Field(None, description="accepted and ignored (as are metadata, store, service_tier)")
        metadata: Anything = None
        store: Anything = None
        service_tier: Anything = None

    class InputText(_OpenRequest):
        """A text block (other fields, such as cache_control, are accepted and ignored)."""
        type: Literal["text"]
        text: str

    class InputToolUse(_OpenRequest):
        type: Literal["tool_use"]
        id: str
        name: str
        input: dict[str, Any]

    class InputToolResult(_OpenRequest):
        type: Literal["tool_result"]
        tool_use_id: str
        content: str | list[InputText] | None = None
        is_error: bool | None = None

    class InputThinking(_OpenRequest):
        type: Literal["thinking"]
        thinking: str
        signature: str | None = None

    class InputMessage(_Request):
        role: Literal["user", "assistant"]
        content: str | Annotated[list[by_type(InputText, InputToolUse, InputToolResult, InputThinking)],
                                 Field(min_length=1)]

    class AnthropicTool(_OpenRequest):
        name: SchemaName
        description: str | None = None
        input_schema: dict[str, Any] = Field(description="a JSON schema of the input")

    class AnthropicToolChoice(_Request):
        type: Literal["auto", "any", "tool", "none"]
        name: SchemaName | None = Field(None, description="with type tool")
        disable_parallel_tool_use: bool | None = None

    class ThinkingConfig(_Request):
        type: Literal["enabled", "disabled", "adaptive", "between_tools"] = Field(
            description="enabled: at most budget_tokens; disabled: none; the others: the model's own")
        budget_tokens: Annotated[int, Field(ge=0, le=context_length)] | None = Field(
            None, description="the most tokens of thinking (the engine then ends it)")
        display: Anything = Field(None, description="accepted, ignored: the thinking is given whole")

    class OutputFormat(_Request):
        type: Literal["json_schema"]
        schema_: dict[str, Any] = Field(alias="schema", description="a JSON schema of the answer")

    class OutputConfig(_Request):
        effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
            None, description="the template's reasoning_effort (xhigh and max: high)")
        format: OutputFormat | None = None

    class MessagesRequest(_Request):
        """POST /v1/messages (Anthropic's Messages API)."""
        model: ModelName | None = None
        max_tokens: Annotated[int, Field(ge=1, le=context_length)]
        messages: Annotated[list[InputMessage], Field(min_length=1, max_length=max_messages)]
        system: str | list[InputText] | None = None
        stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
        stream: bool | None = None
        temperature: Annotated[float, Field(ge=0, le=100)] | None = None
        top_p: Annotated[float, Field(gt=0, le=1)] | None = None
        top_k: Annotated[int, Field(ge=-1)] | None = None
        tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
        tool_choice: AnthropicToolChoice | None = None
        thinking: ThinkingConfig | None = None
        output_config: OutputConfig | None = None
        metadata: Anything = Field(None, description="accepted and ignored (as is service_tier)")
        service_tier: Anything = None

    models = [CompletionRequest, ChatRequest, TokenizePrompt, TokenizeChat, DetokenizeRequest, ResponsesRequest,
              MessagesRequest]
    return {m.__name__: m for m in models}


@dataclass(eq=False)
class ServedModel:
    """A model as the API serves it: the name clients send, its tokenizer, context and vocabulary, and the
    request models built for them."""
    name: str
    tokenizer: Any
    context_length: int
    vocab: int
    max_messages: int = MAX_MESSAGES
    reasoning_budget: int | None = None         # a chat's, unless it sets thinking_token_budget (--reasoning-budget)

    @cached_property
    def requests(self) -> dict[str, type[BaseModel]]:
        return request_models(self.name, self.vocab, self.context_length, self.max_messages,
                              max_text_chars=self.context_length * self.tokenizer.max_token_bytes,
                              min_text_chars=0 if self.tokenizer.encode("") else 1)

    def validate(self, request: str, body) -> None:
        """APIError (400, or 404 for another model's name) unless `body` is a valid `request` (a model's name
        in `requests`)."""
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_body")
        try:
            self.requests[request].model_validate(body)
        except ValidationError as e:
            raise self._error(e.errors(include_url=False), body) from None

    def _error(self, errors: list[dict], body: dict) -> APIError:
        """The APIError of pydantic's errors: the first field's, from the branch of a union that came nearest."""
        unknown = [e for e in errors if e["type"] == "extra_forbidden"]
        if unknown:
            return _unknown_fields(unknown, body)
        field = errors[0]["loc"][0]
        errors = [e for e in errors if e["loc"][:1] == (field,)]
        value = errors[0]["input"] if len(errors[0]["loc"]) == 1 else None
        if field == "model" and isinstance(value, str):
            return APIError(404, f"The model `{value}` does not exist; this server serves `{self.name}` "
                                 f"(see GET /v1/models)", param="model", code="model_not_found")
        if field in UNSUPPORTED_FIELDS:
            return APIError(400, f"{field} is not supported by this server (got {repr(value)[:100]})", param=field,
                            code=UNSUPPORTED)
        near = [e for e in errors if not e["type"].endswith("_type")] or errors    # the branch of the right type
        paths = [_path(e["loc"], body) for e in near]
        deepest = max(paths, key=len)
        near = [e for e, path in zip(near, paths) if path == deepest]
        if near[0]["type"] in ("too_long", "string_too_long") and len(deepest) == 1:
            too_long = self._too_long(field, near[0]["input"])
            if too_long is not None:
                return too_long
        where = _where(deepest)
        if near[0]["type"] == "string_unicode":        # JSON's \ud800 escapes give such text
            text = near[0]["input"]
            at = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
            return APIError(400, f"{where}: the text is not valid Unicode: a lone surrogate U+{ord(text[at]):04X} "
                                 f"at character {at}", param=field)
        said = " or ".join(dict.fromkeys(e["msg"][0].lower() + e["msg"][1:] for e in near))
        got = "" if near[0]["type"] in ("missing", "token_id") else f", got {repr(near[0]['input'])[:60]}"
        return APIError(400, f"{where}: {said}{got}", param=field)

    def _too_long(self, field: str, value) -> APIError | None:
        """The errors of OpenAI's (and --max-messages') for a prompt or a chat too long, else None."""
        if isinstance(value, list) and field in ("messages", "input"):
            return APIError(400, f"{field} has {len(value)} entries, more than --max-messages ({self.max_messages})",
                            param=field, code="too_many_messages")
        tokens = field == "prompt" and isinstance(value, list) and type(value[0]) is int
        if not (tokens or field in ("prompt", "input") and isinstance(value, str)):
            return None
        what = "characters of text" if isinstance(value, str) else "tokens"
        return APIError(400, f"This model's maximum context length is {self.context_length} tokens. However, your "
                             f"prompt has {len(value)} {what}, more than {self.context_length - 1} fit (leaving room "
                             f"for one generated token).", param=field, code="context_length_exceeded")


def _path(loc: tuple, body) -> list:
    """A pydantic error location as a path into the body: without the union branches' tags ('list[int]',
    'TextPart', a discriminator's value), which name no key or index of the value there. The last part stays
    when it names a field (a missing one is in no value)."""
    path, value = [], body
    for i, part in enumerate(loc):
        if isinstance(value, dict) and part in value or isinstance(value, list) and isinstance(part, int) \
                and 0 <= part < len(value):
            path.append(part)
            value = value[part]
        elif i == len(loc) - 1 and isinstance(part, str) and part.isidentifier() and part[0].islower():
            path.append(part)
    return path


def _where(path: list) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _unknown_fields(errors: list[dict], body: dict) -> APIError:
    """400 naming the unknown fields of the first object that has some (code unknown_parameter, the first one
    as its param)."""
    parent = errors[0]["loc"][:-1]
    names = [e["loc"][-1] for e in errors if e["loc"][:-1] == parent]
    where = _where(_path(errors[0]["loc"], body)[:-1]) + "." if parent else ""
    shown = ", ".join(repr(k if len(k) <= 64 else k[:64] + "...") for k in names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return APIError(400, f"Unrecognized request argument{'s' * (len(names) > 1)} supplied: {where}{shown}{more} "
                         f"(docs/chat.md lists the fields this server takes)", param=names[0], code=UNKNOWN)
