"""The engine API that the batch job and the Serve app use: start a pipeline on Ray, submit
requests, stream their tokens, cancel them.

    engine = ClusterEngine(EngineArgs("tiny-qwen35moe", pp=2))
    seq_id = await engine.submit_async("r1", {"prompt": "Hello", "max_tokens": 8})
    async for update in engine.stream(seq_id): ...
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import uuid

import ray

from stages.errors import RaymoeError
from stages.loader import open_model
from stages.memory import GiB, fit_running, prefix_shares, stage_need

from . import watchdog
from .coordinator import Coordinator, QueueFullError  # noqa: F401  (QueueFullError: part of this API)
from .engine_args import EngineArgs
from .pipeline import PipelineSpec


_connected_here = False
_watchdog = None


def connect_ray(slots_needed: int):
    """Join the cluster at RAY_ADDRESS when set, else start a local one with enough CPU slots.
    Ray enables token authentication for a new local cluster unless RAY_AUTH_MODE says otherwise
    (the token: ~/.ray/auth_token, generated when missing); its servers listen on every interface,
    guarded by that token (ray.init turns a loopback node address into the machine's). A local cluster
    gets a watchdog (cluster/watchdog.py) that stops its processes if this driver is killed."""
    global _connected_here, _watchdog
    if ray.is_initialized():
        return
    _connected_here = True
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, slots_needed + 1), include_dashboard=False,
                 object_store_memory=OBJECT_STORE_BYTES,
                 log_to_driver=False, logging_level="ERROR")
        _watchdog = watchdog.start()     # stops the cluster's processes should this driver be killed


def disconnect_ray():
    """Undo connect_ray: a local cluster it started stops with all its processes. Ray that this
    process was already connected to is left alone."""
    global _connected_here
    if _connected_here and ray.is_initialized():
        ray.shutdown()
    _connected_here = False


DEFAULT_MAX_RUNNING = 64
PREFIX_SHARE = 0.1       # of the memory a plan leaves free, the prefix cache's by default
GPU_PREFIX_GB = 1.0      # the default on GPUs, whose memory Ray does not know (each stage checks its share)
OBJECT_STORE_BYTES = 2 << 30    # a local cluster's object store: activations and logits, not weights


def check_gpus(args: EngineArgs):
    """--device cuda: one GPU per stage and expert actor, among the GPUs Ray knows; else one line, at once."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    actors = args.pp * (1 + args.ep)
    if gpus < actors:
        raise RaymoeError(f"--device cuda needs one GPU per actor ({actors} for --pp {args.pp}"
                          + (f" --ep {args.ep}" if args.ep else "") + f"), and the Ray cluster has {gpus}; "
                          "use --device cpu, fewer stages, or a cluster with more GPUs")


def plan_memory(files, spec: PipelineSpec):
    """Before any weight is read: each stage's need against the memory Ray's nodes have. Sets the
    bundles' `memory`, the stages' cache budget and, in spec.args.max_running, how many sequences may run
    at once (see stages/memory.py), and in spec.args.prefix_cache_gb the prefix cache's size (without the flag:
    PREFIX_SHARE of what the plan leaves free). Memory for the running sequences' full-context caches is reserved;
    without --max-running, when fewer than DEFAULT_MAX_RUNNING full contexts fit, up to DEFAULT_MAX_RUNNING
    sequences still run as long as their own bounds (prompt + max_tokens) fit the same reservation
    (admission by memory). GPU stages hold weights and caches on the device (Ray does not know its memory:
    each stage checks it before loading, StageActor.load); their host memory is a tensor's read buffer."""
    args = spec.args
    if args.device == "cuda":
        prefix = GPU_PREFIX_GB if args.prefix_cache_gb is None else args.prefix_cache_gb
        spec.args = dataclasses.replace(args, max_running=args.max_running or DEFAULT_MAX_RUNNING,
                                        prefix_cache_gb=prefix)
        return
    needs = [stage_need(files, r, args.dtype, args.step_chunk) for r in spec.ranges()]
    nodes = [int(n["Resources"].get("memory", 0)) for n in ray.nodes() if n.get("Alive")] or [0]

    def reserve_prefix(gb: float):
        for need, share in zip(needs, prefix_shares(files, spec.ranges(), args.step_chunk, int(gb * GiB))):
            need.prefix_bytes = share

    if args.prefix_cache_gb is not None:        # asked for: it must fit beside the running sequences' caches
        reserve_prefix(args.prefix_cache_gb)
    wanted = args.max_running
    running = fit_running(needs, nodes, wanted or DEFAULT_MAX_RUNNING, explicit=wanted is not None)
    prefix = args.prefix_cache_gb
    if prefix is None:      # a share of what the plan leaves free, on the whole and on the largest node
        totals = [need.total(running) for need in needs]
        free = min(sum(nodes) - sum(totals), max(nodes) - max(totals))
        prefix = max(0, int(PREFIX_SHARE * free)) / GiB
        reserve_prefix(prefix)
    spec.stage_memory = [need.total(running) for need in needs]
    spec.cache_budget = [running * need.cache_bytes_per_sequence for need in needs]
    spec.args = dataclasses.replace(args, max_running=wanted or DEFAULT_MAX_RUNNING, prefix_cache_gb=prefix)


def show_loading(ref, spec: PipelineSpec):
    """While `ref` (the pipeline's start) is pending, a progress bar per stage of the bytes it has read
    (on a terminal); returns ref."""
    import sys

    from tqdm import tqdm

    ranges = spec.ranges()
    bars = [tqdm(total=0, unit="B", unit_scale=True, file=sys.stderr, disable=None, leave=False,
                 desc=f"stage {i} (layers {r.start}-{r.stop - 1})") for i, r in enumerate(ranges)]
    try:
        while not ray.wait([ref], timeout=0.5)[0]:
            for i, bar in enumerate(bars):
                try:
                    done, total = ray.get(ray.get_actor(f"{spec.name}-stage{i}").load_progress.remote(), timeout=5)
                except (ValueError, ray.exceptions.RayError):     # not started yet, or gone
                    continue
                bar.total = total
                bar.update(done - bar.n)
    finally:
        for bar in bars:
            bar.close()
    return ref


def unwrap(error: Exception) -> Exception:
    """The user-facing error inside a Ray task error, if there is one."""
    cause = getattr(error, "cause", None)
    while cause is not None and not isinstance(cause, RaymoeError) and getattr(cause, "cause", None) is not None:
        cause = cause.cause
    return cause if isinstance(cause, RaymoeError) else error


COORDINATOR_DIED = ("the coordinator actor died, and with it the state of every request in flight; the job failed "
                    "(the Ray logs say why)")


@contextlib.contextmanager
def ray_errors(died: str = COORDINATOR_DIED):
    """Errors of Ray calls as users should read them: a task's RaymoeError as itself (one line), an
    actor's death as `died`."""
    try:
        yield
    except ray.exceptions.RayTaskError as e:
        raise unwrap(e) from None
    except ray.exceptions.RayActorError:
        raise RaymoeError(died) from None


def pipeline_spec(args: EngineArgs, files, name: str | None = None) -> PipelineSpec:
    """A pipeline's plan for resolved settings, before any weight is read: checked against the model, on
    the Ray cluster (joined, or started here), GPUs counted, memory planned (plan_memory)."""
    args.validate(files.n_layers, files.config.n_expert)
    spec = PipelineSpec(args, files.n_layers, files.config.n_expert, name=name)
    connect_ray(args.pp * (1 + args.ep))
    if args.device == "cuda":
        check_gpus(args)
    plan_memory(files, spec)
    return spec


class ClusterEngine:
    def __init__(self, args: EngineArgs):
        args = args.resolved()
        files = open_model(args.model, args.max_model_len)    # config and tokenizer only: fail fast on a bad model
        self.tokenizer, self.config, self.pp = files.tokenizer, files.config, args.pp
        args.configure_chat(self.tokenizer)
        spec = pipeline_spec(args, files, name=f"raymoe-{uuid.uuid4().hex[:8]}")
        self.coordinator = Coordinator.options(num_cpus=0).remote(spec)
        self._call(show_loading(self.coordinator.start.remote(), spec))

    def _call(self, ref, timeout=None):
        with ray_errors():
            return ray.get(ref, timeout=timeout)

    def submit(self, request_id, request: dict, defaults: dict | None = None) -> int:
        """Queue a request; returns its sequence id. A bad request raises RequestError."""
        return self._call(self.coordinator.submit.remote(request_id, request, defaults))

    def submit_many(self, requests: list, defaults: dict | None = None) -> list:
        return self._call(self.coordinator.submit_many.remote(requests, defaults))

    def wait_finished(self, timeout: float = 1.0) -> list[tuple[int, dict]]:
        return self._call(self.coordinator.wait_finished.remote(timeout))

    async def stream(self, seq_id: int):
        """Async iterator of updates; the last carries "finished" (the full result)."""
        async for ref in self.coordinator.stream.remote(seq_id):
            yield await ref

    def cancel(self, seq_id: int):
        self.coordinator.cancel.remote(seq_id)

    def stats(self) -> dict:
        return self._call(self.coordinator.pipeline_stats.remote())

    # ---- async API for servers (never blocks the caller's event loop) -------------------------
    async def _acall(self, ref):
        with ray_errors():
            return await ref

    async def submit_async(self, request_id, request: dict, defaults: dict | None = None) -> int:
        """Queue a request whose result is only read through stream(); raises RequestError for a bad
        request and QueueFullError when the bounded queue (max_queued) is full."""
        return await self._acall(self.coordinator.submit.remote(request_id, request, defaults, False))

    async def check_health_async(self):
        """Raise RaymoeError when the engine cannot make progress (see Coordinator.check_health)."""
        await self._acall(self.coordinator.check_health.remote())

    async def load_async(self) -> dict:
        """{"running", "waiting", "queued", "slots", "max_queued", ...}: see Coordinator.load."""
        return await self._acall(self.coordinator.load.remote())

    def shutdown(self, timeout: float = 60):
        """Stop the pipeline's actors, then the coordinator (idempotent)."""
        try:
            ray.get(self.coordinator.shutdown.remote(), timeout=timeout)
        except Exception:
            pass
        self._kill_coordinator()

    async def shutdown_async(self, timeout: float = 3):
        """shutdown() for a server's event loop: waits up to timeout for the pipeline's actors to stop."""
        try:
            await asyncio.wait_for(self.coordinator.shutdown.remote(), timeout)
        except Exception:       # timed out, or gone: killing the coordinator ends its actors with it
            pass
        self._kill_coordinator()

    def _kill_coordinator(self):
        try:
            ray.kill(self.coordinator, no_restart=True)
        except Exception:
            pass
