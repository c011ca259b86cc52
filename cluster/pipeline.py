"""The pipeline: stage actors (and expert actors) placed in a placement group, and the
transport that moves activations between stages.

Transports (outputs never depend on the choice):
- `object_store`: each stage call takes the previous stage's result ObjectRef as its argument;
  Ray moves the tensor through its object store (shared memory on one node, works across nodes).
- `gloo`: stages exchange activations with torch.distributed send/recv over a gloo group; the
  coordinator only sends each stage the batch description. GPU stages stage through the host.
- `nccl` (GPU stages): the same send/recv over an NCCL group, device to device. torch.distributed
  rather than ray.util.collective: one code path with gloo, and no CuPy dependency.
- `shm`: stages on one node; each stage writes its activations into a ring of preallocated shared-memory
  slots that the next stage reads (cluster/shm.py); the coordinator only sends batch descriptions. A
  pipeline whose stages Ray placed on more than one node is refused with a one-line error, not run
  over another transport. One more ring carries the last stage's sampled tokens back to the first, so
  that decode steps chain through the stages without the coordinator (cluster/chain.py).
- `auto` (the default): `shm` where every stage of a CPU pipeline is on one node and its rings fit in
  /dev/shm, else `object_store`. `Pipeline.transport` is the one it chose.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import ray
from ray.util import get_placement_group, placement_group_table
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raymoe.kernels.threads import process_env
from raymoe.stages.runtime.engine import split_layers
from raymoe.stages.errors import RaymoeError, unwrap

from .actors import ExpertActor, StageActor
from .engine_args import PLACEMENTS, EngineArgs
from .shm import SHM_DIR

log = logging.getLogger(__name__)

RING_PREFIX = "raymoe-ring-"     # the shm transport's names in /dev/shm (there only while a pipeline connects)

P2P = ("gloo", "nccl")      # torch.distributed point-to-point transports


@dataclass
class PipelineSpec:
    """One pipeline: its settings (EngineArgs.resolved()) and what the model and the memory plan add."""
    args: EngineArgs
    n_layers: int
    n_experts: int
    name: str | None = None                  # stage actors are named NAME-stageI (progress bars find them)
    stage_memory: list[int] | None = None   # bytes each stage's bundle asks Ray for (stages/runtime/memory.py)
    cache_budget: list[int] | None = None   # of which bytes of cache for running sequences (admission by memory)
    gpu_share: float = 1.0                  # --device cuda: the part of a GPU each actor asks for (gpu_share)

    def ranges(self) -> list[range]:
        """Each stage's layers."""
        return split_layers(self.n_layers, self.args.pp, self.args.split)


def gpu_share(actors: int, gpus: int) -> float:
    """The part of a GPU each of a pipeline's `actors` (stages and expert actors) asks Ray for on a cluster of `gpus`
    GPUs: a whole one each where there are enough, else an equal part, so that as many actors share each GPU (Ray
    places fractional GPUs of one size on one device): PP=2 on one GPU is two stages of half a GPU each, which
    compute in turn on it."""
    return 1.0 if gpus >= actors else 1.0 / -(-actors // gpus)


def group_name(pipeline: str | None) -> str:
    return f"{pipeline}-pg" if pipeline else ""


PIPELINE_PREFIX = "raymoe-"          # a ClusterEngine's pipeline names: raymoe-<id>[-<coordinator restarts>]
COORDINATOR_NAMESPACE = "raymoe"     # every coordinator's name lives here, whichever job (or replica) made it


def coordinator_name(pipeline: str) -> str:
    return f"{pipeline}-coordinator"


def remove_orphaned_groups():
    """Remove the placement groups of pipelines whose coordinator is dead. Ray keeps a group until both the
    actor that made it (the coordinator) and that actor's job are gone: a Serve replica that dies takes its
    coordinator and stages with it, but their group would hold its CPUs for as long as the server's job
    lives, and the replica Serve starts in its place would find no room."""
    for info in placement_group_table().values():
        name = info.get("name") or ""
        if not (name.startswith(PIPELINE_PREFIX) and name.endswith("-pg")) or info.get("state") == "REMOVED":
            continue
        pipeline = name[:-len("-pg")]
        try:
            ray.get_actor(coordinator_name(pipeline), namespace=COORDINATOR_NAMESPACE)
        except ValueError:          # no live coordinator of that name
            remove_group(pipeline)


def remove_group(pipeline: str):
    """Remove the placement group of the pipeline named `pipeline`, if there is one. A dead coordinator's group
    can outlive it: when its node was lost, Ray even moves the bundles it had there onto the surviving nodes."""
    try:
        remove_placement_group(get_placement_group(group_name(pipeline)))
    except ValueError:      # no group of that name (any more)
        pass


ORPHAN_SWEEP_S = 2.0      # while a pipeline waits for room: how often dead pipelines' groups are looked for


class Pipeline:
    def __init__(self, spec: PipelineSpec):
        args = self.args = spec.args      # validated by the caller (ClusterEngine, deploy.perplexity)
        self.spec = spec
        self.ranges = spec.ranges()
        # a GPU actor is a process too: a CPU beside its GPU (or share of one)
        resource = {"CPU": 1, "GPU": spec.gpu_share} if args.device == "cuda" else {"CPU": 1}
        memory = spec.stage_memory or [0] * args.pp
        # stage bundles first (the stage's whole need: its experts' actors are small beside it), then experts
        bundles = [{**resource, **({"memory": m} if m else {})} for m in memory] + [resource] * (args.pp * args.ep)
        self.pg = placement_group(bundles, strategy=PLACEMENTS[args.placement], name=group_name(spec.name))
        try:
            self._wait_placed(time.monotonic() + args.placement_timeout)
        except RaymoeError:
            remove_placement_group(self.pg)
            raise
        if args.transport == "shm":
            self._check_one_node()
        nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        self.transport = args.transport
        self.fallback: str | None = None    # why `auto` left the transport it chose, for the driver to say
        if self.transport == "auto":
            one_node = len({nodes[i] for i in range(args.pp)}) == 1
            self.transport = "shm" if args.pp > 1 and args.device == "cpu" and one_node else "object_store"
        self.stages_here = [sum(nodes[j] == nodes[i] for j in range(args.pp)) for i in range(args.pp)]
        # decode steps worth computing at once: one per node, since the stages on a node share its memory
        # bandwidth (a decode step reads weights at about its rate): reading them once for more sequences gains
        # more than overlapping steps there
        self.concurrent_steps = len({nodes[i] for i in range(args.pp)})
        self.stages: list = [None] * args.pp
        self.experts: list[list] = [[] for _ in range(args.pp)]
        self.loading: dict[int, object] = {}            # stage -> its load() ref, while it loads
        for i in range(args.pp):
            self._start_stage(i, spec.name and f"{spec.name}-stage{i}")
        self._connect()

    def _wait_placed(self, deadline: float):
        """Until Ray has placed every bundle (again, after a node with some of them was lost); RaymoeError at
        the deadline."""
        ready = self.pg.ready()
        try:
            while True:
                try:
                    ray.get(ready, timeout=min(ORPHAN_SWEEP_S, max(0.0, deadline - time.monotonic())))
                    return
                except ray.exceptions.GetTimeoutError:
                    if time.monotonic() >= deadline:
                        raise
                    remove_orphaned_groups()     # a dead pipeline's group may be what holds the room
        except ray.exceptions.GetTimeoutError:
            slot = "GPU" if self.args.device == "cuda" else "CPU"
            raise RaymoeError(f"the Ray cluster had no room for the pipeline's {self.pg.bundle_count} actors (a {slot} "
                              f"and its memory each) within {self.args.placement_timeout:g} s; add nodes, use fewer "
                              f"stages (--pp, --ep) or wait longer (--placement-timeout)") from None

    def _check_one_node(self):
        nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        n = len({nodes[i] for i in range(self.args.pp)})
        if n > 1:
            remove_placement_group(self.pg)
            raise RaymoeError(f"--transport shm needs every stage on one node, and Ray placed the {self.args.pp} "
                              f"stages on {n} nodes: use --transport gloo across nodes (or --placement pack with "
                              f"{self.args.pp} free CPUs on one node)")

    def _options(self, bundle: int) -> dict:
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle)
        env = process_env(self.args.threads, self.args.dtype)
        opts = {"scheduling_strategy": strategy, "max_concurrency": 1, "runtime_env": {"env_vars": env}, "num_cpus": 1}
        if self.args.device == "cuda":
            opts["num_gpus"] = self.spec.gpu_share
        return opts

    def _start_stage(self, i: int, name: str | None = None):
        a, r = self.args, self.ranges[i]
        layers = (r.start, r.stop)
        experts = []
        if a.ep:
            per = self.spec.n_experts // a.ep
            experts = [ExpertActor.options(**self._options(a.pp + i * a.ep + j)).remote(
                a, layers, (j * per, (j + 1) * per)) for j in range(a.ep)]
        self.experts[i] = experts
        options = {**self._options(i), **({"name": name} if name else {})}
        self.stages[i] = StageActor.options(**options).remote(a, layers, experts or None, self.stages_here[i])
        self.loading[i] = self.stages[i].load.remote()

    def _connect(self, timeout: float | None = None):
        """Wait for every actor to load; join the process group for the gloo transport, make the rings for shm."""
        ray.get(list(self.loading.values()) + [e.ping.remote() for ex in self.experts for e in ex], timeout=timeout)
        self.loading.clear()
        # up to how many sequences one decode step may carry with the bits each gets alone, on every actor
        self.rows_computed_alone = min(ray.get([a.rows_computed_alone.remote()
                                                for a in self.stages + [e for ex in self.experts for e in ex]]))
        if self.transport in P2P:
            address = ray.get(self.stages[0].rendezvous_address.remote())
            ray.get([a.join_group.remote(address, rank, len(self.stages), self.transport)
                     for rank, a in enumerate(self.stages)])
        if self.transport == "shm":
            try:
                self._connect_rings()
            except Exception as e:      # no /dev/shm, or no room in it: `auto` moves activations through Ray
                cause = unwrap(e)
                if self.args.transport != "auto" or not isinstance(cause, RaymoeError):
                    raise
                self.fallback = f"the shm transport cannot start ({cause}); activations go through the object store"
                log.warning(self.fallback)
                ray.get([a.shm_close.remote() for a in self.stages])
                self.transport = "object_store"

    @property
    def chains(self) -> bool:
        """Whether decode steps can run several to a call (StepBatch.follow): the stage that
        samples embeds the next token itself, or passes it back to the one that does (cluster/chain.py)."""
        return len(self.stages) == 1 or self.transport == "shm"

    def _connect_rings(self):
        """A fresh ring per edge (after a restart too), and one from the last stage back to the first for its
        sampled tokens: the receiving stage creates it, the sending stage opens and unlinks it (cluster/shm.py),
        so nothing is left in /dev/shm however the stages end."""
        ray.get([a.shm_close.remote() for a in self.stages])
        prefix = f"{SHM_DIR}/{RING_PREFIX}{uuid.uuid4().hex[:8]}"
        n = len(self.stages)
        # (sender, receiver, path, slots of the ring back: 0 for activations); the first stage reads the ring back
        # at every call, so it holds at most a message per step in flight past it
        back_slots = (self.args.microbatches or n) + 2
        edges = [(self.stages[i], self.stages[i + 1], f"{prefix}-{i}", 0) for i in range(n - 1)]
        edges.append((self.stages[-1], self.stages[0], f"{prefix}-back", back_slots))
        try:
            sizes = ray.get([b.shm_create.remote(path, self.args.max_batch_tokens, slots)
                             for _, b, path, slots in edges])
            ray.get([a.shm_attach.remote(path, size, slots) for (a, _, path, slots), size in zip(edges, sizes)])
        finally:    # names a failed setup left (a no-op after a good one)
            refs = [b.shm_unlink.remote(path) for _, b, path, _ in edges]
            ray.wait(refs, num_returns=len(refs), timeout=30)
        ray.get([a.shm_chain.remote() for a in self.stages])

    def submit(self, batch) -> list:
        """Start one micro-batch; returns the step's ObjectRefs, the last of which holds the logits.
        batch.computing: the micro-batches in flight with it (the stages size their threads by it)."""
        if self.transport in P2P:
            return [a.forward_p2p.remote(batch) for a in self.stages]
        if self.transport == "shm":
            return [a.forward_shm.remote(batch) for a in self.stages]
        refs, ref = [], None
        for a in self.stages:
            ref = a.forward.remote(batch, ref)
            refs.append(ref)
        return refs

    def release(self, seq_ids: list[int]):
        for a in self.stages:
            a.release.remote(seq_ids)

    def restart(self):
        """Replace dead actors (all of them for gloo, whose group cannot lose a member) and clear
        every stage's caches; the caller recomputes the sequences in flight. With shm a survivor is never
        stuck: a ring whose other end died reads EOF, so its pending steps fail at once; every ring is then
        made anew. Actors lost with their node go where Ray places their bundles again (another node with
        room); until then the new actors die or wait, and it tries again, for at most placement_timeout: then
        RaymoeError."""
        deadline = time.monotonic() + self.args.placement_timeout
        while True:
            try:
                return self._restart_once(deadline)
            except ray.exceptions.RayError as e:
                if time.monotonic() >= deadline:
                    raise RaymoeError(f"the pipeline's actors could not be started again within "
                                      f"{self.args.placement_timeout:g} s ({type(e).__name__}: "
                                      f"{str(e).strip().splitlines()[0]})") from None
                time.sleep(1)

    def _restart_once(self, deadline: float) -> list[int]:
        if self.transport in P2P:     # survivors may be blocked in recv: replace them all
            dead = list(range(len(self.stages)))
        else:
            dead = [i for i, a in enumerate(self.stages) if not self._alive([a] + self.experts[i])]
        for i in dead:
            self._kill(i)
        self._wait_placed(deadline)
        for i in dead:
            self._start_stage(i)
        self._connect(timeout=max(1.0, deadline - time.monotonic()))
        ray.get([a.reset.remote() for a in self.stages])
        return dead

    @staticmethod
    def _alive(actors) -> bool:
        try:
            ray.get([a.ping.remote() for a in actors], timeout=30)
            return True
        except Exception:
            return False

    def _kill(self, i: int):
        for a in [self.stages[i]] + self.experts[i]:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass

    def stats(self) -> list[dict]:
        return ray.get([a.stats.remote() for a in self.stages])

    def shutdown(self):
        for i in range(len(self.stages)):
            self._kill(i)
        remove_placement_group(self.pg)
