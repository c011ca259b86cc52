"""A served model's pipelines as a Serve deployment of its own (`Pipeline`: each replica one ClusterEngine, that is a
coordinator with its stage and expert actors), and the ingress's view of it (`PipelineClient`: what deploy.serving
needs of an engine, over a DeploymentHandle), for a model served by several pipelines or autoscaled. The ingress
parses and tokenizes; it then calls a replica that the deployment's request router picks (deploy/prefix_router.py: the
one that holds the prompt's longest prefix), so each model has its own replicas, autoscaling and router
(docs/serving-replicas.md). A model served by one pipeline has it in the ingress's process instead.
"""
import asyncio
import dataclasses
import itertools

import ray
from ray import serve

from raymoe.cluster.engine_args import EngineArgs
from raymoe.stages.errors import RaymoeError, unwrap

SUBMITTED = "seq_id"        # the first item of a generation's stream: submitted (or "error": why not)


class ReplicaLost(RaymoeError):
    """The pipeline replica serving a request stopped before it finished (killed, its node lost)."""

    def __init__(self, cause: Exception):
        super().__init__("the pipeline replica serving this request stopped before it finished; retry (new requests "
                         f"go to the others) ({type(cause).__name__})")


class Pipeline:
    """One replica of a model's pipeline. Serve's options (replicas or autoscaling, the request router, the drain
    time) are set per model where the application is built (deploy/http_app.py, app_builder)."""

    def __init__(self, args: dict):
        """args: the model's ServeArgs, as a dict; its engine's fields make the pipeline."""
        from raymoe.cluster.engine import ClusterEngine
        engine_args = EngineArgs(**{f.name: args[f.name] for f in dataclasses.fields(EngineArgs)})
        check_room(engine_args, args["served_model_name"] or args["model"])
        self.engine = ClusterEngine(engine_args)

    async def generate(self, request_id, request: dict):
        """A generation's updates, after one {"seq_id": id} (or {"error": the exception} when the request was not
        queued); a caller that cancels the stream cancels the sequence."""
        try:
            seq_id = await self.engine.submit_async(request_id, request)
        except Exception as e:          # RequestError, QueueFullError, RaymoeError: the ingress answers for them
            yield {"error": e}
            return
        yield {SUBMITTED: seq_id}
        finished = False
        try:
            async for update in self.engine.stream(seq_id):
                finished = "finished" in update
                yield update
        except ray.exceptions.TaskCancelledError:
            return      # the caller cancelled (its client went away): Ray cancelled the coordinator's stream too
        finally:
            if not finished:
                self.engine.cancel(seq_id)

    async def load(self) -> dict:
        return await self.engine.load_async()

    async def check_health_of_engine(self):
        await self.engine.check_health_async()

    async def info(self) -> dict:
        return await engine_info(self.engine)

    async def check_health(self):
        """Serve's health check: a replica whose coordinator gave up is replaced."""
        await asyncio.wait_for(self.engine.load_async(), 30)

    async def __del__(self):
        """Serve awaits this once the replica's requests have ended (it drained), or its drain time ran out."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.shutdown_async()


async def engine_info(engine) -> dict:
    """{"transport", "warning"}: what a pipeline (a ClusterEngine) moves activations over, and the warning its start
    gave, if any."""
    return {"transport": (await engine.stats_async())["transport"], "warning": engine.start_warning}


def check_room(args: EngineArgs, name: str) -> None:
    """RaymoeError when the whole cluster is too small for a pipeline of `args` (its stage and expert actors' CPU
    slots, or GPUs), naming what it needs and has: Ray would wait for room that never comes. Room that is only taken
    now (by other pipelines) is waited for, up to the placement timeout, with its own message (cluster/pipeline.py)."""
    need = args.pp * (1 + args.ep)
    kind = "GPU" if args.device == "cuda" else "CPU"
    total = ray.cluster_resources().get(kind, 0.0)
    if total < need:
        raise RaymoeError(f"the cluster cannot hold a pipeline of {name}: it needs {need} {kind} slot(s) "
                          f"(pp x (1 + ep)) and has {total:g}; add nodes or lower pp / ep")


class PipelineClient:
    """The ingress's engine for one model: ClusterEngine's async calls, made on the model's Pipeline replicas."""

    def __init__(self, handle, args):
        from raymoe.stages.files.loader import open_model
        files = open_model(args.model, args.max_model_len)     # the tokenizer and config: the ingress tokenizes
        self.tokenizer, self.config, self.pp = files.tokenizer, files.config, args.pp
        args.configure_chat(self.tokenizer)
        self.handle = handle
        self.streams: dict[int, object] = {}     # submitted and not yet read to their end
        self.ids = itertools.count()

    async def submit_async(self, request_id, request: dict, defaults: dict | None = None) -> int:
        stream = self.handle.options(stream=True, method_name="generate").remote(request_id, request)
        try:
            first = await stream.__anext__()
        except ray.exceptions.RayActorError as e:
            raise ReplicaLost(e) from None
        except ray.exceptions.RayTaskError as e:
            raise unwrap(e) from None
        if "error" in first:
            raise first["error"]
        seq_id = next(self.ids)
        self.streams[seq_id] = stream
        return seq_id

    async def stream(self, seq_id: int):
        stream = self.streams[seq_id]
        try:
            async for update in stream:
                yield update
        except ray.exceptions.RayActorError as e:
            raise ReplicaLost(e) from None
        except ray.exceptions.RayTaskError as e:      # the engine gave up (a RaymoeError inside)
            raise unwrap(e) from None
        finally:
            self.streams.pop(seq_id, None)

    def cancel(self, seq_id: int):
        stream = self.streams.pop(seq_id, None)
        if stream is not None:
            stream.cancel()

    async def load_async(self) -> dict:
        return await self.handle.options(method_name="load").remote()

    async def check_health_async(self):
        await self.handle.options(method_name="check_health_of_engine").remote()

    async def info_async(self) -> dict:
        """{"transport", "warning"} of one replica's pipeline."""
        return await self.handle.options(method_name="info").remote()

    async def shutdown_async(self):
        """Nothing to stop here: Serve stops the Pipeline replicas with the application."""


def pipeline_deployment():
    """The Pipeline class as a Serve deployment (its options per model come with .options())."""
    return serve.deployment(Pipeline, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
                            health_check_period_s=10, health_check_timeout_s=60, graceful_shutdown_wait_loop_s=0.25,
                            max_constructor_retry_count=1)
