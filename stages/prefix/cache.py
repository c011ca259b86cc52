"""The prefix cache's decisions, taken by the engine core (stages/runtime/engine.py) wherever it runs: the coordinator
actor, or in process. At admission a sequence starts after the longest prefix of its prompt that every stage
can restore; each step's batch then tells the stages what to restore, drop and store (stages/runtime/batch.py
PrefixOps). Only blocks inside a prompt are stored, after the chunk that ends at their end: those are the
states an uncached prefill of a longer prompt computes in the same steps (docs/prefix-cache.md). Snapshots
are taken at the last block of each prompt (a chat's next turn starts there), every few blocks, and where a
prompt was seen to part from a cached one (the next prompt with the same preamble starts there).
"""
from __future__ import annotations

from collections import Counter

from raymoe.stages.runtime.batch import PrefixOps, StepBatch
from raymoe.stages.runtime.memory import prefix_block_bytes
from raymoe.stages.prefix.index import PrefixIndex

SNAPSHOT_EVERY_MAX = 8      # blocks between snapshots inside a prompt, at most


class PrefixCache:
    def __init__(self, index: PrefixIndex, snapshot_every: int):
        self.index, self.every = index, snapshot_every
        self.lookups = self.hits = self.lookup_tokens = self.hit_tokens = 0
        self.resync = False         # the next step tells the stages to forget every block (drop_all)
        self.claimed: Counter = Counter()    # blocks of the prompts of live sequences (being computed)

    @classmethod
    def for_model(cls, model, budget: int, block: int, mode: str) -> PrefixCache | None:
        """A cache of `budget` bytes over all stages (None: off). Snapshots inside a prompt every few blocks,
        so that they take about as much memory as the keys and values they sit on."""
        if budget <= 0:
            return None
        kv, snap = prefix_block_bytes(model, range(model.n_layers), block)
        every = 1 if not (kv and snap) else max(1, min(SNAPSHOT_EVERY_MAX, -(-snap // kv)))
        return cls(PrefixIndex(budget, block, kv, snap, f"{model.path}|{mode}"), every)

    @property
    def block(self) -> int:
        return self.index.block

    def admit(self, seq):
        """Name the prompt's blocks; start the sequence after the longest cached prefix. Its last prompt token
        always runs (it gives the first token), and a request for prompt logprobs runs its whole prompt."""
        chain = seq.prefix_chain = self.index.chain(seq.prompt_ids)
        n_prompt = len(seq.prompt_ids)
        n, cached = self.index.longest(chain, (n_prompt - 1) // self.block)
        shared = cached
        while shared < (n_prompt - 1) // self.block and self.claimed[chain[shared]]:
            shared += 1         # blocks that a prompt admitted before it computes too
        if shared > n:      # where it parts from an earlier prompt, a snapshot serves the next one (a preamble)
            seq.prefix_snapshot_at = shared - 1
        self.claimed.update(chain)
        if seq.params.prompt_logprobs is not None:
            return
        self.lookups += 1
        self.lookup_tokens += n_prompt
        if n:
            self.hits += 1
            self.hit_tokens += n * self.block
            seq.prefix_restore = seq.prefix_chain[:n]
            self.index.pin(seq.seq_id, seq.prefix_restore)
            seq.n_cached = seq.cached_tokens = n * self.block

    def plan(self, batch: StepBatch, plan):
        """Attach the step's prefix work: restore sequences sent for the first time after a hit, store the
        blocks the step's chunks complete, drop what making room for them evicted."""
        ops = PrefixOps(self.block, clear=self.resync)
        self.resync = False
        for c in plan:
            seq = c.seq
            if seq.prefix_restore is not None:
                ops.restore[seq.seq_id] = seq.prefix_restore
                seq.prefix_restore = None
                self.index.unpin(seq.seq_id)      # the stages restore before this step drops anything
            end = c.start + c.length
            n_prompt = len(seq.prompt_ids)
            if seq.prefix_chain is None or end % self.block or end > n_prompt:
                continue
            k = end // self.block - 1
            h = seq.prefix_chain[k]
            snapshot = (k + 1) % self.every == 0 or k in (n_prompt // self.block - 1, seq.prefix_snapshot_at)
            what = self.index.insert(h, seq.prefix_chain[k - 1] if k else None, snapshot)
            if what is not None:
                ops.store.append((seq.seq_id, k, h, *what))
            self.index.touch([h])
        ops.drop = self.index.take_dropped()
        batch.prefix = ops if ops else None

    def finish(self, seq):
        self.index.unpin(seq.seq_id)
        seq.prefix_restore = None
        if seq.prefix_chain is not None:
            for h in seq.prefix_chain:
                self.claimed[h] -= 1
                if not self.claimed[h]:
                    del self.claimed[h]
            seq.prefix_chain = None

    def clear(self):
        """A stage lost its store (a restart): forget everything; live sequences recompute from their tokens."""
        self.index.clear()

    def drop_all(self, sequences):
        """When the index may no longer say what the stages hold (a step planned but perhaps never sent):
        forget everything, here and, with the next step, in the stages. Sequences that were to restore
        blocks start from their first token instead."""
        self.index.clear()
        self.resync = True
        for seq in sequences:
            if seq.prefix_restore is not None:
                seq.prefix_restore, seq.n_cached, seq.cached_tokens = None, 0, 0

    def load(self) -> dict:
        ix = self.index
        return {"budget_bytes": ix.budget, "bytes": ix.used, "blocks": len(ix.entries), "block_tokens": ix.block,
                "lookups": self.lookups, "hits": self.hits, "lookup_tokens": self.lookup_tokens,
                "hit_tokens": self.hit_tokens, "evicted_blocks": ix.evictions,
                "hit_rate": round(self.hit_tokens / self.lookup_tokens, 4) if self.lookup_tokens else 0.0}


def prefix_load_off() -> dict:
    """load()'s prefix fields when the cache is off."""
    return {"budget_bytes": 0, "bytes": 0, "blocks": 0, "block_tokens": 0, "lookups": 0, "hits": 0,
            "lookup_tokens": 0, "hit_tokens": 0, "evicted_blocks": 0, "hit_rate": 0.0}
