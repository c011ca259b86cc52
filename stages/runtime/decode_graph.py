"""A stage's decode steps replayed as CUDA graphs: the host launches a whole step's layers with one call
instead of a thousand or more kernels one by one (docs/compiled-step.md, "CUDA graphs").

A graph holds the addresses it was captured with, so a step replays one only where every tensor it reads
or writes is where it was: the same sequences in the same order, each KV cache's storage not grown or
moved, the DeltaNet caches in the same stack. The host part of each layer (`graph_state`: a row more in
each KV cache, the DeltaNet stack) runs every step; what changes from step to step goes in by value into
the graph's own input tensors: the hidden states, the positions, and the cache row each sequence writes.
Attention reads each cache's whole storage; rows not filled yet hold EMPTY_POSITION (stages/layers/cache.py),
which causality masks.

The first step of each batch size runs the same code eagerly (Triton compiles its kernels then, which a
capture must not do); after that, a step whose key has no graph yet is captured (which records, computing
nothing), then replayed.

RAYMOE_CUDA_GRAPHS=0 turns the graphs off (every step eager, as vLLM's --enforce-eager; kernels/gpu_ops.py).
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

log = logging.getLogger(__name__)

KEEP = 4        # graphs kept per stage (most recently used); each holds its step's activations
FAILURES = 3    # captures that may fail before a stage stops trying


def _addresses(state) -> list:
    """(address, shape) of every tensor in a nest of tuples and lists."""
    if isinstance(state, torch.Tensor):
        return [(state.data_ptr(), tuple(state.shape))]
    if isinstance(state, (tuple, list)):
        return [a for item in state for a in _addresses(item)]
    return []


class _Step:
    """One batch shape's static inputs (hidden states, positions, cache rows), and its graph once captured."""

    def __init__(self, x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor):
        self.x, self.positions, self.rows = x.clone(), positions.clone(), rows.clone()
        self.graph = self.out = None

    def load(self, x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        self.x.copy_(x)
        self.positions.copy_(positions)
        self.rows.copy_(rows)

    def body(self, layers, states) -> torch.Tensor:
        """The layers' decode, from this step's input tensors: what a graph records."""
        memo, at, x = {}, 0, self.x
        for layer, (storage, rows) in zip(layers, states):
            inputs = layer.mixer.graph_inputs(storage, self.rows[at:at + len(rows)], self.positions, memo)
            at += len(rows)
            x = layer.decode(x, inputs)
        return x


class DecodeGraphs:
    """The decode steps of a stage's layers, replayed as CUDA graphs."""

    def __init__(self, layers: list):
        self.layers = layers
        self.steps: OrderedDict = OrderedDict()
        self.warm: set[int] = set()             # batch sizes run eagerly once: their kernels are compiled
        self.pool = None
        self.captured = self.replayed = 0       # counts, for the GPU check's report
        self.failures = 0                       # captures that failed: after FAILURES, every step is eager

    def usable(self, n: int) -> bool:
        """Whether a step of n sequences can run so: nothing in it reads tensors on the host."""
        return self.failures < FAILURES and all(layer.ffn.host_free(n) for layer in self.layers)

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor:
        states = [layer.mixer.graph_state(ctx, layer.index) for layer in self.layers]
        rows = torch.tensor([r for _, step_rows in states for r in step_rows], dtype=torch.long).to(x.device)
        n = x.shape[0]
        key = (n, tuple(_addresses([storage for storage, _ in states])))
        step = self.steps.get(key)
        if step is None and n in self.warm:
            step = self._capture(key, _Step(x, ctx.positions, rows), states)
        if step is not None:
            self.steps.move_to_end(key)
            step.load(x, ctx.positions, rows)
            step.graph.replay()
            self.replayed += 1
            out = step.out.clone()      # the next replay overwrites step.out
        else:       # the first step of its size (it compiles the kernels a capture must find ready)
            out = _Step(x, ctx.positions, rows).body(self.layers, states)
            self.warm.add(n)
        for layer in self.layers:
            layer.mixer.decode_done(ctx, layer.index)
        return out

    def _capture(self, key, step: _Step, states) -> _Step | None:
        """Records the step as a graph (computing nothing), or None if that fails: the step then runs
        eagerly, as the next of its size does (a kernel the capture met uncompiled is compiled then)."""
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()      # one memory pool for the stage's graphs
            graph = torch.cuda.CUDAGraph()
            # thread_local: what other threads of an actor do on the GPU meanwhile does not break the capture
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                step.out = step.body(self.layers, states)
        except RuntimeError as e:
            self.failures += 1
            self.warm.discard(key[0])
            log.warning("capturing a decode step as a CUDA graph failed (%d of %d tries): %s", self.failures,
                        FAILURES, e)
            return None
        step.graph = graph
        self.steps[key] = step
        self.captured += 1
        while len(self.steps) > KEEP:
            self.steps.popitem(last=False)
        return step
