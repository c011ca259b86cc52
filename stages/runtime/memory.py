"""What a stage needs in memory, computed from the model's files before any weight is read.

A stage holds its tensors as the file stores them (auto and float32 modes; values such as norms
and biases as float32), or as int8 rows (int8 mode), plus one cache per running sequence, each
at most a full context of keys and values for attention layers and the DeltaNet state for the
others (see docs/memory.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raymoe.stages.families.contract import global_tensor_shapes
from raymoe.stages.files.loader import ModelFiles, mtp_shapes
from raymoe.stages.layers.cache import KVCache

RUNTIME_BYTES = 768 << 20     # interpreter, torch, the kernels' buffers and one step's activations
GiB = 1 << 30
MiB = 1 << 20


@dataclass
class StageNeed:
    layers: range
    weight_bytes: int
    cache_bytes_per_sequence: int
    prefix_bytes: int = 0           # the most this stage holds of the prefix cache (prefix_shares)

    def total(self, max_running: int) -> int:
        return self.weight_bytes + max_running * self.cache_bytes_per_sequence + self.prefix_bytes + RUNTIME_BYTES


def _tensor_bytes(model: ModelFiles, name: str, shape: tuple, mode: str) -> int:
    n = int(np.prod(shape, dtype=np.int64))
    if len(shape) < 2:
        return 4 * n                                   # values are held as float32
    if mode == "int8":
        return n + 4 * n // shape[-1]                  # int8 rows and a scale each
    return model.source.stored_bytes(name, shape)


def stage_need(model: ModelFiles, layers: range, mode: str, chunk: int = 512,
               mtp: ModelFiles | None = None) -> StageNeed:
    """chunk: the most tokens of one sequence a step holds (min of --prefill-chunk, --max-batch-tokens). mtp: the
    files of the MTP head the last stage runs (stages/runtime/mtp.py), with the embedding it then holds too."""
    first, last = layers.start == 0, layers.stop == model.n_layers
    shapes = model.expected_shapes(layers, first, last)
    weights = sum(_tensor_bytes(model, name, shape, mode) for name, shape in shapes.items())
    caches = sum(model.family.layer_cache_bytes(model.config, i, chunk=chunk) for i in layers)   # a full context each
    if mtp is not None and last:
        weights += sum(_tensor_bytes(mtp, name, shape, mode) for name, shape in mtp_shapes(mtp).items())
        if "token_embd.weight" not in shapes:
            weights += _tensor_bytes(model, "token_embd.weight",
                                     global_tensor_shapes(model.config)["token_embd.weight"], mode)
        caches += mtp_cache_bytes(model, chunk=chunk)
    return StageNeed(layers, weights, caches)


def mtp_cache_bytes(model: ModelFiles, length: int | None = None, chunk: int = 512) -> int:
    """One sequence's cache of the MTP head (a full-attention layer's): for a full context, or for a sequence never
    longer than `length`."""
    cfg = model.config
    positions = cfg.context_length if length is None else KVCache.capacity_bound(length, cfg.context_length)
    mixer = model.family.mtp_mixer
    return 0 if mixer is None else mixer(cfg).cache_bytes(positions, chunk)


def prefix_block_bytes(model: ModelFiles, layers: range, block: int) -> tuple[int, int]:
    """(keys and values of one block of `block` tokens, one snapshot at a block's end) that the prefix cache
    keeps for these layers (stages/prefix/store.py)."""
    parts = [model.family.layer_prefix_bytes(model.config, i, block) for i in layers]
    return sum(kv for kv, _ in parts), sum(snap for _, snap in parts)


def prefix_shares(model: ModelFiles, ranges: list[range], block: int, budget: int) -> list[int]:
    """The most each stage holds of a prefix cache of `budget` bytes over the whole model: its share of the
    keys and values or of the snapshots, whichever is larger (the cache may hold only one kind)."""
    whole = prefix_block_bytes(model, range(model.n_layers), block)
    shares = []
    for r in ranges:
        part = prefix_block_bytes(model, r, block)
        shares.append(int(budget * max(p / w if w else 0.0 for p, w in zip(part, whole))))
    return shares


class CacheBudget:
    """Admission by memory: the bytes of cache each stage has for its running sequences, and what each
    sequence may come to hold there, from its own bound (prompt + max_tokens, at most the context)
    rather than a full context. The engine admits a sequence only while every stage has room for it,
    so a stage never holds more cache than its placement reserved (cluster.engine.plan_memory)."""

    def __init__(self, model: ModelFiles, ranges: list[range], budget: list[int], chunk: int = 512,
                 mtp: bool = False):
        """mtp: the last stage runs the model's MTP head (a cache of its own per sequence)."""
        self.model, self.ranges, self.chunk, self.mtp = model, ranges, chunk, mtp
        self.budget, self.used = list(budget), [0] * len(budget)

    def need(self, length: int) -> tuple[int, ...]:
        """Bytes per stage for a sequence that never holds more than `length` positions."""
        family, cfg = self.model.family, self.model.config
        need = [sum(family.layer_cache_bytes(cfg, i, length, self.chunk) for i in r) for r in self.ranges]
        if self.mtp:
            need[-1] += mtp_cache_bytes(self.model, length, self.chunk)
        return tuple(need)

    def fits(self, need: tuple[int, ...]) -> bool:
        return all(u + n <= b for u, n, b in zip(self.used, need, self.budget))

    def check(self, length: int):
        """RequestError, naming the limit, for a sequence that could not fit even alone (it would wait
        for ever). cluster.engine.plan_memory reserves at least one full context, so this only guards."""
        from raymoe.stages.errors import RequestError
        for stage, (n, b) in enumerate(zip(self.need(length), self.budget)):
            if n > b:
                raise RequestError(f"max_tokens is more than memory allows: prompt + max_tokens ({length} tokens) "
                                   f"needs {n / MiB:.1f} MiB of cache on stage {stage}, which has {b / MiB:.1f} MiB "
                                   f"for caches; ask for fewer tokens")

    def take(self, need: tuple[int, ...]):
        self.used = [u + n for u, n in zip(self.used, need)]

    def give(self, need: tuple[int, ...]):
        self.used = [u - n for u, n in zip(self.used, need)]


def fit_running(needs: list[StageNeed], node_bytes: list[int], max_running: int, explicit: bool) -> int:
    """The number of running sequences the stages can hold caches for on nodes with `node_bytes` of
    memory each: max_running when it fits; fewer when the user did not ask for it explicitly; else an
    error that says what to change."""
    from raymoe.stages.errors import RaymoeError

    def fits(n):
        totals = [need.total(n) for need in needs]
        return sum(totals) <= sum(node_bytes) and max(totals) <= max(node_bytes)

    if fits(max_running):
        return max_running
    if explicit or not fits(1):
        n = max_running if explicit else 1
        weights = sum(need.weight_bytes for need in needs)
        cache = sum(need.cache_bytes_per_sequence for need in needs)
        prefix = sum(need.prefix_bytes for need in needs)
        prefix_text = f", {prefix / GiB:.2f} GiB of prefix cache" if prefix else ""
        raise RaymoeError(
            f"the model does not fit: its {len(needs)} stage(s) need {sum(need.total(n) for need in needs) / GiB:.1f} "
            f"GiB ({weights / GiB:.1f} GiB of weights, {cache / GiB:.2f} GiB of cache per sequence x {n}"
            f"{prefix_text}), and Ray has {sum(node_bytes) / GiB:.1f} GiB (largest node {max(node_bytes) / GiB:.1f} "
            f"GiB); use --pp over more nodes, a smaller --max-running or a smaller --max-model-len"
            + (" or --prefix-cache-gb" if prefix else ""))
    n = max_running
    while not fits(n):
        n -= 1
    return n
