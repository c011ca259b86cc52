"""The coordinator in this process (no Ray) over a one-stage pipeline of the whole model: the engine-fault tests'
rig, which the memory, prefix-cache and sampling tests share."""
import asyncio
from types import SimpleNamespace

from raymoe.cluster.coordinator import Coordinator
from raymoe.cluster.engine_args import EngineArgs
from raymoe.cluster.pipeline import PipelineSpec
from raymoe.stages.runtime.stage import Stage


class LocalPipeline:
    """Coordinator's view of a pipeline: one in-process stage; `hang` makes every step never finish,
    `fail_for` makes submit raise for a batch holding that sequence id."""

    def __init__(self, model, hang=False, fail_for=None):
        self.stage = Stage(model, range(model.n_layers))
        self.spec = SimpleNamespace(pp=1)
        self.rows_computed_alone, self.concurrent_steps = 8, 1     # decode steps of up to 8 sequences merged
        self.chains, self.transport = True, "object_store"         # one stage: a lone sequence's steps sent ahead
        self.hang, self.fail_for = hang, fail_for

    def submit(self, batch):
        if self.fail_for in batch.seq_ids:
            raise RuntimeError("injected submit failure")
        step = asyncio.get_running_loop().create_future()
        if not self.hang:
            step.set_result(self.stage.forward(batch, None))
        return [step]

    def release(self, seq_ids):
        for sid in seq_ids:
            self.stage.release(sid)


def coordinator(model, **pipeline):
    args = EngineArgs(model.path, stall_timeout=0.5, max_running=64).resolved()
    coord = Coordinator.__ray_metadata__.modified_class(PipelineSpec(args, model.n_layers, model.config.n_expert))
    coord.pipeline = LocalPipeline(model, **pipeline)
    return coord


async def results_of(coord, requests: dict) -> dict:
    """request id -> result of each request, submitted together."""
    ids = {await coord.submit(rid, req): rid for rid, req in requests.items()}
    out = {}
    while len(out) < len(ids):
        for sid, result in await coord.wait_finished(timeout=10):
            out[ids[sid]] = result
    return out
