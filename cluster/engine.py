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
import signal
import sys
import threading
import time
import uuid
from collections import deque

import ray

from raymoe.stages.errors import RaymoeError, unwrap
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.memory import GiB, fit_running, prefix_shares, stage_need

from . import watchdog
from .coordinator import MAX_RESTARTS, RESTART_WINDOW, Coordinator
from .coordinator import QueueFullError  # noqa: F401  (part of this API)
from .engine_args import EngineArgs
from .pipeline import COORDINATOR_NAMESPACE, PIPELINE_PREFIX, PipelineSpec, coordinator_name, gpu_share, remove_group


_connected_here = False
_watchdog = None
# Ray settings of a local cluster that connect_ray starts (set in the environment unless the user set them): task
# events off, which only the dashboard's task views read (a local cluster has no dashboard) and which grew
# gcs_server's memory without bound under serving load, ~23 MiB a minute (docs/ray-step.md)
OWN_CLUSTER_SETTINGS = {"RAY_task_events_report_interval_ms": "0"}


def connect_ray(slots_needed: int):
    """Join the cluster at RAY_ADDRESS when set, else start a local one with enough CPU slots.
    Ray enables token authentication for a new local cluster unless RAY_AUTH_MODE says otherwise
    (the token: ~/.ray/auth_token, generated when missing); its servers listen on every interface,
    guarded by that token (ray.init turns a loopback node address into the machine's). A local cluster
    gets a watchdog (cluster/watchdog.py) that stops its processes if this driver is killed. SIGTERM and
    SIGINT handlers the caller installed stay (ray.init would replace SIGTERM's with its own)."""
    global _connected_here, _watchdog
    if ray.is_initialized():
        return
    _connected_here = True
    on_main_thread = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if on_main_thread else {}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        for name, value in OWN_CLUSTER_SETTINGS.items():      # inherited by the cluster's processes
            os.environ.setdefault(name, value)
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, slots_needed + 1), include_dashboard=False,
                 object_store_memory=OBJECT_STORE_BYTES,
                 log_to_driver=False, logging_level="ERROR")
        _watchdog = watchdog.start()     # stops the cluster's processes should this driver be killed
    for s, handler in handlers.items():
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(s, handler)


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


def check_gpus(args: EngineArgs) -> float:
    """--device cuda: the part of a GPU each stage and expert actor gets among the GPUs Ray knows (a whole one each
    where there are enough, else an equal share: cluster.pipeline.gpu_share); one line, at once, where there is none
    or the transport cannot run on a shared GPU."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    actors = args.pp * (1 + args.ep)
    if gpus < 1:
        raise RaymoeError("--device cuda: the Ray cluster has no GPU; use --device cpu or a cluster with GPUs")
    share = gpu_share(actors, gpus)
    if share < 1 and args.transport == "nccl":
        raise RaymoeError(f"--transport nccl: the {actors} actors share {gpus} GPU(s), and NCCL cannot pair two ranks "
                          f"on one device (it refuses a communicator whose ranks share a GPU); use --transport "
                          f"object_store, or a GPU per actor")
    return share


def plan_memory(files, spec: PipelineSpec, mtp=None):
    """Before any weight is read: each stage's need against the memory Ray's nodes have. Sets the
    bundles' `memory`, the stages' cache budget and, in spec.args.max_running, how many sequences may run
    at once (see stages/runtime/memory.py), and in spec.args.prefix_cache_gb the prefix cache's size (without the flag:
    PREFIX_SHARE of what the weights leave free, or with --max-running of what its sequences leave). Memory for the running sequences' full-context caches is reserved;
    without --max-running, when fewer than DEFAULT_MAX_RUNNING full contexts fit, up to DEFAULT_MAX_RUNNING
    sequences still run as long as their own bounds (prompt + max_tokens) fit the same reservation
    (admission by memory). GPU stages hold weights and caches on the device (Ray does not know its memory:
    each stage checks it before loading, StageActor.load); their host memory is a tensor's read buffer. mtp: the files
    of the MTP head the last stage runs (EngineArgs.mtp_head), or None."""
    args = spec.args
    if args.device == "cuda":
        prefix = GPU_PREFIX_GB if args.prefix_cache_gb is None else args.prefix_cache_gb
        spec.args = dataclasses.replace(args, max_running=args.max_running or DEFAULT_MAX_RUNNING,
                                        prefix_cache_gb=prefix)
        return
    needs = [stage_need(files, r, args.dtype, args.step_chunk, mtp) for r in spec.ranges()]
    nodes = [int(n["Resources"].get("memory", 0)) for n in ray.nodes() if n.get("Alive")] or [0]

    def reserve_prefix(gb: float):
        for need, share in zip(needs, prefix_shares(files, spec.ranges(), args.step_chunk, int(gb * GiB))):
            need.prefix_bytes = share

    def free_beside(running: int) -> int:       # on the whole and on the largest node
        totals = [need.total(running) for need in needs]
        return min(sum(nodes) - sum(totals), max(nodes) - max(totals))

    wanted, prefix = args.max_running, args.prefix_cache_gb
    if prefix is None and wanted is None:
        # the prefix cache's share comes before the running sequences': where the weights take most of the
        # memory, their full contexts would otherwise leave it next to nothing (a 15 GB model on 24 GB: 5 MB)
        prefix = PREFIX_SHARE * max(0, free_beside(0)) / GiB
        reserve_prefix(prefix)
        if free_beside(1) < 0:         # not even one full context beside it: the cache gives way
            prefix = 0.0
            reserve_prefix(prefix)
    elif prefix is not None:        # asked for: it must fit beside the running sequences' caches
        reserve_prefix(prefix)
    running = fit_running(needs, nodes, wanted or DEFAULT_MAX_RUNNING, explicit=wanted is not None)
    if prefix is None:      # with --max-running: a share of what the running sequences leave free
        prefix = max(0, int(PREFIX_SHARE * free_beside(running))) / GiB
        reserve_prefix(prefix)
    spec.stage_memory = [need.total(running) for need in needs]
    spec.cache_budget = [running * need.cache_bytes_per_sequence for need in needs]
    spec.args = dataclasses.replace(args, max_running=wanted or DEFAULT_MAX_RUNNING, prefix_cache_gb=prefix)


def show_loading(ref, spec: PipelineSpec):
    """While `ref` (the pipeline's start) is pending, a progress bar per stage of the bytes it has read
    (on a terminal); returns ref."""
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


COORDINATOR_DIED = "the coordinator actor died while its pipeline started (the Ray logs say why)"


@contextlib.contextmanager
def ray_errors(died: str):
    """Errors of Ray calls as users should read them: a task's RaymoeError as itself (one line), an
    actor's death as `died`."""
    try:
        yield
    except ray.exceptions.RayTaskError as e:
        raise unwrap(e) from None
    except ray.exceptions.RayActorError:
        raise RaymoeError(died) from None


def new_coordinator(spec: PipelineSpec):
    """The pipeline's coordinator, named after it (in one namespace for every job): a pipeline whose
    coordinator is gone is found by that (cluster/pipeline.py, remove_orphaned_groups)."""
    return Coordinator.options(num_cpus=0, name=coordinator_name(spec.name),
                               namespace=COORDINATOR_NAMESPACE).remote(spec)


def pipeline_spec(args: EngineArgs, files, name: str | None = None) -> PipelineSpec:
    """A pipeline's plan for resolved settings, before any weight is read: checked against the model, on
    the Ray cluster (joined, or started here), GPUs counted, memory planned (plan_memory)."""
    args.validate(files.n_layers, files.config.n_expert)
    files.check_tensors()
    mtp = args.mtp_head(files)      # a model without the head the flags ask for fails here
    spec = PipelineSpec(args, files.n_layers, files.config.n_expert, name=name)
    connect_ray(args.pp * (1 + args.ep))
    if args.device == "cuda":
        spec.gpu_share = check_gpus(args)
    plan_memory(files, spec, mtp)
    return spec


@dataclasses.dataclass
class OpenSequence:
    """A sequence submitted through a ClusterEngine and not finished yet: what a new coordinator needs to
    take it over (Coordinator.readmit), kept where it outlives the coordinator (the batch job's driver, the
    server's ingress replica)."""
    request_id: object
    request: dict
    defaults: dict | None
    collect: bool
    token_ids: list[int] = dataclasses.field(default_factory=list)    # given to its reader so far (stream())
    logprobs: list | None = None
    text_chars: int = 0

    def readmission(self, seq_id: int) -> tuple:
        delivered = ({"token_ids": self.token_ids, "logprobs": self.logprobs, "text_chars": self.text_chars}
                     if self.token_ids else None)
        return seq_id, self.request_id, self.request, self.defaults, self.collect, delivered


class ClusterEngine:
    """A coordinator and its pipeline. Should the coordinator die (and with it, their owner, its stage and
    expert actors), the next call that finds it dead starts another with a pipeline of its own and hands it
    every open sequence: what is in flight continues (docs/faults.md). More than MAX_RESTARTS deaths within
    RESTART_WINDOW seconds, or a replacement that cannot start, fail the engine with one line."""

    def __init__(self, args: EngineArgs):
        args = args.resolved()
        files = open_model(args.model, args.max_model_len)    # config and tokenizer only: fail fast on a bad model
        self.tokenizer, self.config, self.pp = files.tokenizer, files.config, args.pp
        args.configure_chat(self.tokenizer)
        self.spec = pipeline_spec(args, files, name=f"{PIPELINE_PREFIX}{uuid.uuid4().hex[:8]}")
        self.open: dict[int, OpenSequence] = {}
        self.next_seq_id = 0                    # past every sequence id a coordinator gave
        self.restarts = 0                       # coordinators replaced
        self.recent_restarts: deque[float] = deque()
        self.failed: str | None = None          # why no coordinator can be had any more
        self._recovering: asyncio.Future | None = None
        self.coordinator = new_coordinator(self.spec)
        with ray_errors(COORDINATOR_DIED):
            self.start_warning: str | None = ray.get(show_loading(self.coordinator.start.remote(), self.spec))
        if self.start_warning:     # the coordinator's own log does not reach the driver
            print(f"warning: {self.start_warning}", file=sys.stderr)

    # ---- the coordinator's death -------------------------------------------------------------------
    def _replacement(self, dead):
        """Kill what is left of `dead` and start a coordinator in its place (without the test fault)."""
        if self.failed:
            raise RaymoeError(self.failed)
        now = time.monotonic()
        self.recent_restarts.append(now)
        while self.recent_restarts[0] < now - RESTART_WINDOW:
            self.recent_restarts.popleft()
        if len(self.recent_restarts) > MAX_RESTARTS:
            self._fail(f"the coordinator actor died {len(self.recent_restarts)} times within "
                       f"{RESTART_WINDOW / 60:g} minutes; giving up (the Ray logs say why)")
        self._kill(dead)
        remove_group(self._pipeline_name())
        self.restarts += 1
        # its own actor names: the dead pipeline's actors may not be gone yet
        spec = dataclasses.replace(self.spec, name=self._pipeline_name(),
                                   args=dataclasses.replace(self.spec.args, fault_injection=None))
        return new_coordinator(spec)

    def _pipeline_name(self) -> str:
        """The name of the current coordinator's pipeline (its actors', its placement group's)."""
        return f"{self.spec.name}-{self.restarts}" if self.restarts else self.spec.name

    def _take_over(self, coordinator):
        """Make `coordinator` the one in use and hand it the open sequences as they stand now (a stream
        reading the dead one from here on drops what it reads: the new one repeats it)."""
        self.coordinator = coordinator
        return coordinator.readmit.remote([s.readmission(seq_id) for seq_id, s in self.open.items()],
                                          self.next_seq_id)

    def _fail(self, message: str):
        self.failed = message
        raise RaymoeError(message)

    def _recover(self, dead):
        """A call found the coordinator `dead`: replace it (sync callers: a batch job). A replacement that dies
        as it starts (Ray placed it on a node being lost) is replaced in turn, within the restart budget; one
        whose pipeline cannot start (no room for it) fails the engine with its one line."""
        while self.coordinator is dead:
            coordinator = self._replacement(dead)
            try:
                ray.get(coordinator.start.remote())
                ray.get(self._take_over(coordinator))
            except ray.exceptions.RayError as e:
                self._check_start(e)
                self.coordinator = dead = coordinator

    async def _recover_async(self, dead):
        """_recover for a server's event loop: the calls that find it dead at once share one replacement."""
        if self.coordinator is dead and self._recovering is None:
            self._recovering = asyncio.ensure_future(self._replace_async(dead))
        if self._recovering is not None:
            await asyncio.shield(self._recovering)

    async def _replace_async(self, dead):
        try:
            while self.coordinator is dead:
                coordinator = self._replacement(dead)
                try:
                    await coordinator.start.remote()
                    await self._take_over(coordinator)
                except ray.exceptions.RayError as e:
                    self._check_start(e)
                    self.coordinator = dead = coordinator
        finally:
            self._recovering = None

    def _check_start(self, e: ray.exceptions.RayError):
        """A replacement failed: its own error (RaymoeError: the pipeline has no room) fails the engine."""
        cause = unwrap(e)
        if isinstance(cause, RaymoeError):
            self._fail(f"the coordinator actor died and its replacement could not start: {cause}")

    def _call(self, method: str, *args):
        """ray.get of a coordinator method, made again on its replacement if the coordinator died."""
        while True:
            coordinator = self.coordinator
            try:
                return ray.get(getattr(coordinator, method).remote(*args))
            except ray.exceptions.RayTaskError as e:      # before RayActorError: a stage's death inside it is one
                raise unwrap(e) from None
            except ray.exceptions.RayActorError:
                self._recover(coordinator)

    async def _acall(self, method: str, *args):
        while True:
            coordinator = self.coordinator
            try:
                result = await getattr(coordinator, method).remote(*args)
            except ray.exceptions.RayTaskError as e:
                raise unwrap(e) from None
            except ray.exceptions.RayActorError:
                await self._recover_async(coordinator)
                continue
            if self.coordinator is coordinator:
                return result
            # answered by a coordinator replaced meanwhile, whose hand-over lacked this (a sequence it queued): again

    def _opened(self, seq_id, request_id, request: dict, defaults: dict | None, collect: bool):
        if isinstance(seq_id, int):
            self.open[seq_id] = OpenSequence(request_id, request, defaults, collect)
            self.next_seq_id = max(self.next_seq_id, seq_id + 1)

    # ---- requests ----------------------------------------------------------------------------------
    def submit(self, request_id, request: dict, defaults: dict | None = None) -> int:
        """Queue a request; returns its sequence id. A bad request raises RequestError."""
        seq_id = self._call("submit", request_id, request, defaults)
        self._opened(seq_id, request_id, request, defaults, True)
        return seq_id

    def submit_many(self, requests: list, defaults: dict | None = None) -> list:
        outcomes = self._call("submit_many", requests, defaults)
        for (request_id, request), seq_id in zip(requests, outcomes):
            self._opened(seq_id, request_id, request, defaults, True)
        return outcomes

    def wait_finished(self, timeout: float = 1.0) -> list[tuple[int, dict]]:
        finished = self._call("wait_finished", timeout)
        for seq_id, _ in finished:
            self.open.pop(seq_id, None)
        return finished

    async def stream(self, seq_id: int):
        """Async iterator of updates; the last carries "finished" (the full result). Should the coordinator
        die, the updates go on from its replacement, which continues from the tokens given here."""
        finished = False
        try:
            while not finished:
                coordinator = self.coordinator
                try:
                    async for ref in coordinator.stream.remote(seq_id):
                        update = await ref
                        if self.coordinator is not coordinator:
                            break     # replaced meanwhile: the new one goes on from what was given before
                        self._delivered(seq_id, update)
                        finished = "finished" in update
                        yield update
                    else:
                        if not finished:    # never silently: a reader would take a cut stream for a whole one
                            raise RaymoeError(f"the stream of sequence {seq_id} ended without its result")
                        return
                except ray.exceptions.RayTaskError as e:
                    raise unwrap(e) from None
                except ray.exceptions.RayActorError:
                    await self._recover_async(coordinator)
                if self._recovering is not None:      # the new coordinator has this sequence once it is done
                    await asyncio.shield(self._recovering)
        finally:
            if not finished:        # the reader went away: the coordinator drops the sequence too
                self.open.pop(seq_id, None)

    def _delivered(self, seq_id: int, update: dict):
        s = self.open.get(seq_id)
        if s is None:
            return
        if "finished" in update:
            del self.open[seq_id]
            return
        s.token_ids.extend(update["token_ids"])
        if update["logprobs"] is not None:
            s.logprobs = (s.logprobs or []) + update["logprobs"]
        s.text_chars += len(update["text_delta"])

    def cancel(self, seq_id: int):
        self.open.pop(seq_id, None)
        self.coordinator.cancel.remote(seq_id)

    def stats(self) -> dict:
        return {**self._call("pipeline_stats"), "coordinator_restarts": self.restarts}

    # ---- async API for servers (never blocks the caller's event loop) -------------------------
    async def submit_async(self, request_id, request: dict, defaults: dict | None = None) -> int:
        """Queue a request whose result is only read through stream(); raises RequestError for a bad
        request and QueueFullError when the bounded queue (max_queued) is full."""
        seq_id = await self._acall("submit", request_id, request, defaults, False)
        self._opened(seq_id, request_id, request, defaults, False)
        return seq_id

    async def stats_async(self) -> dict:
        """stats(), for servers."""
        return {**await self._acall("pipeline_stats"), "coordinator_restarts": self.restarts}

    async def check_health_async(self):
        """Raise RaymoeError when the engine cannot make progress (see Coordinator.check_health)."""
        await self._acall("check_health")

    async def load_async(self) -> dict:
        """{"running", "waiting", "queued", "slots", "max_queued", ...}: see Coordinator.load."""
        return await self._acall("load")

    def shutdown(self, timeout: float = 60):
        """Stop the pipeline's actors, then the coordinator (idempotent)."""
        self.failed = self.failed or "the engine was shut down"
        try:
            ray.get(self.coordinator.shutdown.remote(), timeout=timeout)
        except Exception:
            pass
        self._kill(self.coordinator)

    async def shutdown_async(self, timeout: float = 3):
        """shutdown() for a server's event loop: waits up to timeout for the pipeline's actors to stop."""
        self.failed = self.failed or "the engine was shut down"
        try:
            await asyncio.wait_for(self.coordinator.shutdown.remote(), timeout)
        except Exception:       # timed out, or gone: killing the coordinator ends its actors with it
            pass
        self._kill(self.coordinator)

    @staticmethod
    def _kill(coordinator):
        try:
            ray.kill(coordinator, no_restart=True)
        except Exception:
            pass
