"""The raymoe.Raymoe gRPC service (protos/raymoe.proto).

The Serve ingress replica (deploy.http_app.RaymoeServer) runs a grpc.aio server with a
RaymoeServicer over its `Serving` (the engine, tokenizer and metrics the HTTP routes use too). Errors map to gRPC status
codes: bad request INVALID_ARGUMENT, unknown model NOT_FOUND, queue full RESOURCE_EXHAUSTED,
pipeline down or server shutting down UNAVAILABLE, no or wrong API key UNAUTHENTICATED (metadata `authorization: Bearer
KEY`), anything else INTERNAL. A client that cancels a stream frees its sequence at once.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from time import perf_counter

import grpc

from raymoe.deploy.openai_api import APIError, TextDeltas, check_text_size, usage
from raymoe.deploy.replica_errors import CODE as REPLICA_UNAVAILABLE
from raymoe.stages.errors import RequestError
from raymoe.stages.text.answers import output_parser
from raymoe.stages.text.reasoning import CONTENT, REASONING, SplitText, split_answer
from raymoe.stages.text.requests import check_prompt, prompt_ids
from raymoe.stages.text.structured import MAX_SCHEMA_BYTES, check_grammar, output_grammar

from raymoe.protos import raymoe_pb2 as pb

STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                404: grpc.StatusCode.NOT_FOUND, 503: grpc.StatusCode.RESOURCE_EXHAUSTED,
                500: grpc.StatusCode.INTERNAL}


def usage_pb(result_usage: dict) -> pb.Usage:
    u = usage(**result_usage)
    drafts = u.get("speculation") or {}
    return pb.Usage(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
                    total_tokens=u["total_tokens"], cached_tokens=u["prompt_tokens_details"]["cached_tokens"],
                    draft_tokens=drafts.get("draft_tokens", 0), accepted_draft_tokens=drafts.get("accepted_tokens", 0),
                    verify_steps=drafts.get("verify_steps", 0))


def engine_request(request: pb.GenerateRequest, serving) -> dict:
    """The deploy.generate JSONL line of a GenerateRequest, with the prompt tokenized (as the HTTP API does)."""
    if request.model and request.model != serving.model_name:
        raise APIError(404, f"unknown model {request.model!r}; this server serves {serving.model_name!r}",
                       param="model", code="model_not_found")
    which = request.WhichOneof("input")
    if which is None:
        raise APIError(400, "a request needs one of prompt, prompt_token_ids, messages", param="input")
    if which == "prompt":
        check_text_size(len(request.prompt), serving.tokenizer, serving.context_length, which)
        line = {"prompt": request.prompt}
    elif which == "prompt_token_ids":
        line = {"prompt_token_ids": list(request.prompt_token_ids.ids)}
    else:
        messages = request.messages.messages
        if len(messages) > serving.args.max_messages:
            raise APIError(400, f"messages has {len(messages)} entries, more than --max-messages "
                                f"({serving.args.max_messages})", param=which, code="too_many_messages")
        check_text_size(sum(len(m.content) for m in messages), serving.tokenizer, serving.context_length, which)
        line = {"messages": [{"role": m.role, "content": m.content} for m in messages]}
    try:
        ids = prompt_ids(line, serving.tokenizer)
        check_prompt(ids, serving.vocab, serving.context_length)
    except RequestError as e:
        raise APIError(400, str(e), param=which) from None
    out = {"prompt_token_ids": ids}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "ignore_eos", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_p"):
        if request.HasField(name):
            out[name] = getattr(request, name)
    if request.stop:
        out["stop"] = list(request.stop)
    if request.stop_token_ids:
        out["stop_token_ids"] = list(request.stop_token_ids)
    if request.logit_bias:
        out["logit_bias"] = dict(sorted(request.logit_bias.items()))      # a map has no order: errors name the lowest
    form = request.WhichOneof("format")
    if form is not None:
        out["grammar"] = _grammar(form, getattr(request, form), serving.tokenizer, ids, chat=which == "messages")
    return out


def _grammar(form: str, text: str, tokenizer, ids: list[int], chat: bool) -> str:
    """The grammar the engine keeps the output to (as the HTTP API builds it from response_format), or a
    400 naming the field."""
    try:
        if form == "grammar":
            check_grammar(text, tokenizer)
            return text
        if len(text.encode("utf-8")) > MAX_SCHEMA_BYTES:
            raise RequestError(f"json_schema is larger than {MAX_SCHEMA_BYTES} bytes")
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise RequestError(f"json_schema is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise RequestError("json_schema must be a JSON schema (an object)")
        return output_grammar(tokenizer, ids, schema, None, chat=chat, schema_field="json_schema")
    except RequestError as e:
        raise APIError(400, str(e), param=form) from None


def logprobs_pb(entries) -> list:
    return [pb.TokenLogprob(token_id=e["token_id"], logprob=e["logprob"],
                            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e["top"]]) for e in entries or []]


async def _abort(grpc_context, e: APIError):
    """Ends the call with the status of `e` (raises)."""
    code = STATUS_CODES.get(e.status, grpc.StatusCode.INTERNAL)
    if e.code in ("unavailable", "shutting_down", REPLICA_UNAVAILABLE):
        code = grpc.StatusCode.UNAVAILABLE
    await grpc_context.abort(code, e.message)


def _fields(message: pb.GenerateStreamResponse, pieces: list[tuple]):
    """A stream message's text (the answer's) and reasoning_content from (field, text) pieces."""
    message.text = "".join(text for field, text in pieces if field == CONTENT)
    message.reasoning_content = "".join(text for field, text in pieces if field == REASONING)


class RaymoeServicer:
    def __init__(self, servings: dict):
        """servings: the served models by name (the first: requests that name none)."""
        self.servings = servings
        self.serving = next(iter(servings.values()))

    def _serving_of(self, request):
        if len(self.servings) == 1 or not request.model:
            return self.serving         # with one model, engine_request refuses another name
        s = self.servings.get(request.model)
        if s is None:
            raise APIError(404, f"unknown model {request.model!r}; this server serves "
                                f"{', '.join(map(repr, self.servings))}", param="model", code="model_not_found")
        return s

    async def _authenticate(self, grpc_context):
        if not self.serving.authorized(dict(grpc_context.invocation_metadata()).get("authorization")):
            await grpc_context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                     "a valid API key is required: send metadata 'authorization: Bearer KEY'")

    async def _start(self, request):
        arrived = perf_counter()
        s = self._serving_of(request)
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        line = await asyncio.to_thread(engine_request, request, s)     # tokenizing: off the event loop
        # a chat's reasoning goes apart from its answer, as in the HTTP API and the batch job
        parser = output_parser(s.tokenizer, line["prompt_token_ids"]) if request.HasField("messages") else None
        return s, rid, line, parser, await s.start(rid, line, arrived)

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> pb.GenerateResponse:
        await self._authenticate(grpc_context)
        generation, s = None, self.serving
        try:
            s, rid, _, parser, generation = await self._start(request)
            result = await generation.result()
            if "error" in result:
                raise APIError(500, f"generation failed: {result['error']}")
            s.metrics.answered("grpc_generate", 200)
            fields = (split_answer(parser, result["token_ids"], result["text"]) if parser is not None
                      else {CONTENT: result["text"], REASONING: None})
            return pb.GenerateResponse(
                id=rid, model=s.model_name, prompt_token_ids=result["prompt_token_ids"],
                token_ids=result["token_ids"], text=fields[CONTENT], finish_reason=result["finish_reason"],
                usage=usage_pb(result["usage"]), logprobs=logprobs_pb(result["logprobs"]),
                reasoning_content=fields[REASONING])
        except APIError as e:
            s.metrics.answered("grpc_generate", e.status)
            await _abort(grpc_context, e)
        finally:
            if generation is not None:
                generation.abort()      # no-op when it finished; frees the sequence when the call was cancelled

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context):
        await self._authenticate(grpc_context)
        generation, s = None, self.serving
        try:
            s, rid, line, parser, generation = await self._start(request)
            s.metrics.answered("grpc_generate_stream", 200)
            deltas = TextDeltas(list(request.stop))
            split = SplitText(parser, list(request.stop)) if parser is not None else None
            first = True
            async for update in generation.updates():
                message = pb.GenerateStreamResponse(id=rid, token_ids=update["token_ids"],
                                                    logprobs=logprobs_pb(update.get("logprobs")))
                result = update.get("finished")
                if result is not None:
                    if "error" in result:
                        raise APIError(500, f"generation failed: {result['error']}")
                    if split is not None:
                        _fields(message, split.final(update["token_ids"], result["text"]))
                    else:
                        message.text = deltas.final(result["text"])
                    message.finish_reason = result["finish_reason"]
                    message.usage.CopyFrom(usage_pb(result["usage"]))
                elif split is not None:
                    _fields(message, split.update(update["token_ids"]))
                else:
                    message.text = deltas.update(update["text_delta"])
                if first:
                    message.prompt_token_ids.extend(line["prompt_token_ids"])
                    first = False
                yield message
        except APIError as e:
            s.metrics.answered("grpc_generate_stream", e.status)
            await _abort(grpc_context, e)
        finally:
            if generation is not None:
                generation.abort()

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context) -> pb.ListModelsResponse:
        await self._authenticate(grpc_context)
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=s.model_name, context_length=s.context_length,
                                                          pipeline_stages=s.engine.pp) for s in self.servings.values()])

    async def Health(self, request: pb.HealthRequest, grpc_context) -> pb.HealthResponse:
        try:
            for s in self.servings.values():
                await s.load()
        except Exception as e:
            return pb.HealthResponse(healthy=False, status=f"{type(e).__name__}: {e}")
        return pb.HealthResponse(healthy=True, status="ok")

