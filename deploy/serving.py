"""The serving core that the HTTP routes (deploy/http_app.py) and the gRPC methods (deploy/grpc_service.py)
share: the application's arguments, the engine, tokenizer and metrics, parsing a request body within
its limits, and one submitted generation's life cycle (updates, result, abort).
"""
import asyncio
import dataclasses
import hmac
import json
import time
from itertools import compress
from time import perf_counter

import pydantic
import pydantic_core
from pydantic import field_validator

from raymoe.cluster.engine_args import EngineArgs, parse_json_object
from raymoe.deploy.metrics import ServerMetrics
from raymoe.deploy.openai_api import APIError, TokenText, request_error
from raymoe.deploy.pipeline_replica import ReplicaLost
from raymoe.deploy.protocol import MAX_MESSAGES, ServedModel
from raymoe.deploy.replica_errors import CODE as REPLICA_UNAVAILABLE
from raymoe.stages.errors import RaymoeError, RequestError
from raymoe.stages.text.requests import reasoning_budget

MAX_BODY_BYTES = 2 * 1024 * 1024      # a 128k-token prompt as text or token ids fits
MAX_JSON_DEPTH = 32                   # OpenAI request bodies nest about 6 deep
ROUTERS = ("prefix", "default")      # a Pipeline deployment's request router (deploy/prefix_router.py; Serve's)
STOP_GRACE_S = 2.0                    # stopping: how long requests in flight get to end before the engine stops


def first_error(e: pydantic.ValidationError) -> tuple[str, str]:
    """(where, what) of a validation error's first entry: its location as a dotted path, and its message."""
    error = e.errors()[0]
    return ".".join(map(str, error["loc"])), error["msg"]


@pydantic.dataclasses.dataclass(config=pydantic.ConfigDict(extra="forbid"))     # a misspelt arg fails
class ServeArgs(EngineArgs):
    """Arguments of the application (`serve run raymoe.deploy.serve:app_builder key=value ...`, or `args:` in a
    Serve config): the engine's (cluster.engine_args.EngineArgs), with the server's defaults, and the server's."""
    model: str = "tiny-qwen35moe"
    microbatches: int | None = None          # None: --pp (one group per stage)
    max_queued: int | None = 256              # sequences waiting for a slot before 503; None or -1: unbounded
    steps_per_call: int = 1                   # a lone stream gets each token as it is sampled
    served_model_name: str | None = None      # the name clients send as "model" (default: model)
    host: str = "127.0.0.1"                   # where gRPC listens (HTTP: Serve's http_options.host)
    grpc_port: int = 9000                     # 0: no gRPC
    api_key: str | None = None                # required from clients when set (default: RAYMOE_API_KEY)
    max_body_bytes: int = MAX_BODY_BYTES      # HTTP body / gRPC message size limit
    max_json_depth: int = MAX_JSON_DEPTH
    max_messages: int = MAX_MESSAGES          # messages per chat request
    # a model's Pipeline replicas (docs/serving-replicas.md): a fixed number, or Serve's autoscaling_config
    # (min_replicas, max_replicas, target_ongoing_requests, upscale_delay_s, downscale_delay_s, ...)
    replicas: int = 1
    autoscaling_config: dict | None = None
    request_router: str = "prefix"            # "prefix": to the replica holding the prompt's prefix; "default": Serve's
    drain_timeout_s: float = 300.0            # a replica scaled down: how long its streams get to end
    reasoning_budget: int = -1                # a chat's most tokens of reasoning (-1: none), unless it sets its own
    # several models in one app: per model, the fields it sets apart from these (model first, then pp,
    # served_model_name, ...); requests go to the one their `model` names, the first when they name none
    models: list[dict] | None = None

    @field_validator("reasoning_budget")
    @classmethod
    def _budget(cls, v):
        if v < -1:
            raise ValueError(f"reasoning_budget must be -1 (none) or at least 0, got {v}")
        return v

    @field_validator("autoscaling_config")
    @classmethod
    def _autoscaling(cls, v):
        if v is not None:
            from ray.serve.config import AutoscalingConfig
            unknown = sorted(set(v) - set(AutoscalingConfig.model_fields))
            if unknown:
                raise ValueError(f"autoscaling_config: unknown field {unknown[0]!r} (Serve's fields: "
                                 f"{', '.join(AutoscalingConfig.model_fields)})")
            try:
                AutoscalingConfig(**v)
            except pydantic.ValidationError as e:    # Serve's own model: one line naming the field
                where, what = first_error(e)
                raise ValueError(f"autoscaling_config{'.' + where if where else ''}: {what}") from None
        return v

    @field_validator("request_router")
    @classmethod
    def _router(cls, v):
        if v not in ROUTERS:
            raise ValueError(f"request_router must be one of {', '.join(ROUTERS)}, got {v!r}")
        return v

    @field_validator("max_body_bytes", "max_json_depth", "max_messages", "replicas")
    @classmethod
    def _positive(cls, v, info):
        if v < 1:
            raise ValueError(f"{info.field_name} must be at least 1, got {v}")
        return v

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def most_replicas(self) -> int:
        """The most Pipeline replicas this model may have at once."""
        return self.autoscaling_config.get("max_replicas", 1) if self.autoscaling_config else self.replicas

    def per_model(self) -> list["ServeArgs"]:
        """The arguments of each served model: these, with a model's own fields over them. RaymoeError for
        two models served under one name, or a field a model may not set apart (the server's own)."""
        if not self.models:
            return [self]
        out = []
        for i, entry in enumerate(self.models):
            shared = [k for k in entry if k in APP_FIELDS]
            if shared:
                raise RaymoeError(f"models[{i}]: {shared[0]} is the server's, not a model's: set it once, outside "
                                  f"models")
            try:
                out.append(dataclasses.replace(self, **entry, models=None))
            except pydantic.ValidationError as e:
                where, what = first_error(e)
                raise RaymoeError(f"models[{i}].{where}: {what}") from None
        names = [a.name for a in out]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise RaymoeError(f"models: two models are served as {twice!r}: give one a served_model_name")
        return out


# The flags of the server's own settings (`python -m raymoe.deploy.serve`), one per ServeArgs field, defaulting to
# the field's default: a Serve config's `args` take the same names with underscores (the engine's: cluster/engine_args.py)
SERVER_FLAGS = {
    "served_model_name": dict(help="the model name clients use (default: --model)"),
    "host": dict(help="where HTTP and gRPC listen (default loopback only; 0.0.0.0: every interface)"),
    "grpc_port": dict(type=int, help="gRPC port, on --host (0: no gRPC)"),
    "api_key": dict(help="clients must send 'Authorization: Bearer KEY' (HTTP /v1/*, gRPC metadata) (default: "
                         "$RAYMOE_API_KEY; none: no authentication)"),
    "max_body_bytes": dict(type=int, help="larger HTTP bodies get 413 (and gRPC messages RESOURCE_EXHAUSTED)"),
    "max_json_depth": dict(type=int, help="deeper JSON bodies get 400"),
    "max_messages": dict(type=int, help="chats with more messages get 400"),
    "reasoning_budget": dict(type=int, help="the most tokens a chat may reason before the engine ends its reasoning "
                                            "(Qwen's </think>, harmony's final channel); a request's "
                                            "thinking_token_budget wins (-1: no budget)"),
    "replicas": dict(type=int, help="pipelines per model (Serve replicas, each a whole pipeline); should one die, "
                                    "only its requests in flight fail (docs/faults.md)"),
    "autoscaling_config": dict(type=parse_json_object, metavar="JSON",
                               help="scale each model's pipelines with the load, in place of --replicas: Serve's "
                                    "autoscaling_config, e.g. '{\"min_replicas\": 1, \"max_replicas\": 4, "
                                    "\"target_ongoing_requests\": 16}' (docs/serving-replicas.md)"),
    "request_router": dict(choices=ROUTERS, help="how a model's requests pick a pipeline: prefix (the one holding the "
                                                 "longest cached prefix of the prompt, unless it is much busier) or "
                                                 "default (Serve's: the less busy of two)"),
    "drain_timeout_s": dict(type=float, metavar="S", help="a pipeline scaled down: how long its streams get to end"),
}
# the server's own fields, which a model of several may not set apart
APP_FIELDS = frozenset(("host", "grpc_port", "api_key", "max_body_bytes", "max_json_depth", "models"))


def replica_unavailable(e: ReplicaLost) -> APIError:
    return APIError(503, str(e), code=REPLICA_UNAVAILABLE)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica or later", code="shutting_down")


class Generation:
    """One submitted sequence: its updates as they come, with the latency metrics; abort() cancels
    it in the coordinator (a no-op once it finished). When the server stops (Serving.stop), its updates
    end with APIError 503 "shutting_down"."""

    def __init__(self, serving: "Serving", seq_id: int, arrived: float):
        self.serving, self.seq_id, self.arrived = serving, seq_id, arrived
        self.done = False
        self.last_token_at: float | None = None
        serving.metrics.in_flight.inc()
        serving.live.add(self)

    async def updates(self):
        try:
            async for update in self._updates():
                yield update
        except Exception as e:
            if self.serving.stopping:
                self._close("shutdown", None)       # the engine stopped under it (Serving.stop)
                raise shutting_down() from None
            if isinstance(e, ReplicaLost):
                self._close("error", None)          # its Pipeline replica died (docs/faults.md)
                raise replica_unavailable(e) from None
            if isinstance(e, RaymoeError) and not isinstance(e, RequestError):
                self._close("error", None)          # the engine gave up under it (docs/faults.md)
                raise APIError(503, f"the pipeline is unavailable: {e}", code="unavailable") from None
            raise

    async def _updates(self):
        m = self.serving.metrics
        async for update in self.serving.engine.stream(self.seq_id):
            if self.serving.stopping and update.get("finished", {}).get("finish_reason") == "abort":
                self._close("shutdown", update["finished"])     # cancelled by Serving.stop
                raise shutting_down()
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
            self.serving.live.discard(self)
            self.serving.metrics.in_flight.dec()
            self.serving.metrics.done(reason, result, perf_counter() - self.arrived)

    def abort(self):
        if not self.done:
            self.serving.engine.cancel(self.seq_id)
            self._close("abort", None)


class Serving:
    """What the HTTP routes and the gRPC methods share: the engine, tokenizer and metrics."""

    def __init__(self, args: ServeArgs, engine, metric_families: dict | None = None):
        """engine: the model's pipeline (cluster.engine.ClusterEngine), or its Pipeline replicas
        (deploy/pipeline_replica.py, PipelineClient); metric_families: the registry's families this model's metrics go
        to (deploy/metrics.py), shared by the models of one server."""
        self.args = args
        self.engine = engine
        self.tokenizer, self.config = self.engine.tokenizer, self.engine.config
        self.model_name = args.name
        self.context_length, self.vocab = self.config.context_length, self.config.vocab
        self.token_text = TokenText(self.tokenizer)
        self.metrics = ServerMetrics(self.model_name, metric_families)
        self.served = ServedModel(self.model_name, self.tokenizer, self.context_length, self.vocab, args.max_messages,
                                  reasoning_budget(args.reasoning_budget))
        self.created = int(time.time())
        self.api_key = args.api_key.encode() if args.api_key else None
        self.live: set[Generation] = set()        # generations not yet finished
        self.responding = 0                       # HTTP event streams still sending
        self.stopping = False
        self._stop_task: asyncio.Task | None = None

    def authorized(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header (or gRPC metadata) value carries the API key, if one is set."""
        if self.api_key is None:
            return True
        scheme, _, key = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key)

    def read_json(self, raw: bytes):
        """One HTTP body's JSON, within the JSON limits (in a worker thread, as the parse that follows:
        tokenizing releases the GIL, and the limits bound the rest)."""
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
        return body

    async def start(self, request_id: str, engine_request: dict, arrived: float) -> Generation:
        """Submit; errors come back as APIError (400 bad request, 503 queue full or pipeline down)."""
        from raymoe.cluster.engine import QueueFullError
        if self.stopping:
            raise shutting_down()
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
        except ReplicaLost as e:
            raise replica_unavailable(e) from None
        except RaymoeError as e:
            raise APIError(503, f"the pipeline is unavailable: {e}", code="unavailable") from None
        except Exception as e:   # the coordinator gave up (see Coordinator.error) or died
            if self.stopping:
                raise shutting_down() from None
            raise APIError(503, f"the pipeline is unavailable: {type(e).__name__}: {e}", code="unavailable") from None
        if self.stopping:        # stop() began while this was submitted: it did not see it
            self.engine.cancel(seq_id)
            raise shutting_down()
        return Generation(self, seq_id, arrived)

    def _cancel_when_submitted(self, task):
        if not task.cancelled() and task.exception() is None:
            self.engine.cancel(task.result())

    async def load(self, timeout: float = 10.0) -> dict:
        load = await asyncio.wait_for(self.engine.load_async(), timeout)
        self.metrics.set_load(load)
        return load

    async def stop(self, grace_s: float = STOP_GRACE_S):
        """Stop serving, once (later calls wait for the first): new requests get 503 "shutting_down", the
        generations in flight are cancelled and end with that error (a stream: an error event, then
        [DONE]); after up to grace_s for them and for the event streams to be sent, the engine stops."""
        self.stopping = True
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop(grace_s))
        await asyncio.shield(self._stop_task)

    async def _stop(self, grace_s: float):
        for generation in list(self.live):
            self.engine.cancel(generation.seq_id)
        deadline = time.monotonic() + grace_s
        while (self.live or self.responding) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self.engine.shutdown_async()


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
