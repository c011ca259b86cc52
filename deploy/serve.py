"""The Ray Serve application: an OpenAI-compatible HTTP API and the gRPC service of protos/,
both over one pipeline (a coordinator and its PP stage actors, optionally expert actors).

    python -m deploy.serve --model MODEL [--pp N] [--host 127.0.0.1] [--port 8000] [--grpc-port 9000] [--api-key KEY]
    serve run deploy.serve:app_builder model=tiny-qwen35moe pp=2      # the same app from Ray's CLI
    serve deploy deploy/configs/serve.yaml                              # or from a Serve config

HTTP: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (`stream: true`: server-sent
events), GET /health, GET /metrics (Prometheus). gRPC (a server of the ingress replica, on the host
HTTP binds): raymoe.Raymoe with Generate, GenerateStream, ListModels, Health. With an API key
(--api-key or RAYMOE_API_KEY), /v1/* need `Authorization: Bearer KEY` and gRPC calls the same
metadata; /health and /metrics stay open (they show load, no content) for probes and scrapers.

The app tokenizes prompts itself and submits token ids, so a seeded request gives exactly the
tokens deploy.generate gives for the same line. A client that disconnects or cancels frees its
sequence at once; when more than `max_queued` sequences wait for a cache slot, new requests get
503 (HTTP) / RESOURCE_EXHAUSTED (gRPC).
"""
import argparse
import asyncio
import dataclasses
import hmac
import ipaddress
import json
import logging
import os
import signal
import sys
import time
from itertools import compress
from time import perf_counter

import grpc
import pydantic_core
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
import pydantic
from pydantic import field_validator
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.engine_args import EngineArgs, add_engine_flags
from deploy.grpc_service import RaymoeServicer
from deploy.metrics import ServerMetrics
from deploy.openai_api import (SSE_DONE, APIError, StreamFormatter, TokenText, chat_response, completion_response,
                               models_response, parse_chat, parse_completion, request_error, sse)
from protos.raymoe_pb2_grpc import add_RaymoeServicer_to_server
from stages.errors import RaymoeError, RequestError

log = logging.getLogger("raymoe.serve")
APP_NAME = "raymoe"
MAX_BODY_BYTES = 2 * 1024 * 1024      # a 128k-token prompt as text or token ids fits
MAX_JSON_DEPTH = 32                   # OpenAI request bodies nest about 6 deep
MAX_MESSAGES = 1024


@pydantic.dataclasses.dataclass(config=pydantic.ConfigDict(extra="forbid"))     # a misspelt arg fails
class ServeArgs(EngineArgs):
    """Arguments of the application (`serve run deploy.serve:app_builder key=value ...`, or `args:` in a
    Serve config): the engine's (cluster.engine_args.EngineArgs), with the server's defaults, and the server's."""
    model: str = "tiny-qwen35moe"
    microbatches: int | None = None          # None: --pp (one group per stage)
    max_queued: int | None = 256              # sequences waiting for a slot before 503; None or -1: unbounded
    served_model_name: str | None = None      # the name clients send as "model" (default: model)
    host: str = "127.0.0.1"                   # where gRPC listens (HTTP: Serve's http_options.host)
    grpc_port: int = 0                        # 0: no gRPC
    api_key: str | None = None                # required from clients when set (default: RAYMOE_API_KEY)
    max_body_bytes: int = MAX_BODY_BYTES      # HTTP body / gRPC message size limit
    max_json_depth: int = MAX_JSON_DEPTH
    max_messages: int = MAX_MESSAGES          # messages per chat request

    @field_validator("max_body_bytes", "max_json_depth", "max_messages")
    @classmethod
    def _positive(cls, v, info):
        if v < 1:
            raise ValueError(f"{info.field_name} must be at least 1, got {v}")
        return v

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


class Generation:
    """One submitted sequence: its updates as they come, with the latency metrics; abort() cancels
    it in the coordinator (a no-op once it finished)."""

    def __init__(self, serving: "Serving", seq_id: int, arrived: float):
        self.serving, self.seq_id, self.arrived = serving, seq_id, arrived
        self.done = False
        self.last_token_at: float | None = None
        serving.metrics.in_flight.inc()

    async def updates(self):
        m = self.serving.metrics
        async for update in self.serving.engine.stream(self.seq_id):
            now = perf_counter()
            n = len(update["token_ids"])
            if n:
                if self.last_token_at is None:
                    m.ttft.observe(now - self.arrived)
                else:
                    for _ in range(n):
                        m.itl.observe((now - self.last_token_at) / n)
                self.last_token_at = now
            if "finished" in update:
                self._close(update["finished"].get("finish_reason") or "error", update["finished"])
            yield update
            if self.done:
                return

    async def result(self) -> dict:
        async for update in self.updates():
            if "finished" in update:
                return update["finished"]
        raise APIError(500, "the stream ended without a result")

    def _close(self, reason: str, result: dict | None):
        if not self.done:
            self.done = True
            self.serving.metrics.in_flight.dec()
            self.serving.metrics.done(reason, result, perf_counter() - self.arrived)

    def abort(self):
        if not self.done:
            self.serving.engine.cancel(self.seq_id)
            self._close("abort", None)


class Serving:
    """What the HTTP routes and the gRPC methods share: the engine, tokenizer and metrics."""

    def __init__(self, args: ServeArgs):
        from cluster.engine import ClusterEngine
        self.args = args
        self.engine = ClusterEngine(args.engine_args())
        self.tokenizer, self.config = self.engine.tokenizer, self.engine.config
        self.model_name = args.name
        self.context_length, self.vocab = self.config.context_length, self.config.vocab
        self.token_text = TokenText(self.tokenizer)
        self.metrics = ServerMetrics(self.model_name)
        self.created = int(time.time())
        self.api_key = args.api_key.encode() if args.api_key else None

    def authorized(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header (or gRPC metadata) value carries the API key, if one is set."""
        if self.api_key is None:
            return True
        scheme, _, key = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key)

    def prepare(self, raw: bytes, parse):
        """Parse and validate one HTTP body (in a worker thread: tokenizing releases the GIL, and the
        limits bound the rest)."""
        args = self.args
        try:
            body = _loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_body") from None
        except RecursionError:
            raise APIError(400, f"the request body nests deeper than --max-json-depth ({args.max_json_depth})",
                           code="json_too_deep") from None
        if _depth(body) > args.max_json_depth:
            raise APIError(400, f"the request body nests deeper than --max-json-depth ({args.max_json_depth})",
                           code="json_too_deep")
        messages = body.get("messages") if isinstance(body, dict) else None
        if isinstance(messages, list) and len(messages) > args.max_messages:
            raise APIError(400, f"messages has {len(messages)} entries, more than --max-messages "
                                f"({args.max_messages})", param="messages", code="too_many_messages")
        return parse(body, self.model_name, self.tokenizer, self.context_length, self.vocab)

    async def start(self, request_id: str, engine_request: dict, arrived: float) -> Generation:
        """Submit; errors come back as APIError (400 bad request, 503 queue full or pipeline down)."""
        from cluster.engine import QueueFullError
        submitting = asyncio.ensure_future(self.engine.submit_async(request_id, engine_request))
        try:
            seq_id = await asyncio.shield(submitting)
        except asyncio.CancelledError:       # the client went away while submitting: cancel once submitted
            submitting.add_done_callback(self._cancel_when_submitted)
            raise
        except RequestError as e:
            raise request_error(e) from None
        except QueueFullError as e:
            raise APIError(503, str(e), code="queue_full") from None
        except RaymoeError as e:
            raise APIError(503, f"the pipeline is unavailable: {e}", code="unavailable") from None
        except Exception as e:   # the coordinator gave up (see Coordinator.error) or died
            raise APIError(503, f"the pipeline is unavailable: {type(e).__name__}: {e}", code="unavailable") from None
        return Generation(self, seq_id, arrived)

    def _cancel_when_submitted(self, task):
        if not task.cancelled() and task.exception() is None:
            self.engine.cancel(task.result())

    async def load(self, timeout: float = 10.0) -> dict:
        load = await asyncio.wait_for(self.engine.load_async(), timeout)
        self.metrics.set_load(load)
        return load

    def shutdown(self):
        self.engine.shutdown()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


_CONTAINERS = frozenset((dict, list))


def _loads(raw: bytes):
    """JSON as json.loads reads it, in half its time for the common case: pydantic's parser (2 MB of
    token ids: 13 ms of GIL rather than 29) unless it refuses the text; json.loads then says why, or
    reads what only it accepts (lone surrogates such as \\ud800, which the tokenizer then names)."""
    try:
        return pydantic_core.from_json(raw)
    except ValueError:
        return json.loads(raw)


def _depth(value) -> int:
    """Nesting depth of parsed JSON, level by level, without recursion. A container's values are
    looked at by C-level iteration (set of their types), not a Python loop per value: a 2 MB list of
    token ids costs ~10 ms of GIL, where a loop per value cost 200 ms during which /health waited."""
    depth, level = 0, [value] if type(value) in _CONTAINERS else []
    while level:
        depth += 1
        below = []
        for container in level:
            values = container.values() if type(container) is dict else container
            if not _CONTAINERS.isdisjoint(set(map(type, values))):
                below.extend(compress(values, map(_CONTAINERS.__contains__, map(type, values))))
        level = below
    return depth


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
    return JSONResponse(e.body(), status_code=e.status)


def unauthorized() -> APIError:
    return APIError(401, "a valid API key is required: send it as 'Authorization: Bearer KEY'",
                    code="invalid_api_key")


class GenerationStream(StreamingResponse):
    """Server-sent events of one generation; however the response ends (finished, client gone,
    task cancelled), the sequence is freed."""

    def __init__(self, content, generation: Generation):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.abort()


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


# A replica that cannot start (a model whose weights do not load) fails the application at once,
# rather than being retried without end.
@serve.deployment(name="RaymoeServer", num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0},
                  health_check_period_s=10, health_check_timeout_s=60, graceful_shutdown_timeout_s=5,
                  max_constructor_retry_count=1)
@serve.ingress(api)
class RaymoeServer:
    """The ingress: one replica per pipeline (the pipeline's actors are its children). It also runs
    the gRPC server, so that gRPC binds the host given (Serve's own gRPC proxy binds every interface)."""

    async def __init__(self, args: dict | ServeArgs):
        args = args if isinstance(args, ServeArgs) else ServeArgs(**args)
        self.serving = Serving(args)
        self.grpc_server = None
        if args.grpc_port:
            self.grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", args.max_body_bytes)])
            add_RaymoeServicer_to_server(RaymoeServicer(self.serving), self.grpc_server)
            address = f"{_url_host(args.host)}:{args.grpc_port}"
            try:
                self.grpc_server.add_insecure_port(address)
            except RuntimeError as e:
                raise RaymoeError(f"cannot listen for gRPC on {address}: {e}") from None
            await self.grpc_server.start()

    # ---- HTTP -------------------------------------------------------------------------------------
    @api.get("/v1/models")
    async def list_models(self, request: Request):
        s = self.serving
        if not s.authorized(request.headers.get("authorization")):
            s.metrics.answered("models", 401)
            return error_response(unauthorized())
        s.metrics.answered("models", 200)
        return models_response(s.model_name, s.context_length, s.created)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate("completions", request, parse_completion)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate("chat", request, parse_chat)

    @api.get("/health")
    async def health(self):
        try:
            await self.serving.engine.check_health_async()
            load = await self.serving.load()
        except Exception as e:
            return error_response(APIError(503, f"unhealthy: {type(e).__name__}: {e}", code="unhealthy"))
        return {"status": "ok", "model": self.serving.model_name, **load}

    @api.get("/metrics")
    async def metrics(self):
        try:
            await self.serving.load(timeout=5)
        except Exception:
            pass                   # the gauges keep their last values
        return Response(self.serving.metrics.render(), media_type=self.serving.metrics.content_type)

    async def _generate(self, endpoint: str, request: Request, parse):
        s = self.serving
        arrived = perf_counter()
        try:
            if not s.authorized(request.headers.get("authorization")):
                raise unauthorized()
            raw = await read_body(request, s.args.max_body_bytes)
            p = await asyncio.to_thread(s.prepare, raw, parse)      # /health answers meanwhile
            generation = await s.start(p.id, p.engine_request, arrived)
        except APIError as e:
            s.metrics.answered(endpoint, e.status)
            return error_response(e)
        try:
            prompt_text = s.tokenizer.decode(p.prompt_ids) if p.echo else ""
            if p.stream:
                response = GenerationStream(self._events(p, generation, prompt_text), generation)
                s.metrics.answered(endpoint, 200)
                return response
            result = await generation.result()
            if p.kind == "chat":
                body = chat_response(p, result, s.token_text)
            else:
                body = completion_response(p, result, s.token_text, prompt_text)
            s.metrics.answered(endpoint, 200)
            return JSONResponse(body)
        except APIError as e:
            s.metrics.answered(endpoint, e.status)
            return error_response(e)
        finally:
            if not p.stream:
                generation.abort()     # the client went away (this task was cancelled) or it failed

    async def _events(self, p, generation: Generation, prompt_text: str):
        formatter = StreamFormatter(p, self.serving.token_text, prompt_text)
        try:
            for chunk in formatter.start():
                yield sse(chunk)
            async for update in generation.updates():
                for chunk in formatter.update(update):
                    yield sse(chunk)
        except APIError as e:
            yield sse(e.body())
        except Exception as e:     # the pipeline failed mid-stream: say so in the stream
            if client_gone(e):
                log.info("client disconnected from a stream (%s)", type(e).__name__)
                return
            log.exception("stream failed")
            yield sse(APIError(500, f"generation failed: {type(e).__name__}: {e}").body())
        yield SSE_DONE

    # ---- Serve hooks -------------------------------------------------------------------------------
    async def check_health(self):
        await self.serving.load(timeout=30)    # raises when the coordinator is gone or gave up

    def __del__(self):
        grpc_server, self.grpc_server = getattr(self, "grpc_server", None), None
        if grpc_server is not None:
            try:     # stops listening now; calls in flight get a second
                asyncio.get_running_loop().create_task(grpc_server.stop(grace=1))
            except RuntimeError:
                pass     # no loop: the process is exiting, and its sockets close with it
        serving = getattr(self, "serving", None)
        if serving is not None:
            self.serving = None
            serving.shutdown()


def app_builder(args: ServeArgs):
    """The Serve application for `serve run deploy.serve:app_builder ...` and Serve configs."""
    if isinstance(args, dict):
        args = ServeArgs(**args)
    if not args.api_key and os.environ.get("RAYMOE_API_KEY"):
        args = dataclasses.replace(args, api_key=os.environ["RAYMOE_API_KEY"])
    return RaymoeServer.bind(dataclasses.asdict(args))


# ---- python -m deploy.serve -------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m deploy.serve", description=__doc__.split("\n\n")[0])
    add_engine_flags(p, ["model"])
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    add_engine_flags(p, ["pp", "ep", "dtype", "device", "transport", "threads", "microbatches", "max_running",
                         "max_model_len", "max_queued"], ServeArgs)
    p.add_argument("--host", default="127.0.0.1",
                   help="where HTTP and gRPC listen (default loopback only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--grpc-port", type=int, default=9000, help="gRPC port, on --host (0: no gRPC)")
    p.add_argument("--api-key", default=os.environ.get("RAYMOE_API_KEY") or None,
                   help="clients must send 'Authorization: Bearer KEY' (HTTP /v1/*, gRPC metadata) "
                        "(default: $RAYMOE_API_KEY; none: no authentication)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="larger HTTP bodies get 413 (and gRPC messages RESOURCE_EXHAUSTED)")
    p.add_argument("--max-json-depth", type=int, default=MAX_JSON_DEPTH, help="deeper JSON bodies get 400")
    p.add_argument("--max-messages", type=int, default=MAX_MESSAGES, help="chats with more messages get 400")
    p.add_argument("--app-name", default=APP_NAME, help="the Serve application's name")
    return p.parse_args(argv)


def _deploy_failure(app_name: str) -> str:
    """Why the application's deployments failed, from Serve's status (the replica's own error last)."""
    try:
        status = serve.status().applications.get(app_name)
        messages = [d.message for d in status.deployments.values() if d.message] if status else []
    except Exception:
        return ""
    lines = [line for m in messages for line in m.strip().splitlines() if line.strip()]
    return f"\n  {lines[-1].strip()}" if lines else ""


class _Stop(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM."""


def main(argv=None) -> int:
    args = parse_args(argv)
    serve_args = ServeArgs.from_flags(args)
    if not serve_args.api_key and not is_loopback(args.host):
        print(f"warning: listening on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    try:                          # fail fast, before starting anything, on a bad setting or model
        from stages.loader import open_model
        serve_args.validate()
        open_model(args.model)
    except RaymoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    stopping = []

    def on_signal(signum, frame):
        if not stopping:
            stopping.append(signum)
            raise _Stop()

    import ray

    from cluster.engine import connect_ray
    ray_was_up = ray.is_initialized()
    # interruptible from here on (Ray's own startup installs no handlers after this point)
    connect_ray(args.pp * (1 + args.ep))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    started_serve = False
    code = 0
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        started_serve = True
        serve.run(app_builder(serve_args), name=args.app_name, route_prefix="/")
        host = _url_host(args.host)
        grpc_text = f", gRPC on {host}:{args.grpc_port}" if args.grpc_port else ""
        auth = "API key required" if serve_args.api_key else "no authentication"
        print(f"serving {serve_args.name} (pp={args.pp}) on http://{host}:{args.port}{grpc_text} ({auth}); "
              f"Ctrl-C or SIGTERM stops", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except _Stop:
        pass
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}{_deploy_failure(args.app_name)}", file=sys.stderr)
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):      # a second signal no longer interrupts the cleanup
            signal.signal(sig, signal.SIG_IGN)
        print("shutting down", file=sys.stderr, flush=True)
        if started_serve:
            try:
                if ray_was_up or os.environ.get("RAY_ADDRESS"):
                    serve.delete(args.app_name)            # a shared cluster: remove only what we added
                else:
                    serve.shutdown()
            except Exception as e:
                print(f"warning: serve shutdown: {e}", file=sys.stderr)
        if not ray_was_up:
            ray.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
