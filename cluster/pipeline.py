"""The pipeline: stage actors (and expert actors) placed in a placement group, and the
transport that moves activations between stages.

Transports (outputs never depend on the choice):
- `object_store`: each stage call takes the previous stage's result ObjectRef as its argument;
  Ray moves the tensor through its object store (shared memory on one node, works across nodes).
- `gloo`: stages exchange activations with torch.distributed send/recv over a gloo group; the
  coordinator only sends each stage the batch description.
"""
from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kernels.native import blas_has_own_threads
from stages.engine import split_layers

from .actors import ExpertActor, StageActor

TRANSPORTS = ("object_store", "gloo")
# pack: as few nodes as possible; spread: each bundle on a different node while there are nodes (best effort)
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD"}


@dataclass
class PipelineSpec:
    model_path: str
    n_layers: int
    n_experts: int
    pp: int = 1
    ep: int = 0                      # expert actors per stage (0: experts in the stage)
    dtype: str = "auto"
    transport: str = "object_store"
    placement: str = "pack"          # a key of PLACEMENTS
    threads: int = 1                 # torch threads per actor
    split: list[int] | None = None   # layers per stage; even split when None
    use_gpu: bool = False
    max_model_len: int | None = None
    name: str | None = None                  # stage actors are named NAME-stageI (progress bars find them)
    stage_memory: list[int] | None = None   # bytes each stage's bundle asks Ray for (stages/memory.py)
    cache_budget: list[int] | None = None   # of which bytes of cache for running sequences (admission by memory)

    def validate(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r} (choose from {', '.join(TRANSPORTS)})")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r} (choose from {', '.join(PLACEMENTS)})")
        if self.ep < 0 or (self.ep and self.n_experts % self.ep):
            raise ValueError(f"--ep {self.ep} must divide the model's {self.n_experts} experts")
        split_layers(self.n_layers, self.pp, self.split)


class Pipeline:
    def __init__(self, spec: PipelineSpec):
        spec.validate()
        self.spec = spec
        self.ranges = split_layers(spec.n_layers, spec.pp, spec.split)
        resource = {"GPU": 1} if spec.use_gpu else {"CPU": 1}
        memory = spec.stage_memory or [0] * spec.pp
        # stage bundles first (the stage's whole need: its experts' actors are small beside it), then experts
        bundles = [{**resource, **({"memory": m} if m else {})} for m in memory] + [resource] * (spec.pp * spec.ep)
        self.pg = placement_group(bundles, strategy=PLACEMENTS[spec.placement])
        ray.get(self.pg.ready(), timeout=120)
        self.stages: list = [None] * spec.pp
        self.experts: list[list] = [[] for _ in range(spec.pp)]
        self.loading: dict[int, object] = {}            # stage -> its load() ref, while it loads
        for i in range(spec.pp):
            self._start_stage(i, spec.name and f"{spec.name}-stage{i}")
        self._connect()

    def _options(self, bundle: int) -> dict:
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle)
        env = {"OPENBLAS_NUM_THREADS": str(self.spec.threads)}
        if self.spec.dtype != "int8" and blas_has_own_threads():
            # only an environment variable set before the process loads torch can say so
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        opts = {"scheduling_strategy": strategy, "max_concurrency": 1, "runtime_env": {"env_vars": env}}
        if self.spec.use_gpu:
            opts["num_gpus"] = 1
        else:
            opts["num_cpus"] = 1
        return opts

    def _start_stage(self, i: int, name: str | None = None):
        s, r = self.spec, self.ranges[i]
        layers = (r.start, r.stop)
        experts = []
        if s.ep:
            per = s.n_experts // s.ep
            experts = [ExpertActor.options(**self._options(s.pp + i * s.ep + j)).remote(
                s.model_path, layers, (j * per, (j + 1) * per), s.dtype, s.threads, s.max_model_len)
                for j in range(s.ep)]
        self.experts[i] = experts
        options = {**self._options(i), **({"name": name} if name else {})}
        self.stages[i] = StageActor.options(**options).remote(s.model_path, layers, s.dtype, s.threads,
                                                             s.max_model_len, experts or None)
        self.loading[i] = self.stages[i].load.remote()

    def _connect(self):
        """Wait for every actor to load; join the process group for the gloo transport."""
        ray.get(list(self.loading.values()) + [e.ping.remote() for ex in self.experts for e in ex])
        self.loading.clear()
        if self.spec.transport == "gloo":
            address = ray.get(self.stages[0].rendezvous_address.remote())
            ray.get([a.join_group.remote(address, rank, len(self.stages)) for rank, a in enumerate(self.stages)])

    def submit(self, batch) -> list:
        """Start one micro-batch; returns the step's ObjectRefs, the last of which holds the logits."""
        if self.spec.transport == "gloo":
            return [a.forward_p2p.remote(batch) for a in self.stages]
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
        every stage's caches; the caller recomputes the sequences in flight."""
        if self.spec.transport == "gloo":     # survivors may be blocked in recv: replace them all
            dead = list(range(len(self.stages)))
        else:
            dead = [i for i, a in enumerate(self.stages) if not self._alive([a] + self.experts[i])]
        for i in dead:
            self._kill(i)
        for i in dead:
            self._start_stage(i)
        self._connect()
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
