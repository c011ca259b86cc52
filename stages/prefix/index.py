"""The coordinator's index of the prefix cache: which blocks of tokens every stage holds, in a byte budget,
least recently used first.

A block is `block` consecutive tokens at a multiple of `block`; it is named by a hash chain (the hash of
its parent's name and its tokens, the first block's parent a salt naming the model, mode and block size),
so one name stands for the whole prefix up to the block's end. Entries form a forest: a block is cached
only while its parent is, and only leaves are evicted. The stages hold exactly what the index says because
the index decides every insertion and eviction and the stages only carry them out (stages/prefix/store.py);
no stage is ever asked.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from array import array


@dataclass
class Entry:
    parent: bytes | None
    snapshot: bool          # the stages hold a snapshot of the summarising layers at the block's end
    children: int = 0
    pins: int = 0           # sequences admitted to restore through it that have not been sent yet


class PrefixIndex:
    def __init__(self, budget: int, block: int, kv_bytes: int, snapshot_bytes: int, salt: str):
        """kv_bytes, snapshot_bytes: what one block's keys and values, and one snapshot, take on all stages."""
        self.budget, self.block = budget, block
        self.kv_bytes, self.snapshot_bytes = kv_bytes, snapshot_bytes
        self.root = hashlib.blake2b(f"{salt}|{block}".encode(), digest_size=16).digest()
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()     # least recently used first
        self.used = 0
        self.pinned: dict[int, list[bytes]] = {}       # seq_id -> the chain it holds pins on
        self.dropped: list[bytes] = []                 # evicted since the last take_dropped()
        # inserted since then: the stages store them after they drop, so these must not be dropped in the same step
        self.fresh: set[bytes] = set()
        self.evictions = 0

    def chain(self, tokens: list[int]) -> list[bytes]:
        """The names of the full blocks of `tokens`."""
        out, parent, b = [], self.root, self.block
        for start in range(0, len(tokens) - b + 1, b):
            parent = hashlib.blake2b(parent + array("q", tokens[start:start + b]).tobytes(), digest_size=16).digest()
            out.append(parent)
        return out

    def longest(self, chain: list[bytes], max_blocks: int) -> tuple[int, int]:
        """(how many leading blocks of `chain` a sequence can start after: all cached, with a snapshot at the
        last one; how many are cached), both at most max_blocks. Touches the first (most recently used)."""
        n = cached = 0
        for h in chain[:max_blocks]:
            entry = self.entries.get(h)
            if entry is None:
                break
            cached += 1
            if entry.snapshot:
                n = cached
        self.touch(chain[:n])
        return n, cached

    def touch(self, chain: list[bytes]):
        # children after parents in use order would make a parent evictable first; leaves go first anyway
        for h in reversed(chain):
            if h in self.entries:
                self.entries.move_to_end(h)

    def pin(self, seq_id: int, chain: list[bytes]):
        for h in chain:
            self.entries[h].pins += 1
        self.pinned[seq_id] = chain

    def unpin(self, seq_id: int):
        for h in self.pinned.pop(seq_id, ()):
            if h in self.entries:
                self.entries[h].pins -= 1

    def insert(self, h: bytes, parent: bytes | None, snapshot: bool) -> tuple[bool, bool] | None:
        """Make room for block h (keys and values, and a snapshot when asked) and record it. Returns what the
        stages must store, (keys and values?, snapshot?), or None: nothing (held already, or no room)."""
        entry = self.entries.get(h)
        kv, snapshot = entry is None, snapshot and not (entry and entry.snapshot)
        if not (kv or snapshot) or (parent is not None and parent not in self.entries):
            return None
        need = self.kv_bytes * kv + self.snapshot_bytes * snapshot
        if not self._make_room(need, keep={h, parent}):
            return None
        if entry is None:
            entry = self.entries[h] = Entry(parent, False)
            if parent is not None:
                self.entries[parent].children += 1
        entry.snapshot = entry.snapshot or snapshot
        self.used += need
        self.fresh.add(h)
        return kv, snapshot

    def _make_room(self, need: int, keep: set) -> bool:
        """Evict least recently used leaves, never pinned ones nor those in `keep`, until `need` fits."""
        if need > self.budget:
            return False
        while self.used + need > self.budget:
            victim = next((h for h, e in self.entries.items() if not e.children and not e.pins and h not in keep
                           and h not in self.fresh),
                          None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, h: bytes):
        entry = self.entries.pop(h)
        self.used -= self.kv_bytes + self.snapshot_bytes * entry.snapshot
        if entry.parent is not None:
            self.entries[entry.parent].children -= 1
        self.dropped.append(h)
        self.evictions += 1

    def take_dropped(self) -> list[bytes]:
        """What the step being planned drops; its insertions become evictable in later steps."""
        out, self.dropped = self.dropped, []
        self.fresh.clear()
        return out

    def clear(self):
        """A stage lost its store (restarted): nothing is cached any more."""
        self.entries.clear()
        self.pinned.clear()
        self.dropped.clear()
        self.fresh.clear()
        self.used = 0
