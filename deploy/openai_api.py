"""The OpenAI-compatible protocol: request bodies in, engine requests out; engine results in,
response bodies and server-sent-event chunks out. No Ray and no web framework here.

An engine request is a deploy.generate JSONL line with the prompt already tokenized
(`prompt_token_ids`), so the server's tokens equal the batch job's for the same seed.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from raymoe.deploy.api_errors import UNSUPPORTED, APIError
from raymoe.deploy.protocol import ServedModel
from raymoe.stages.text.chat import check_template_kwargs
from raymoe.stages.errors import RequestError
from raymoe.stages.text.reasoning import CONTENT, REASONING, OutputParser, SplitText
from raymoe.stages.text.requests import chat_prompt, check_prompt, reasoning_budget
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.stages.runtime.sampler import choice_seed
from raymoe.stages.runtime.speculation import speculation_load
from raymoe.stages.text.structured import output_grammar, response_schema
from raymoe.stages.text.answers import chat_parsers, split_message, tool_calls_reader
from raymoe.stages.text.tool_calls import TOOL_CALLS
from raymoe.stages.text.tools import TOOL_FIELDS, ToolRequest, tool_request


# ---- requests -------------------------------------------------------------------------------------
# Every body is first validated by its model (deploy/protocol.py: one policy for every endpoint, docs/chat.md
# "Request fields": an unknown field is refused naming it, an unsupported value is refused, a few bookkeeping
# fields are ignored). What follows checks what a schema cannot say, and builds the engine request.

def request_error(e: RequestError, default_param: str | None = None) -> APIError:
    """A RequestError from the engine as a 400, naming the parameter when the message does."""
    message = str(e)
    first = message.split(" ", 1)[0]
    param = first if first in SAMPLING_PARAMS or first in ("prompt", "prompt_token_ids", "messages") else default_param
    return APIError(400, message, param=param)


# the body's sampling fields that go to the engine as they are (stages/text/sampling_params.py validates them)
ENGINE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
SAMPLING_PARAMS = ("max_tokens", "logprobs", "prompt_logprobs", *ENGINE_FIELDS)


@dataclass
class Prepared:
    """One validated API request."""
    kind: str                          # "completion" or "chat"
    id: str
    model: str
    prompt_ids: list[int]
    engine_request: dict               # prompt_token_ids + sampling values, for ClusterEngine.submit
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None        # completions: top-K; chat: top_logprobs when logprobs is on
    return_token_ids: bool = False     # extension (as vLLM's): token ids in choices and chunks
    n: int = 1                         # choices: one engine request each (choice_requests)
    parser: OutputParser | None = None  # chat: splits reasoning from the answer (stages/text/reasoning.py); each
                                        # choice's answer goes through a fresh() one
    tools: ToolRequest | None = None    # chat with tools (stages/text/tools.py): calls are read from the answers
    response_fields: dict = field(default_factory=dict)   # /v1/responses: what its body echoes of the request
    created: int = field(default_factory=lambda: int(time.time()))

    def choice_requests(self) -> list[dict]:
        """The engine request of every choice: with a seed, choice i samples with choice_seed(seed, i), so
        each choice is reproducible and choice 0 is what n=1 gives; without one, each draws its own seed."""
        seed = self.engine_request.get("seed")
        if self.n == 1 or seed is None:
            return [self.engine_request] * self.n
        return [{**self.engine_request, "seed": choice_seed(seed, i)} for i in range(self.n)]


def _stream(body: dict) -> tuple[bool, bool]:
    """stream, and stream_options.include_usage (only with stream)."""
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None and not stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    return stream, bool((options or {}).get("include_usage"))


def _sampling(body: dict, max_tokens) -> dict:
    out = {"max_tokens": max_tokens}
    for name in ENGINE_FIELDS:
        if body.get(name) is not None:
            out[name] = body[name]
    return out


def check_text_size(n_chars: int, tokenizer, context_length: int, param: str):
    """Refuse text that cannot fit the context whatever its tokens, before tokenizing it: this
    bounds the tokenizer's work per request."""
    if n_chars > context_length * tokenizer.max_token_bytes:
        raise APIError(400, f"This model's maximum context length is {context_length} tokens. However, your "
                            f"prompt has {n_chars} characters of text, more than {context_length} tokens can hold.",
                       param=param, code="context_length_exceeded")


def _check_length(ids: list[int], served: ServedModel, param: str):
    context_length = served.context_length
    if len(ids) >= context_length:
        raise APIError(400, f"This model's maximum context length is {context_length} tokens. However, your "
                            f"prompt has {len(ids)} tokens (at most {context_length - 1} fit, leaving room for "
                            f"one generated token).", param=param, code="context_length_exceeded")
    try:
        check_prompt(ids, served.vocab, context_length)
    except RequestError as e:
        raise APIError(400, str(e), param=param) from None


def _validate_sampling(request: dict, vocab: int):
    try:
        SamplingParams.from_dict(request, vocab=vocab)
    except RequestError as e:
        raise request_error(e) from None


def _encode(text: str, tokenizer, param: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except RequestError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None


def parse_completion(body: dict, served: ServedModel) -> Prepared:
    """POST /v1/completions: `prompt` as text or token ids (or a one-element list of either)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and len(prompt) > 1 and set(map(type, prompt)) <= {str, list}:
        raise APIError(400, "batched prompts are not supported: send one request per prompt", param="prompt",
                       code=UNSUPPORTED)
    served.validate("CompletionRequest", body)
    stream, include_usage = _stream(body)
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]            # a batch of one
    ids = _encode(prompt, served.tokenizer, "prompt") if isinstance(prompt, str) else list(prompt)
    _check_length(ids, served, "prompt")
    echo = bool(body.get("echo"))
    logprobs = body.get("logprobs")
    max_tokens = body.get("max_tokens")
    request = {"prompt_token_ids": ids, **_sampling(body, 16 if max_tokens is None else max_tokens)}
    if logprobs is not None:
        request["logprobs"] = logprobs
        if echo:
            request["prompt_logprobs"] = logprobs
    _validate_sampling(request, served.vocab)
    return Prepared("completion", f"cmpl-{uuid.uuid4().hex}", served.name, ids, request, stream=stream,
                    include_usage=include_usage, echo=echo, logprobs=logprobs,
                    return_token_ids=bool(body.get("return_token_ids")), n=body.get("n") or 1)


def _message_content(message: dict) -> dict:
    """OpenAI content: a string, or a list of text parts (joined)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part["text"] for part in content)
    return {**message, "content": content or ""}


def parse_chat(body: dict, served: ServedModel) -> Prepared:
    """POST /v1/chat/completions: `messages` through the model's chat template (with the generation prompt)."""
    served.validate("ChatRequest", body)
    stream, include_usage = _stream(body)
    tokenizer, context_length = served.tokenizer, served.context_length
    tools = _tools(body)
    schema = _structured(response_schema, body.get("response_format"))
    messages = [_message_content(m) for m in body["messages"]]
    check_text_size(sum(len(m["content"]) for m in messages if isinstance(m["content"], str)), tokenizer,
                    context_length, "messages")
    ids = _render_chat(body, messages, tokenizer, add_generation_prompt=True,
                       tools=tools.template_tools() if tools else None)
    _check_length(ids, served, "messages")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    # no limit given: generate until the model stops or the context is full (as OpenAI does)
    request = {"prompt_token_ids": ids, **_sampling(body, max_tokens or context_length)}
    logprobs = None
    if body.get("logprobs"):
        logprobs = body.get("top_logprobs") or 0
        request["logprobs"] = logprobs
    elif body.get("top_logprobs") is not None:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    given = body.get("thinking_token_budget")
    budget = served.reasoning_budget if given is None else reasoning_budget(given)
    grammar = _structured(output_grammar, tokenizer, ids, schema, tools, True, "response_format", budget)
    if grammar is not None:
        request["grammar"] = grammar
    _validate_sampling(request, served.vocab)
    parser, calls = chat_parsers(tokenizer, ids, tools)
    return Prepared("chat", f"chatcmpl-{uuid.uuid4().hex}", served.name, ids, request, stream=stream,
                    include_usage=include_usage, logprobs=logprobs,
                    return_token_ids=bool(body.get("return_token_ids")), n=body.get("n") or 1, parser=parser,
                    tools=tools if calls is not None else None)


def _tools(body: dict) -> ToolRequest | None:
    """The request's tools, tool_choice and parallel_tool_calls (stages/text/tools.py); None without tools."""
    try:
        return tool_request(body)
    except RequestError as e:
        message = str(e)
        param = next((name for name in TOOL_FIELDS if message.startswith(name)), "tools")
        raise APIError(400, message, param=param) from None


def _structured(build, *args):
    """build(*args) (stages/text/structured.py), its RequestError a 400 naming the field it is about."""
    try:
        return build(*args)
    except RequestError as e:
        message = str(e)
        raise APIError(400, message, param="tools" if message.startswith("tools") else "response_format") from None


def _template_kwargs(body: dict) -> dict | None:
    """The request's chat_template_kwargs, with OpenAI's `reasoning_effort` as the template variable of that
    name (gpt-oss's template reads it) unless chat_template_kwargs sets it too."""
    kwargs = body.get("chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        kwargs = {"reasoning_effort": effort, **(kwargs or {})}
    return kwargs


def _render_chat(body: dict, messages: list, tokenizer, add_generation_prompt: bool,
                 tools: list[dict] | None = None) -> list[int]:
    """Token ids of messages through the chat template (with the request's template variables and tools)."""
    kwargs = _template_kwargs(body)
    try:
        prompt = chat_prompt(messages, tokenizer, kwargs, add_generation_prompt=add_generation_prompt, tools=tools)
    except RequestError as e:
        param = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
        raise APIError(400, str(e), param=param) from None
    return _encode(prompt, tokenizer, "messages")


def parse_tokenize(body: dict, served: ServedModel) -> dict:
    """POST /tokenize (vLLM's): {model, prompt, add_special_tokens} or {model, messages, add_generation_prompt,
    chat_template_kwargs} -> {count, max_model_len, tokens} (and token_strs with return_token_strs). A
    prompt longer than the context is counted, not refused: knowing that is what the endpoint is for."""
    has_prompt, has_messages = (isinstance(body, dict) and name in body for name in ("prompt", "messages"))
    if isinstance(body, dict) and has_prompt == has_messages:
        raise APIError(400, "send exactly one of prompt (text) and messages (a chat)",
                       param="messages" if has_messages else "prompt")
    # every field is checked, whether or not it applies (the chat's with a prompt, add_special_tokens with a chat)
    served.validate("TokenizePrompt" if has_prompt else "TokenizeChat", body)
    tokenizer = served.tokenizer
    if has_prompt:
        try:        # checked, though a prompt does not use them (the chat template checks a chat's)
            check_template_kwargs(_template_kwargs(body) or {})
        except RequestError as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from None
        ids = _encode(body["prompt"], tokenizer, "prompt")
        if body.get("add_special_tokens") is False and tokenizer.add_bos and ids[:1] == [tokenizer.bos_token_id]:
            ids = ids[1:]
    else:
        messages = [_message_content(m) for m in body["messages"]]
        tools = _tools({"tools": body.get("tools")})
        ids = _render_chat(body, messages, tokenizer,
                           add_generation_prompt=body.get("add_generation_prompt") is not False,
                           tools=tools.template_tools() if tools else None)
    out = {"count": len(ids), "max_model_len": served.context_length, "tokens": ids}
    if body.get("return_token_strs"):
        out["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
    return out


def parse_detokenize(body: dict, served: ServedModel) -> dict:
    """POST /detokenize (vLLM's): {model, tokens} -> {prompt}, special tokens written out (so that
    /tokenize of the text gives the tokens back)."""
    served.validate("DetokenizeRequest", body)
    return {"prompt": served.tokenizer.decode(body["tokens"])}


# ---- responses ------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, speculation: dict | None = None) -> dict:
    """OpenAI's usage; cached_tokens: the prompt's tokens that the prefix cache gave (as OpenAI and vLLM say);
    speculation: the drafts' counts (speculative decoding), where any were sent."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if speculation:
        out["speculation"] = speculation
    return out


class TokenText:
    """Token ids as the strings OpenAI's logprobs show (each token decoded alone)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def _top_dict(top: list, token_text: TokenText) -> dict:
    """{token text: logprob}; tokens that decode alike (e.g. partial UTF-8) keep the best logprob."""
    out = {}
    for token_id, logprob in top:
        out.setdefault(token_text(token_id), logprob)
    return out


def completion_logprobs(entries: list, token_text: TokenText, offset: int) -> dict:
    """The legacy completions shape; entries are the engine's {"token_id", "logprob", "top"} (or None for
    the first prompt token). `offset` is where the first token's text starts in the choice's text."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        if entry is None:
            continue
        text = token_text(entry["token_id"])
        out["tokens"].append(text)
        out["token_logprobs"].append(entry["logprob"])
        out["top_logprobs"].append(_top_dict(entry["top"], token_text))
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _prompt_logprobs(entries: list, prompt_ids: list[int], token_text: TokenText) -> dict:
    """echo with logprobs: the prompt's tokens first, the first one without a logprob."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token_id, entry in zip(prompt_ids, entries):
        text = token_text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else entry["logprob"])
        out["top_logprobs"].append(None if entry is None else _top_dict(entry["top"], token_text))
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _merge_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(entries: list, token_text: TokenText) -> dict:
    def item(token_id, logprob):
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e["token_id"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                        for e in entries], "refusal": None}


def check_result(result: dict):
    if "error" in result:
        raise APIError(500, f"generation failed: {result['error']}")


def total_usage(results: list[dict]) -> dict:
    """The usage of a request's choices: its prompt once (as OpenAI and vLLM count it), every choice's tokens."""
    first = results[0]["usage"]
    drafts = [r["usage"]["speculation"] for r in results if "speculation" in r["usage"]]
    speculation = speculation_load(*(sum(d[k] for d in drafts) for k in ("draft_tokens", "accepted_tokens",
                                                                         "verify_steps"))) if drafts else None
    return usage(first["prompt_tokens"], sum(r["usage"]["completion_tokens"] for r in results),
                 first.get("cached_tokens", 0), speculation)


def completion_response(p: Prepared, results: list[dict], token_text: TokenText, prompt_text: str | None) -> dict:
    """The non-streamed body of the choices' results. prompt_text: the decoded prompt (for echo)."""
    for r in results:
        check_result(r)
    return {"id": p.id, "object": "text_completion", "created": p.created, "model": p.model,
            "choices": [_completion_choice(p, i, r, token_text, prompt_text) for i, r in enumerate(results)],
            "usage": total_usage(results)}


def _completion_choice(p: Prepared, index: int, result: dict, token_text: TokenText, prompt_text: str | None) -> dict:
    text = result["text"]
    logprobs = None
    if p.logprobs is not None:
        start = len(prompt_text) if p.echo else 0
        logprobs = completion_logprobs(result["logprobs"], token_text, start)
        if p.echo:
            logprobs = _merge_logprobs(_prompt_logprobs(result["prompt_logprobs"], p.prompt_ids, token_text), logprobs)
    if p.echo:
        text = prompt_text + text
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": result["finish_reason"]}
    if p.return_token_ids:
        choice.update(prompt_token_ids=result["prompt_token_ids"], token_ids=result["token_ids"])
    return choice


def chat_message(p: Prepared, result: dict) -> dict:
    """The assistant's message: with a reasoning format, the answer as content and the reasoning as
    reasoning_content (None when there is none); otherwise the whole text as content. With tools, the
    calls read from the answer as tool_calls (when there are some: content is then None if empty)."""
    if p.parser is None:
        return {"role": "assistant", "content": result["text"], REASONING: None}
    parser = p.parser.fresh()
    calls = tool_calls_reader(parser, p.tools) if p.tools is not None else None
    fields = split_message(parser, calls, result["token_ids"], result["text"])
    message = {"role": "assistant", "content": fields[CONTENT], REASONING: fields[REASONING]}
    if fields[TOOL_CALLS]:
        message[TOOL_CALLS] = fields[TOOL_CALLS]
    return message


def chat_response(p: Prepared, results: list[dict], token_text: TokenText) -> dict:
    for r in results:
        check_result(r)
    return {"id": p.id, "object": "chat.completion", "created": p.created, "model": p.model,
            "choices": [_chat_choice(p, i, r, token_text) for i, r in enumerate(results)],
            "usage": total_usage(results)}


def _chat_choice(p: Prepared, index: int, result: dict, token_text: TokenText) -> dict:
    message = chat_message(p, result)
    choice = {"index": index, "message": message,
              "logprobs": chat_logprobs(result["logprobs"], token_text) if p.logprobs is not None else None,
              "finish_reason": TOOL_CALLS if TOOL_CALLS in message else result["finish_reason"]}
    if p.return_token_ids:
        choice.update(prompt_token_ids=result["prompt_token_ids"], token_ids=result["token_ids"])
    return choice


# ---- streaming ----------------------------------------------------------------------------------

class TextDeltas:
    """The engine reports the text each update adds, and at the end the final text, which a stop string
    may have cut; a client wants pieces whose concatenation is the final text. So a tail that could be
    the start of a stop string is held back. (The engine holds back incomplete UTF-8 characters.)"""

    def __init__(self, stops: list[str] | None = None):
        self.stops = [s for s in (stops or []) if s]
        self.sent = self.text = ""

    def _stable_length(self, text: str) -> int:
        n = len(text)
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, n), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return n - hold

    def update(self, text_delta: str) -> str:
        """The stable new text after one update's text_delta."""
        self.text += text_delta
        text = self.text
        if not text.startswith(self.sent):
            return ""                   # not stable yet after all: wait for more (or the final text)
        n = self._stable_length(text)
        if n <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):n], text[:n]
        return delta

    def final(self, text: str) -> str:
        """The rest of the final text. (Were the text sent so far not its prefix, the concatenation
        could not be right; the held-back tail above exists so that this never happens.)"""
        delta, self.sent = text[len(self.sent):], text
        return delta


def sse(data) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = sse("[DONE]")


class StreamFormatter:
    """Chunks of one choice (`index`) of a streamed completion or chat completion, in OpenAI's shapes. With
    several choices (n > 1) the caller sends the usage chunk once all have finished (usage_chunk)."""

    def __init__(self, p: Prepared, token_text: TokenText, prompt_text: str = "", index: int = 0):
        self.p, self.token_text, self.prompt_text, self.index = p, token_text, prompt_text, index
        self.result: dict | None = None
        stop = p.engine_request.get("stop") or []
        stops = [stop] if isinstance(stop, str) else stop
        self.deltas = TextDeltas(stops)
        # chat with a reasoning format: deltas of reasoning_content or content (stages/text/reasoning.py), and
        # with tools, of tool_calls (stages/text/tool_calls.py)
        self.split = self.calls = None
        if p.kind == "chat" and p.parser is not None:
            parser = p.parser.fresh()
            self.split = SplitText(parser, stops)
            self.calls = tool_calls_reader(parser, p.tools) if p.tools is not None else None
        self.offset = len(prompt_text) if p.echo else 0     # text_offset of the next completion token
        self.started = False

    def _chunk(self, choice: dict) -> dict:
        obj = "chat.completion.chunk" if self.p.kind == "chat" else "text_completion"
        chunk = {"id": self.p.id, "object": obj, "created": self.p.created, "model": self.p.model,
                 "choices": [{"index": self.index, **choice}]}
        if self.p.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self) -> list[dict]:
        """Chunks to send before any token: the assistant role (chat) or the echoed prompt."""
        self.started = True
        if self.p.kind == "chat":
            return [self._chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})]
        if self.p.echo:
            choice = {"text": self.prompt_text, "logprobs": None, "finish_reason": None}
            if self.p.return_token_ids:
                choice["prompt_token_ids"] = self.p.prompt_ids
            return [self._chunk(choice)]
        return []

    def _logprobs(self, entries):
        if self.p.logprobs is None or not entries:
            return None
        if self.p.kind == "chat":
            return chat_logprobs(entries, self.token_text)
        out = completion_logprobs(entries, self.token_text, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out

    def _content(self, delta_text: str, token_ids: list[int], logprobs_entries) -> dict | None:
        lp = self._logprobs(logprobs_entries)
        if not delta_text and not lp and not (self.p.return_token_ids and token_ids):
            return None
        if self.p.kind == "chat":
            choice = {"delta": {"content": delta_text}, "logprobs": lp, "finish_reason": None}
        else:
            choice = {"text": delta_text, "logprobs": lp, "finish_reason": None}
        if self.p.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return self._chunk(choice)

    def _fields(self, pieces: list[tuple], token_ids: list[int], logprobs_entries, final: bool = False) -> list[dict]:
        """Chat chunks of (field, text) pieces, one per piece, and of tool calls, two each (the call's
        index, id, type and name with empty arguments, then its arguments: OpenAI's clients join the
        deltas of one index); the update's logprobs and token ids go with the last (a chunk of its own,
        with an empty delta, when the tokens made no text yet)."""
        lp = self._logprobs(logprobs_entries)
        if self.calls is not None:
            pieces = self.calls.feed(pieces) + (self.calls.finish() if final else [])
        choices = []
        for kind, value in pieces:
            if kind == TOOL_CALLS:
                index, function = self.calls.calls.index(value), value["function"]
                first = {"index": index, "id": value["id"], "type": "function",
                         "function": {"name": function["name"], "arguments": ""}}
                rest = {"index": index, "function": {"arguments": function["arguments"]}}
                choices += [{"delta": {TOOL_CALLS: [first]}, "logprobs": None, "finish_reason": None},
                            {"delta": {TOOL_CALLS: [rest]}, "logprobs": None, "finish_reason": None}]
            else:
                choices.append({"delta": {kind: value}, "logprobs": None, "finish_reason": None})
        if not choices and (lp or (self.p.return_token_ids and token_ids)):
            choices = [{"delta": {}, "logprobs": None, "finish_reason": None}]
        if choices:
            choices[-1]["logprobs"] = lp
            if self.p.return_token_ids:
                choices[-1]["token_ids"] = list(token_ids)
        return [self._chunk(choice) for choice in choices]

    def update(self, update: dict) -> list[dict]:
        """Chunks for one engine update ({"token_ids", "text_delta", "logprobs"}, maybe "finished")."""
        out = [] if self.started else self.start()
        if "finished" in update:
            result = self.result = update["finished"]
            check_result(result)
            finish_reason = result["finish_reason"]
            if self.split is not None:
                out += self._fields(self.split.final(update["token_ids"], result["text"]), update["token_ids"],
                                    update.get("logprobs"), final=True)
                if self.calls is not None and self.calls.calls:
                    finish_reason = TOOL_CALLS
            else:
                chunk = self._content(self.deltas.final(result["text"]), update["token_ids"],
                                      update.get("logprobs"))
                if chunk:
                    out.append(chunk)
            empty = {"delta": {}} if self.p.kind == "chat" else {"text": ""}
            out.append(self._chunk({**empty, "logprobs": None, "finish_reason": finish_reason}))
            if self.p.include_usage and self.p.n == 1:
                out.append(usage_chunk(self.p, [result]))
            return out
        if self.split is not None:
            return out + self._fields(self.split.update(update["token_ids"]), update["token_ids"],
                                      update.get("logprobs"))
        chunk = self._content(self.deltas.update(update["text_delta"]), update["token_ids"], update.get("logprobs"))
        if chunk:
            out.append(chunk)
        return out


def usage_chunk(p: Prepared, results: list[dict]) -> dict:
    """The last chunk of a stream with include_usage: no choices, the usage of them all."""
    obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
    return {"id": p.id, "object": obj, "created": p.created, "model": p.model, "choices": [],
            "usage": total_usage(results)}


def models_response(models: list[tuple[str, int, int]]) -> dict:
    """GET /v1/models of (name, context length, created) per served model."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "raymoe",
                                        "max_model_len": context_length} for name, context_length, created in models]}
