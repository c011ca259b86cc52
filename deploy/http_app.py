"""The HTTP application of the Serve ingress: FastAPI routes for the OpenAI API, /health and /metrics,
the body size limit, errors as OpenAI-style JSON, quiet client disconnects, and the Serve deployment
(RaymoeServer) that also runs the gRPC server. `app_builder` builds the application for `serve run` and Serve
configs: the ingress, with the pipeline of each model served by one, and a Pipeline deployment (deploy/pipeline_replica.py)
for each model served by several.
"""
import asyncio
import dataclasses
import ipaddress
import logging
import os
import re
from time import perf_counter

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from raymoe.deploy.api_schema import openapi_document
from raymoe.deploy.grpc_service import RaymoeServicer
from raymoe.deploy.metrics import metric_families
from raymoe.deploy.pipeline_replica import PipelineClient, engine_info, pipeline_deployment
from raymoe.deploy.openai_api import (SSE_DONE, APIError, StreamFormatter, chat_response, completion_response,
                                      models_response, parse_chat, parse_completion, parse_detokenize, parse_tokenize,
                                      sse, usage_chunk)
from raymoe.deploy.messages_api import MessageBlocks, error_body, message_body, message_sse, parse_messages
from raymoe.deploy.responses_api import ResponseItems, error_event, parse_responses, response_body, response_sse
from raymoe.deploy.serving import STOP_GRACE_S, Generation, ServeArgs, Serving, shutting_down
from raymoe.protos.raymoe_pb2_grpc import add_RaymoeServicer_to_server
from raymoe.stages.text.chat import load_chat_template
from raymoe.stages.errors import RaymoeError

log = logging.getLogger("raymoe.serve")
RETRY_AFTER = {"Retry-After": "1"}      # a 503: the queue, a replica or the server; retry soon (on another)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    too_large = APIError(413, f"the request body is larger than --max-body-bytes ({limit} bytes)",
                         code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=RETRY_AFTER if e.status == 503 else None)


def anthropic_error_response(e: APIError) -> JSONResponse:
    """/v1/messages answers errors in Anthropic's shape."""
    return JSONResponse(error_body(e), status_code=e.status)


def authorization(request: Request) -> str | None:
    """The API key as an Authorization header value: OpenAI's clients send `Authorization: Bearer KEY`,
    Anthropic's `x-api-key: KEY`."""
    key = request.headers.get("x-api-key")
    return request.headers.get("authorization") or (None if key is None else f"Bearer {key}")


def unauthorized() -> APIError:
    return APIError(401, "a valid API key is required: send it as 'Authorization: Bearer KEY'",
                    code="invalid_api_key")


class GenerationStream(StreamingResponse):
    """Server-sent events of one request's generations (one per choice); however the response ends
    (finished, client gone, task cancelled), the sequences are freed."""

    def __init__(self, content, generations: list[Generation]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generations = generations

    async def __call__(self, scope, receive, send):
        serving = self.generations[0].serving
        serving.responding += 1          # Serving.stop waits for the last events to be sent
        try:
            await super().__call__(scope, receive, send)
        finally:
            serving.responding -= 1
            for generation in self.generations:
                generation.abort()


async def merged_updates(generations: list[Generation]):
    """(choice index, update) of several generations as they come. One reader task per generation; an
    error in one ends the merge (raised here), and closing the merge cancels the readers."""
    if len(generations) == 1:
        async for update in generations[0].updates():
            yield 0, update
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def read(i: int, generation: Generation):
        try:
            async for update in generation.updates():
                queue.put_nowait((i, update))
            queue.put_nowait((i, done))
        except Exception as e:
            queue.put_nowait((i, e))

    readers = [asyncio.ensure_future(read(i, g)) for i, g in enumerate(generations)]
    try:
        left = len(readers)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for reader in readers:
            reader.cancel()


api = FastAPI(title="raymoe", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(APIError)
async def _api_error(request, e: APIError):
    return error_response(e)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request, e: StarletteHTTPException):
    """The framework's own errors (an unknown path, a wrong method) in the same JSON as every other."""
    if e.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    elif e.status_code == 405:
        allowed = (e.headers or {}).get("allow")
        message = f"{request.method} is not allowed on {request.url.path}" + (f" (allowed: {allowed})" * bool(allowed))
    else:
        message = str(e.detail)
    response = error_response(APIError(e.status_code, message))
    response.headers.update(e.headers or {})
    return response


def client_gone(e: BaseException) -> bool:
    """Whether e only says that the client went away: its request was cancelled (Ray cancels the
    replica's and the coordinator's tasks) or its connection closed mid-body (also inside an
    exception group, as anyio task groups raise them)."""
    from ray.exceptions import TaskCancelledError
    from starlette.requests import ClientDisconnect
    group = getattr(e, "exceptions", None)      # an exception group's members (BaseExceptionGroup, Python >= 3.11)
    if isinstance(group, tuple) and group:
        return all(client_gone(x) for x in group)
    return isinstance(e, (TaskCancelledError, ClientDisconnect)) or isinstance(getattr(e, "cause", None),
                                                                                TaskCancelledError)


class QuietDisconnects:
    """ASGI middleware: a request whose client went away ends here, with one log line. Were the
    exception to go on, Starlette's error middleware would re-raise it to Serve, which keeps it in a
    future that nobody reads once the request is cancelled: "Future exception was never retrieved"
    and a traceback in the replica's log for every dropped stream."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except Exception as e:
            if not client_gone(e):
                raise
            log.info("client disconnected from %s (%s)", scope.get("path"), type(e).__name__)


api.add_middleware(QuietDisconnects)


@api.exception_handler(Exception)
async def _internal_error(request, e: Exception):
    log.exception("unhandled error")
    return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"))


def deployment_name(model_name: str) -> str:
    """The Pipeline deployment's name of a served model (as `serve status` shows it)."""
    return "Pipeline-" + re.sub(r"[^A-Za-z0-9._-]+", "_", model_name)[-60:]


# A replica that cannot start fails the application at once, rather than being retried without end. Stopping
# (docs/shutdown.md): Serve waits for the requests in flight, looking every graceful_shutdown_wait_loop_s, then awaits
# __del__ (RaymoeServer.stop), and kills the replica graceful_shutdown_timeout_s after it began; `python -m
# raymoe.deploy.serve` calls stop() first, so that streams in flight end with an error event rather than be cut.
@serve.deployment(name="RaymoeServer", num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0},
                  health_check_period_s=10, health_check_timeout_s=60, graceful_shutdown_timeout_s=5,
                  graceful_shutdown_wait_loop_s=0.25, max_constructor_retry_count=1)
@serve.ingress(api)
class RaymoeServer:
    """The ingress: it parses and tokenizes requests, and sends each to the model its `model` names (the first when
    it names none): to its pipeline, whose actors are this replica's children, or to one of its Pipeline replicas
    (its request router picks which). It also runs the gRPC server, so that gRPC binds the host given (Serve's own
    gRPC proxy binds every interface)."""

    async def __init__(self, args: dict | ServeArgs, pipelines: dict):
        """pipelines: {served model name: the DeploymentHandle of its Pipeline deployment}, for the models served by
        several pipelines (or autoscaled); a model served by one has it here, in the ingress's process (no hop
        through another replica for each token)."""
        from raymoe.cluster.engine import ClusterEngine
        self._stopping: asyncio.Future | None = None
        self._openapi: dict | None = None
        args = args if isinstance(args, ServeArgs) else ServeArgs(**args)
        families = metric_families({deployment_name(name): name for name in pipelines})
        self.servings: dict[str, Serving] = {}
        try:
            for model_args in args.per_model():
                if model_args.name in pipelines:
                    engine = await asyncio.to_thread(PipelineClient, pipelines[model_args.name], model_args)
                else:
                    engine = ClusterEngine(model_args.engine_args())
                self.servings[model_args.name] = Serving(model_args, engine, families)
        except BaseException:
            await asyncio.gather(*(s.stop() for s in self.servings.values()), return_exceptions=True)
            raise
        self.serving = next(iter(self.servings.values()))       # the first: requests that name no model
        self.grpc_server = None
        if args.grpc_port:
            self.grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", args.max_body_bytes)])
            add_RaymoeServicer_to_server(RaymoeServicer(self.servings), self.grpc_server)
            address = f"{_url_host(args.host)}:{args.grpc_port}"
            try:
                self.grpc_server.add_insecure_port(address)
            except RuntimeError as e:
                raise RaymoeError(f"cannot listen for gRPC on {address}: {e}") from None
            await self.grpc_server.start()

    # ---- HTTP -------------------------------------------------------------------------------------
    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self):
        """This server's OpenAPI document (deploy/api_schema.py): open, as /health is."""
        if self._openapi is None:
            self._openapi = openapi_document(api, [s.served for s in self.servings.values()],
                                             api_key=self.serving.api_key is not None)
        return JSONResponse(self._openapi)

    @api.get("/v1/models")
    async def list_models(self, request: Request):
        s = self.serving
        if not s.authorized(request.headers.get("authorization")):
            s.metrics.answered("models", 401)
            return error_response(unauthorized())
        s.metrics.answered("models", 200)
        return models_response([(m.model_name, m.context_length, m.created) for m in self.servings.values()])

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate("completions", request, parse_completion)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate("chat", request, parse_chat)

    @api.post("/v1/responses")
    async def responses(self, request: Request):
        """OpenAI's Responses API over the chat path (deploy/responses_api.py)."""
        return await self._generate("responses", request, parse_responses)

    @api.post("/v1/messages")
    async def messages(self, request: Request):
        """Anthropic's Messages API over the chat path (deploy/messages_api.py)."""
        return await self._generate("messages", request, parse_messages, anthropic_error_response)

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's /tokenize: a prompt's or a chat's token ids, as a generation request would get them."""
        return await self._tokenizer_call("tokenize", request, parse_tokenize)

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        """vLLM's /detokenize: token ids back to text."""
        return await self._tokenizer_call("detokenize", request, parse_detokenize)

    def _serving_of(self, body) -> Serving:
        """The served model that a body names: the first when it names none. With one model, its request models
        refuse another name (404); with several, an unknown one gets OpenAI's 404 here."""
        model = body.get("model") if isinstance(body, dict) else None
        if len(self.servings) == 1 or not model or not isinstance(model, str):
            return self.serving
        s = self.servings.get(model)
        if s is None:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"{', '.join(f'`{name}`' for name in self.servings)} (see GET /v1/models)",
                           param="model", code="model_not_found")
        return s

    def _prepare(self, raw: bytes, parse):
        """(the served model, the parsed body) of one HTTP body (in a worker thread: tokenizing releases the
        GIL, and the limits bound the rest)."""
        body = self.serving.read_json(raw)
        s = self._serving_of(body)
        return s, parse(body, s.served)

    async def _tokenizer_call(self, endpoint: str, request: Request, parse):
        s = self.serving
        try:
            if not s.authorized(request.headers.get("authorization")):
                raise unauthorized()
            raw = await read_body(request, s.args.max_body_bytes)
            s, body = await asyncio.to_thread(self._prepare, raw, parse)
        except APIError as e:
            s.metrics.answered(endpoint, e.status)
            return error_response(e)
        s.metrics.answered(endpoint, 200)
        return JSONResponse(body)

    @api.get("/health")
    async def health(self):
        if self.serving.stopping:
            return error_response(shutting_down())
        loads = {}
        try:
            for name, s in self.servings.items():       # healthy when every model's pipeline is
                await s.engine.check_health_async()
                loads[name] = await s.load()
        except Exception as e:
            return error_response(APIError(503, f"unhealthy: {type(e).__name__}: {e}", code="unhealthy"))
        body = {"status": "ok", "model": self.serving.model_name, **loads[self.serving.model_name]}
        if len(loads) > 1:
            body["models"] = loads
        return body

    async def pipeline_info(self) -> dict:
        """For deploy.serve's first line (not a route): what the first model's pipeline moves activations over (one
        replica's), and the warning its start gave, if any."""
        engine = self.serving.engine
        return await (engine.info_async() if isinstance(engine, PipelineClient) else engine_info(engine))

    @api.get("/metrics")
    async def metrics(self):
        for s in self.servings.values():
            try:
                await s.load(timeout=5)
            except Exception:
                pass               # the gauges keep their last values
        return Response(self.serving.metrics.render(), media_type=self.serving.metrics.content_type)

    async def _generate(self, endpoint: str, request: Request, parse, errors=error_response):
        s = self.serving
        arrived = perf_counter()
        try:
            if not s.authorized(authorization(request)):
                raise unauthorized()
            raw = await read_body(request, s.args.max_body_bytes)
            s, p = await asyncio.to_thread(self._prepare, raw, parse)      # /health answers meanwhile
            generations = []
            try:
                for request in p.choice_requests():       # one sequence per choice (n)
                    generations.append(await s.start(p.id, request, arrived))
            except BaseException:
                for generation in generations:
                    generation.abort()
                raise
        except APIError as e:
            s.metrics.answered(endpoint, e.status)
            return errors(e)
        try:
            prompt_text = s.tokenizer.decode(p.prompt_ids) if p.echo else ""
            if p.stream:
                if p.kind == "response":
                    events = self._response_events(p, generations[0])
                elif p.kind == "message":
                    events = self._message_events(p, generations[0], s)
                else:
                    events = self._events(p, generations, prompt_text, s)
                response = GenerationStream(events, generations)
                s.metrics.answered(endpoint, 200)
                return response
            results = await asyncio.gather(*(g.result() for g in generations))
            if p.kind == "response":
                body = response_body(p, results[0])
            elif p.kind == "message":
                body = message_body(p, results[0], s.tokenizer)
            elif p.kind == "chat":
                body = chat_response(p, results, s.token_text)
            else:
                body = completion_response(p, results, s.token_text, prompt_text)
            s.metrics.answered(endpoint, 200)
            return JSONResponse(body)
        except APIError as e:
            s.metrics.answered(endpoint, e.status)
            return errors(e)
        finally:
            if not p.stream:
                for generation in generations:
                    generation.abort()     # the client went away (this task was cancelled) or it failed

    async def _events(self, p, generations: list[Generation], prompt_text: str, s: Serving):
        formatters = [StreamFormatter(p, s.token_text, prompt_text, i) for i in range(len(generations))]
        try:
            for formatter in formatters:
                for chunk in formatter.start():
                    yield sse(chunk)
            async for i, update in merged_updates(generations):
                for chunk in formatters[i].update(update):
                    yield sse(chunk)
            if p.include_usage and p.n > 1:
                yield sse(usage_chunk(p, [f.result for f in formatters]))
        except APIError as e:
            yield sse(e.body())
        except Exception as e:     # the pipeline failed mid-stream: say so in the stream
            if client_gone(e):
                log.info("client disconnected from a stream (%s)", type(e).__name__)
                return
            log.exception("stream failed")
            yield sse(APIError(500, f"generation failed: {type(e).__name__}: {e}").body())
        yield SSE_DONE

    @staticmethod
    async def _named_events(answer, generation: Generation, to_sse, error_event):
        """A stream of named events (/v1/responses, /v1/messages): those `answer` (deploy/answer_events.py) builds,
        each as to_sse(event), ending with its last one or error_event(the APIError)."""
        try:
            for event in answer.start():
                yield to_sse(event)
            async for update in generation.updates():
                for event in answer.update(update):
                    yield to_sse(event)
        except APIError as e:
            yield to_sse(error_event(e))
        except Exception as e:     # the pipeline failed mid-stream: say so in the stream
            if client_gone(e):
                log.info("client disconnected from a stream (%s)", type(e).__name__)
                return
            log.exception("stream failed")
            yield to_sse(error_event(APIError(500, f"generation failed: {type(e).__name__}: {e}")))

    def _response_events(self, p, generation: Generation):
        """A Responses stream, ending with response.completed (or response.incomplete, or an error event)."""
        items = ResponseItems(p)
        return self._named_events(items, generation, response_sse, lambda e: error_event(e, items.sequence))

    def _message_events(self, p, generation: Generation, s: Serving):
        """A Messages stream: Anthropic's events, from message_start to message_stop (or an error event)."""
        return self._named_events(MessageBlocks(p, s.tokenizer), generation, message_sse, error_body)

    # ---- Serve hooks -------------------------------------------------------------------------------
    async def check_health(self):
        for s in self.servings.values():
            if not isinstance(s.engine, PipelineClient):
                await s.load(timeout=30)    # raises when a coordinator is gone or gave up

    async def stop(self):
        """Stop serving, once (later calls wait for the first): gRPC stops taking calls, new HTTP requests
        get 503 "shutting_down", the requests in flight end with that error (a stream: an error event, then
        [DONE]; a gRPC call: UNAVAILABLE), then the pipelines in this process stop. Takes at most about STOP_GRACE_S
        plus their shutdown timeout (ClusterEngine.shutdown_async). Pipeline replicas, left with nothing in flight,
        stop with the application."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self):
        stopping = []
        if self.grpc_server is not None:     # refuses new calls at once; cancels what is left after the grace
            stopping.append(asyncio.ensure_future(self.grpc_server.stop(grace=STOP_GRACE_S)))
        await asyncio.gather(*(s.stop() for s in self.servings.values()), *stopping)

    async def __del__(self):
        """Serve's ingress wrapper awaits this as Serve stops the replica, once its requests have ended
        (were they not to end, Serve kills the replica graceful_shutdown_timeout_s after it began)."""
        if getattr(self, "serving", None) is not None:
            await self.stop()


def pipeline_app(args: ServeArgs):
    """One served model's Pipeline deployment, with its replicas (or autoscaling) and request router."""
    from ray.serve.config import RequestRouterConfig

    from raymoe.deploy.prefix_router import PrefixAffinityRouter
    options = {"name": deployment_name(args.name), "graceful_shutdown_timeout_s": args.drain_timeout_s}
    if args.autoscaling_config:
        options["autoscaling_config"] = args.autoscaling_config
    else:
        options["num_replicas"] = args.replicas
    if args.request_router == "prefix":
        options["request_router_config"] = RequestRouterConfig(request_router_class=PrefixAffinityRouter)
    return pipeline_deployment().options(**options).bind(dataclasses.asdict(args))


def app_builder(args: ServeArgs):
    """The Serve application for `serve run raymoe.deploy.serve:app_builder ...` and Serve configs: the ingress,
    and a Pipeline deployment per model served by several pipelines (or autoscaled)."""
    if isinstance(args, dict):
        args = ServeArgs(**args)
    # a template file is read here (the driver), where its path means what the user meant
    models = [{**m, "chat_template": load_chat_template(m["chat_template"])} if m.get("chat_template") else m
              for m in args.models or ()] or None
    args = dataclasses.replace(args, chat_template=load_chat_template(args.chat_template), models=models)
    if not args.api_key and os.environ.get("RAYMOE_API_KEY"):
        args = dataclasses.replace(args, api_key=os.environ["RAYMOE_API_KEY"])
    pipelines = {m.name: pipeline_app(m) for m in args.per_model() if m.autoscaling_config or m.replicas > 1}
    return RaymoeServer.bind(dataclasses.asdict(args), pipelines)
