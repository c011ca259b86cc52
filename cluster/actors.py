"""Ray actors that hold weights: one per pipeline stage, and optional expert actors.

A stage actor owns one GPU (or one CPU slot) and a `Stage`: its layers, their caches, and
nothing of the other stages' weights. Expert actors hold a slice of the routed experts of
every layer of one stage.
"""
from __future__ import annotations

import os
import resource
import time

import ray
import torch

from raymoe.kernels.allocator import keep_freed_memory
from raymoe.kernels.threads import loading_threads, node_cores, release_openmp_workers, share_of_cores
from raymoe.kernels.weights import rows_computed_alone
from raymoe.stages.errors import RaymoeError
from raymoe.stages.files.loader import open_model
from raymoe.stages.layers.moe import MoESpec
from raymoe.stages.runtime.engine import split_layers
from raymoe.stages.runtime.memory import GiB, prefix_shares, stage_need
from raymoe.stages.runtime.stage import Stage, StageWeights, check_device

from .chain import ChainLink
from .shm import SLOTS, Ring, unlink


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_gpu_memory(need: int, layers: range, max_running: int, share: float = 1.0):
    """Before a GPU stage reads a weight: its weights and caches against the device's free memory, and against its
    share of the device where actors share it (they check at once, before any of them has loaded)."""
    free, total = torch.cuda.mem_get_info()
    room = min(free, int(share * total))
    if need > room:
        shared = f" of the {share:g} of it this stage shares" if share < 1 else ""
        raise RaymoeError(f"layers {layers.start}-{layers.stop - 1} need {need / 2**30:.1f} GiB on their GPU "
                          f"(weights, caches for --max-running {max_running} and its share of the prefix cache), and "
                          f"it has {room / 2**30:.1f} GiB free{shared}; use more stages (--pp) or GPUs, a lower "
                          "--max-running, --max-model-len or --prefix-cache-gb")


class ExpertClient:
    """Stage-side view of its expert actors: every actor runs the experts it holds, the stage
    merges the (slot, row) pieces; kernels.moe.combine_slots makes the sum order fixed."""

    def __init__(self, actors):
        self.actors = actors

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor):
        # tensors cross processes through the host (the object store)
        parts = ray.get([a.run.remote(layer, x.cpu(), ids.cpu()) for a in self.actors])
        return (torch.cat([s for s, _ in parts]).to(x.device), torch.cat([r for _, r in parts]).to(x.device))


@ray.remote
class ExpertActor:
    def __init__(self, args, layers: tuple[int, int], experts: tuple[int, int]):
        """args: the pipeline's resolved EngineArgs."""
        self.init_error = None
        try:
            self._load(args, layers, experts)
        except RaymoeError as e:      # reported by ping(), as a clean one-line error
            self.init_error = e

    def _load(self, args, layers, experts):
        # the stage waits while its expert actors compute, side by side
        torch.set_num_threads(args.threads or share_of_cores(node_cores(), args.ep, args.ep))
        model = open_model(args.model, args.max_model_len)
        self.device, self.mode = torch.device(args.device), args.dtype
        with loading_threads(args.dtype):
            w = StageWeights(model, model.expected_shapes(range(*layers), False, False), args.dtype, device=args.device)
            specs = {i: model.family.layer_ffn(model.config, i) for i in range(*layers)}
            self.experts = {i: spec.load_experts(w, i, range(*experts)) for i, spec in specs.items()
                            if isinstance(spec, MoESpec)}
            w.finish()
        if self.device.type == "cpu":
            keep_freed_memory()

    @torch.inference_mode()
    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor):
        slots, rows = self.experts[layer](x.to(self.device), ids.to(self.device))
        return slots.cpu(), rows.cpu()

    def ping(self) -> int:
        if self.init_error is not None:
            raise self.init_error
        return os.getpid()

    def rows_computed_alone(self) -> int:
        return rows_computed_alone(self.mode, self.device.type)


@ray.remote(concurrency_groups={"progress": 1})
class StageActor:
    """Loads in load() rather than in the constructor, so that load_progress() (its own concurrency group)
    can answer while the weights are read."""

    def __init__(self, args, layers: tuple[int, int], expert_actors=None, stages_here: int = 1):
        """args: the pipeline's resolved EngineArgs; stages_here: the pipeline's stages on this node."""
        self.args, self.layers, self.expert_actors = args, range(*layers), expert_actors
        self.stages_here, self.cores = stages_here, node_cores()
        self.threads_used: set[int] = set()          # thread counts steps ran with (stats)
        self.busy_s = 0.0                            # seconds spent computing steps (stats)
        self.stage = self.group = None
        self.link = ChainLink()                     # shm transport: the rings to the other stages
        if stages_here > 1:     # the stage computing next uses these cores: no worker of this one may spin on them
            self.link.on_hand_over = release_openmp_workers
        self.loaded = (0, 0)

    def load(self) -> int:
        args = self.args
        torch.set_num_threads(args.threads or self.cores)
        model = open_model(args.model, args.max_model_len)
        mtp = args.mtp_head(model) if self.layers.stop == model.n_layers else None
        need = stage_need(model, self.layers, args.dtype, args.step_chunk, mtp)
        ranges = split_layers(model.n_layers, args.pp, args.split)
        need.prefix_bytes = prefix_shares(model, ranges, args.step_chunk,
                                          int((args.prefix_cache_gb or 0) * GiB))[ranges.index(self.layers)]
        total = need.weight_bytes
        if args.device == "cuda":
            try:        # this process's GPU, before anything asks it for memory
                check_device(args.device, args.dtype)
            except ValueError as e:
                raise RaymoeError(f"layers {self.layers.start}-{self.layers.stop - 1}: {e}") from None
            share = ray.get_runtime_context().get_assigned_resources().get("GPU", 1.0)    # < 1: a shared GPU
            check_gpu_memory(need.total(args.max_running), self.layers, args.max_running, min(share, 1.0))
        self.loaded = (0, total)
        remote = ExpertClient(self.expert_actors) if self.expert_actors else None
        self.stage = Stage(model, self.layers, args.dtype, remote_experts=remote, device=args.device,
                           progress=lambda done: setattr(self, "loaded", (done, total)), mtp=mtp)
        self.hidden_size = model.config.hidden
        return os.getpid()

    @ray.method(concurrency_group="progress")
    def load_progress(self) -> tuple[int, int]:
        """(bytes of weights read, bytes to read)."""
        return self.loaded

    def _take_threads(self, batch):
        """Without --threads: this step's share of the node's cores (outputs do not depend on it)."""
        if self.args.threads is None:
            work = batch.n_tokens * self.stage.parameter_bytes()
            threads = share_of_cores(self.cores, self.stages_here, batch.computing, work)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        self.threads_used.add(torch.get_num_threads())

    def _forward(self, batch, hidden):
        start, waited = time.perf_counter(), self.link.waited_s
        try:
            return self.stage.forward(batch, hidden)
        finally:
            if self.stages_here > 1:    # the next stage computes on these cores: no worker may spin on
                release_openmp_workers()
            # a chain of steps (cluster/chain.py) also waits for the other stages within the call
            self.busy_s += time.perf_counter() - start - (self.link.waited_s - waited)

    def forward(self, batch, hidden=None):
        """Object-store transport: the previous stage's output arrives as this call's argument (through
        the host, from a GPU stage)."""
        self._take_threads(batch)
        out = self._forward(batch, hidden)
        return out.cpu() if isinstance(out, torch.Tensor) else out

    def fail_next_forward(self):
        """Test hook (fault injection): the next forward raises MemoryError, as an allocation that does
        not fit does."""
        forward = self.stage.forward

        def out_of_memory(*args):
            self.stage.forward = forward
            raise MemoryError("injected: out of memory")
        self.stage.forward = out_of_memory

    # torch.distributed point-to-point transport (gloo on CPU)
    def rendezvous_address(self) -> str:
        import socket
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def join_group(self, address: str, rank: int, world: int, backend: str = "gloo"):
        """gloo moves host tensors (a GPU stage's output is staged through the host), nccl device tensors."""
        import datetime

        import torch.distributed as dist
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        self.group = (rank, world)
        self.wire = self.stage.device if backend == "nccl" else torch.device("cpu")

    def forward_p2p(self, batch):
        """Receive hidden states from the previous rank, run the layers, send to the next; the last
        stage returns the logits. Tensors travel as raw bytes, whatever the dtype."""
        import torch.distributed as dist
        rank, world = self.group
        hidden = None
        self._take_threads(batch)
        if rank > 0:
            buf = torch.empty(batch.n_tokens, self.hidden_size, device=self.wire)
            dist.recv(buf.view(torch.uint8), src=rank - 1)
            hidden = buf
        out = self._forward(batch, hidden)
        if rank < world - 1:
            dist.send(out.to(self.wire).contiguous().view(torch.uint8), dst=rank + 1)
            return None
        return out

    # shared-memory ring transport (stages on one node; cluster/shm.py, cluster/chain.py)
    def shm_create(self, path: str, max_tokens: int, back_slots: int = 0) -> int:
        """The ring from the previous stage, sized for max_tokens activations; or with back_slots, the first
        stage's ring from the last, for the tokens of up to max_tokens chunks a step. Returns its slot bytes."""
        if back_slots:
            slot_bytes = max_tokens * 3 * 8         # (sequence, position, token) int64s
            self.link.back = Ring.create(path, back_slots, slot_bytes)
        else:
            slot_bytes = max_tokens * self.hidden_size * 4
            self.link.ring_in = Ring.create(path, SLOTS, slot_bytes)
        return slot_bytes

    def shm_attach(self, path: str, slot_bytes: int, back_slots: int = 0):
        """The ring to the next stage (or with back_slots, the last stage's ring to the first), which created it."""
        if back_slots:
            self.link.back = Ring.attach(path, back_slots, slot_bytes)
        else:
            self.link.ring_out = Ring.attach(path, SLOTS, slot_bytes)

    def shm_unlink(self, path: str):
        unlink(path)

    def shm_close(self):
        self.link.close()
        if self.stage is not None:
            self.stage.link = None

    def shm_chain(self):
        """Every ring is there: the stage may run chains of decode steps (StepBatch.follow) over them."""
        self.stage.link = self.link
        self.link.holds = self.stage.caches.__contains__

    def forward_shm(self, batch):
        """The stage's call over the shm rings (cluster/chain.py ChainLink.forward); the last stage returns the
        sampled tokens."""
        self._take_threads(batch)
        return self.link.forward(batch, self._forward)

    def release(self, seq_ids: list[int]):
        for sid in seq_ids:
            self.stage.release(sid)

    def reset(self):
        self.stage.reset()

    def stats(self) -> dict:
        return {"layers": [self.stage.layers_range.start, self.stage.layers_range.stop],
                "parameter_bytes": self.stage.parameter_bytes(), "peak_rss_bytes": peak_rss_bytes(),
                "peak_cache_bytes": self.stage.peak_cache_bytes, "prefix_cache_bytes": self.stage.prefix.bytes,
                "threads_used": sorted(self.threads_used), "busy_s": self.busy_s,
                "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def ping(self) -> int:
        return os.getpid()

    def rows_computed_alone(self) -> int:
        return rows_computed_alone(self.args.dtype, self.args.device)
