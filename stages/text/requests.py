"""Turn one request (a JSONL line or an API body) into prompt token ids and sampling parameters."""
from __future__ import annotations

from raymoe.stages.text.chat import ChatPrompt, check_template_kwargs, render_chat
from raymoe.stages.errors import RequestError
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.stages.text.structured import output_grammar, response_schema
from raymoe.stages.text.tools import tool_request

PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")


def prompt_ids(request: dict, tokenizer) -> list[int]:
    """Exactly one of `prompt` (text), `prompt_token_ids` or `messages` (chat template applied)."""
    given = [k for k in PROMPT_KEYS if k in request]
    if len(given) != 1:
        raise RequestError(f"a request needs exactly one of {', '.join(PROMPT_KEYS)} (got {given or 'none'})")
    key = given[0]
    value = request[key]
    if key == "prompt":
        if not isinstance(value, str):
            raise RequestError("prompt must be a string")
        return tokenizer.encode(value)
    if key == "prompt_token_ids":
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise RequestError("prompt_token_ids must be a list of integers")
        return list(value)
    tools = tool_request(request)       # a line's tools, tool_choice and parallel_tool_calls (stages/text/tools.py)
    return tokenizer.encode(chat_prompt(value, tokenizer, request.get("chat_template_kwargs"),
                                        tools=tools.template_tools() if tools else None))


def chat_prompt(messages, tokenizer, template_kwargs=None, add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> ChatPrompt:
    """`messages` through the chat template, with the variables transformers gives a template (the
    special tokens: bos_token, eos_token, pad_token; add_generation_prompt; `tools`, None when none are
    offered; documents None), then the server's default chat_template_kwargs (tokenizer.chat_template_kwargs),
    then the request's."""
    if tokenizer.chat_template is None:
        raise RequestError("this model has no chat template; send prompt or prompt_token_ids instead of messages")
    variables = {**tokenizer.special_tokens_map, **getattr(tokenizer, "chat_template_kwargs", {})}
    if template_kwargs is not None:
        variables.update(check_template_kwargs(template_kwargs))
    return render_chat(tokenizer.chat_template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                       **variables)


def check_prompt(ids: list[int], vocab_size: int, context_length: int):
    if not ids:
        raise RequestError("the prompt is empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    if len(ids) >= context_length:
        raise RequestError(f"prompt has {len(ids)} tokens; the model's context is {context_length} "
                           f"(at most {context_length - 1} prompt tokens)")


def sampling_params(request: dict, defaults: SamplingParams, context_length: int | None = None,
                    vocab: int | None = None) -> SamplingParams:
    """The one validation of sampling values that JSONL lines, HTTP bodies and gRPC requests all go
    through (in the coordinator): RequestError with a one-line message, or the parameters. One request is
    one sequence: `n` (choices) is the HTTP API's, which submits one request per choice."""
    n = request.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise RequestError(f"n must be 1 in an engine request (one result per request: send one line per "
                           f"sample, with different seeds), got {repr(n)[:40]}")
    return SamplingParams.from_dict(request, defaults, context_length, vocab)


def reasoning_budget(value, name: str = "thinking_token_budget") -> int | None:
    """The most tokens of reasoning a request allows (None or -1: no bound), or RequestError naming `name`."""
    if value is None or value == -1 and type(value) is int:
        return None
    if type(value) is not int or value < 0:
        raise RequestError(f"{name} must be an integer >= 0 (or -1: no budget), got {repr(value)[:40]}")
    return value


def line_grammar(request: dict, tokenizer, ids: list[int]) -> str | None:
    """The grammar of a request's structured output (stages/text/structured.py): from its `response_format` and a
    `tool_choice` that forces a call (a batch line's keys; a `messages` line's output in the model's chat
    format, its reasoning within `thinking_token_budget`), or its own `grammar` (what the server sends, having built it the same way); None for neither."""
    schema = response_schema(request.get("response_format"))
    tools = tool_request(request) if "messages" in request else None
    budget = reasoning_budget(request.get("thinking_token_budget"))
    grammar = output_grammar(tokenizer, ids, schema, tools, chat="messages" in request, reasoning_budget=budget)
    if grammar is not None and request.get("grammar") is not None:
        raise RequestError("a request takes grammar or response_format (and tool_choice), not both")
    return grammar if grammar is not None else request.get("grammar")
