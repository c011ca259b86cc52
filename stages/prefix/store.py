"""A stage's share of the prefix cache: for each cached block of tokens, its full-attention layers' keys and
values, and at some block ends a snapshot of the layers whose state sums up everything before (Gated
DeltaNet's conv inputs and recurrent state, a sliding window's keys). What it holds is decided by the
coordinator (stages/prefix/cache.py), which sends it with each step (stages/runtime/batch.py PrefixOps); the store
only does it, so the coordinator's index always says what every stage holds.
"""
from __future__ import annotations

from raymoe.stages.runtime.batch import PrefixOps
from raymoe.stages.layers.cache import KVCache


def _per_block(cache) -> bool:
    """Full attention keeps every position: its rows split into blocks. Other layers are snapshotted."""
    return isinstance(cache, KVCache) and cache.window is None


class PrefixStore:
    def __init__(self):
        self.blocks: dict[bytes, dict] = {}       # hash -> {layer: (k, v, pos)} of full-attention layers
        self.snapshots: dict[bytes, dict] = {}    # hash -> {layer: snapshot} at the block's end
        self.bytes = 0

    def restore(self, ops: PrefixOps, new_caches) -> dict:
        """{seq_id: caches} of the sequences that start from cached blocks; new_caches() makes empty ones."""
        out = {}
        for sid, chain in ops.restore.items():
            missing = [h.hex() for h in chain if h not in self.blocks] + \
                      ([] if chain[-1] in self.snapshots else [chain[-1].hex() + " (snapshot)"])
            if missing:     # the coordinator's index and this store disagree: a bug, never a wrong answer
                raise RuntimeError(f"prefix cache: sequence {sid} restores blocks this stage lacks: {missing}")
            caches = new_caches()
            snap = self.snapshots[chain[-1]]
            for layer, cache in caches.items():
                if _per_block(cache):
                    cache.set_rows([self.blocks[h][layer] for h in chain])
                else:
                    cache.restore(snap[layer])
            out[sid] = caches
        return out

    def drop(self, hashes):
        for h in hashes:
            for table in (self.blocks, self.snapshots):
                self.bytes -= _nbytes(table.pop(h, {}))

    def store(self, ops: PrefixOps, caches: dict):
        """Keep what ops.store names of the sequences' caches, as they are after the step (the chunk that
        completed a block ends at its end: positions align with blocks, stages/runtime/scheduler.py)."""
        for sid, index, h, kv, snapshot in ops.store:
            seq_caches = caches[sid]
            if kv:
                a, b = index * ops.block, (index + 1) * ops.block
                self._put(self.blocks, h, {i: c.rows(a, b) for i, c in seq_caches.items() if _per_block(c)})
            if snapshot:
                self._put(self.snapshots, h, {i: c.snapshot() for i, c in seq_caches.items() if not _per_block(c)})

    def _put(self, table: dict, h: bytes, layers: dict):
        self.bytes += _nbytes(layers) - _nbytes(table.get(h, {}))
        table[h] = layers

    def clear(self):
        self.blocks.clear()
        self.snapshots.clear()
        self.bytes = 0


def _nbytes(layers: dict) -> int:
    return sum(t.numel() * t.element_size() for parts in layers.values() for t in parts if hasattr(t, "numel"))
