"""Per-sequence caches: KV for attention layers, conv + recurrent state for DeltaNet layers.

A verify chunk (speculative decoding, stages/runtime/speculation.py) runs a decode token and its drafts as
decode steps one after another; the cache opens a mark before it (`begin_verify`) and, when the sequence's next
step starts at an earlier position than the chunk reached (drafts were rejected), `settle` puts it back as if
only the kept rows had run: from the state at the mark, the kept rows again (their inputs were kept with the
mark), so the cache holds the bits decoding without drafts gives.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# The position of a cache row that holds no key: no query's position reaches it, so attention masks it by
# causality. A decode step replayed as a CUDA graph reads the whole storage (stages/runtime/decode_graph.py).
EMPTY_POSITION = 1 << 62
# The least storage a KV cache on a GPU has: a decode step replayed as a CUDA graph is captured again each
# time a cache grows (moves); and eager and replayed steps then find the same rows
GRAPH_ROWS = 256


@dataclass
class VerifyMark:
    """What a cache was before a verify chunk whose first token is at position `start`, and the chunk's rows as
    the cache took them (their inputs, to run the kept ones again)."""
    start: int
    state: tuple
    rows: list = field(default_factory=list)


class KVCache:
    """Keys/values of one sequence for one attention layer, with their absolute positions.

    Storage grows by doubling, up to `max_len` positions (the context). With a window, at most twice
    `window` positions are kept (see trim), so memory stays bounded however long the sequence gets.
    Rows past `length` have the position EMPTY_POSITION (and finite keys and values: zeros, or keys that
    a window has passed), so that attention over the whole storage is attention over the rows held.
    """

    def __init__(self, window: int | None = None, max_len: int | None = None):
        self.window, self.max_len = window, max_len
        self.k = self.v = self.pos = None
        self.length = 0
        self.verify: VerifyMark | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        """Append k/v [n, H, D] at positions pos [n]; returns all keys, values and positions held."""
        n = k.shape[0]
        keys, values, positions = self.reserve(n, k.shape[1:], k.dtype, k.device)
        keys[self.length - n:], values[self.length - n:], positions[self.length - n:] = k, v, pos
        if self.verify is not None:
            self.verify.rows.append((k, v, pos))
        return keys, values, positions

    def begin_verify(self, start: int):
        """Before a verify chunk's rows (extend one at a time, each followed by trim). A full layer only needs how
        many rows it held; a sliding one its whole state, as a trim may move its rows."""
        self.verify = VerifyMark(start, (self.length,) if self.window is None else
                                 (self.snapshot() if self.k is not None else None,))

    def settle(self, position: int):
        """The sequence's next step starts at `position`: keep the verify chunk's rows before it, drop the rest."""
        mark, self.verify = self.verify, None
        # nothing to drop: every row kept, or a step from before the chunk (caches computed again from the start)
        if mark is None or not 0 < position - mark.start < len(mark.rows):
            return
        kept = mark.rows[:position - mark.start]
        if self.window is None:
            length = mark.state[0] + len(kept)
            self.pos[length:self.length] = EMPTY_POSITION
            self.length = length
            return
        if mark.state[0] is None:
            self.k = self.v = self.pos = None
            self.length = 0
        else:
            self.restore(mark.state[0])
        for k, v, pos in kept:
            self.extend(k, v, pos)
            self.trim()

    def truncate(self, position: int):
        """Keep the rows of positions before `position` (a full layer's rows are in position order)."""
        if self.k is not None:
            length = int((self.pos[:self.length] < position).sum())
            self.pos[length:self.length] = EMPTY_POSITION
            self.length = length

    def reserve(self, n: int, head_shape, dtype, device):
        """Room for n more positions, left for the caller to fill: returns every key, value and position
        held, the last n rows the new ones (a decode step writes them in its traced part)."""
        least = self._least(device)
        if self.k is None:
            cap = max(n, least)
            self.k = torch.zeros((cap, *head_shape), dtype=dtype, device=device)
            self.v = torch.zeros((cap, *head_shape), dtype=dtype, device=device)
            self.pos = torch.full((cap,), EMPTY_POSITION, dtype=torch.long, device=device)
        elif self.length + n > self.k.shape[0] or self.k.shape[0] < least:
            cap = max(self.length + n, 2 * self.k.shape[0])
            if self.max_len:
                cap = max(self.length + n, min(cap, self.max_len))
            cap = max(cap, least)
            self.k, self.v, self.pos = (self._grow(t, cap) for t in (self.k, self.v, self.pos))
        self.length += n
        return self.k[:self.length], self.v[:self.length], self.pos[:self.length]

    def _least(self, device) -> int:
        """The least storage it keeps: GRAPH_ROWS on a GPU (at most max_len), 16 elsewhere."""
        if torch.device(device).type != "cuda":
            return 16
        return min(GRAPH_ROWS, self.max_len) if self.max_len else GRAPH_ROWS

    def _grow(self, t: torch.Tensor, cap: int) -> torch.Tensor:
        out = t.new_full((cap,) + t.shape[1:], EMPTY_POSITION if t is self.pos else 0)
        out[:self.length] = t[:self.length]
        return out

    def trim(self):
        """Drop positions no future query can see (sliding-window layers only), and give back storage
        a long prefill chunk made grow beyond twice the window, so memory stays bounded by the window.
        The copy waits until the storage is full: decode then moves the window once every `window`
        steps, not every step (attention masks out the older positions it still holds)."""
        if self.window is None or self.k is None:
            return
        cap = max(2 * self.window, self._least(self.k.device))
        if self.length > self.window and (self.length >= self.k.shape[0] or self.k.shape[0] > cap):
            keep = slice(self.length - self.window, self.length)
            for t in (self.k, self.v, self.pos):
                t[:self.window] = t[keep].clone()
            self.pos[self.window:] = EMPTY_POSITION
            self.length = self.window
        if self.k.shape[0] > cap:
            self.k, self.v, self.pos = (self._grow(t, cap) for t in (self.k, self.v, self.pos))

    def nbytes(self) -> int:
        return 0 if self.k is None else sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos))

    # ---- the prefix cache (stages/prefix/store.py) ----------------------------------------------
    def rows(self, a: int, b: int) -> tuple:
        """Copies of the keys, values and positions at storage rows a:b: one block of a full-attention
        layer, whose row i holds position i."""
        return self.k[a:b].clone(), self.v[a:b].clone(), self.pos[a:b].clone()

    def set_rows(self, blocks: list[tuple]):
        """Hold the blocks' rows end to end (an empty cache, restored from the prefix cache)."""
        self.k, self.v, self.pos = (torch.cat([b[j] for b in blocks]) for j in range(3))
        self.length = self.k.shape[0]

    def snapshot(self) -> tuple:
        """A sliding layer's whole state: what it holds and its storage size, which decides when the next
        trim happens (and so which keys later steps attend over, masked or not: the same bits need both)."""
        return (self.k[:self.length].clone(), self.v[:self.length].clone(), self.pos[:self.length].clone(),
                self.k.shape[0])

    def restore(self, snap: tuple):
        k, v, pos, capacity = snap
        self.length = k.shape[0]
        self.k, self.v = (t.new_zeros((capacity,) + t.shape[1:]) for t in (k, v))
        self.pos = pos.new_full((capacity,), EMPTY_POSITION)
        self.k[:self.length], self.v[:self.length], self.pos[:self.length] = k, v, pos

    @staticmethod
    def bytes_for(positions: int, n_kv_head: int, head_dim: int) -> int:
        """What `positions` keys and values in float32, with their positions, take."""
        return positions * (2 * n_kv_head * head_dim * 4 + 8)

    @staticmethod
    def capacity_bound(length: int, max_len: int) -> int:
        """The most positions extend() allocates for a sequence that never holds more than `length`
        (<= max_len): it grows only when full, to at most twice what it holds, never past max_len, and
        starts at 16 or the first chunk. (For a CPU stage's admission by memory: on a GPU, where nothing is
        admitted by it, a cache keeps at least GRAPH_ROWS.)"""
        return min(max_len, max(16, 2 * length))


class DeltaNetCache:
    """Conv inputs of the last K-1 tokens and the float32 recurrent state [H_v, dk, dv]."""

    def __init__(self, conv_kernel: int, conv_dim: int, n_v_heads: int, dk: int, dv: int, dtype, device=None):
        self.conv = torch.zeros(conv_kernel - 1, conv_dim, dtype=dtype, device=device)
        self.state = torch.zeros(n_v_heads, dk, dv, dtype=torch.float32, device=device)
        # batched decode: conv and state are row `row` of this stack's tensors (see DeltaNetStack)
        self.stack: DeltaNetStack | None = None
        self.row = 0
        self.verify: VerifyMark | None = None

    def hold(self, conv: torch.Tensor, state: torch.Tensor):
        """Hold these tensors from now on (a prefill's results): the cache leaves any decode stack."""
        self.conv, self.state, self.stack = conv, state, None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.state))

    def alone(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Its conv inputs and state as a stack of one sequence, [1, K-1, C] and [1, H, dk, dv] (views of what it
        holds: a row of a decode stack stays one), for a decode step of it alone."""
        if not (self.conv.is_contiguous() and self.state.is_contiguous()):
            self.hold(self.conv.contiguous(), self.state.contiguous())
        return self.conv[None], self.state[None]

    def begin_verify(self, start: int, step, rows: range):
        """Before a verify chunk: its state, and `step(conv [1, K-1, C], state [1, H, dk, dv], row)` that runs the
        chunk's row `row` (a row of the step's projections) on a one-sequence stack in place."""
        self.verify = VerifyMark(start, (self.conv.clone(), self.state.clone(), step), list(rows))

    def settle(self, position: int):
        """As KVCache.settle: back to the state at the mark, then the kept rows again (the delta rule's step only:
        the projections were kept)."""
        mark, self.verify = self.verify, None
        # nothing to drop: every row kept, or a step from before the chunk (caches computed again from the start)
        if mark is None or not 0 < position - mark.start < len(mark.rows):
            return
        conv, state, step = mark.state
        self.hold(conv, state)
        conv, state = self.alone()
        for row in mark.rows[:position - mark.start]:
            step(conv, state, row)

    def snapshot(self) -> tuple:
        """Copies of the conv inputs and the state (which may be rows of a decode stack)."""
        return self.conv.clone(), self.state.clone()

    def restore(self, snap: tuple):
        self.hold(*(t.clone() for t in snap))

    @staticmethod
    def bytes_for(conv_kernel: int, conv_dim: int, n_v_heads: int, dk: int, dv: int) -> int:
        return 4 * ((conv_kernel - 1) * conv_dim + n_v_heads * dk * dv)


@dataclass(eq=False)
class DeltaNetStack:
    """The conv inputs [n, K-1, C] and states [n, H, dk, dv] of n sequences that decode together, each
    cache holding views of its row: while the same sequences keep decoding together, later steps find
    them stacked already."""
    conv: torch.Tensor
    state: torch.Tensor

    @classmethod
    def of(cls, caches: list[DeltaNetCache]) -> "DeltaNetStack":
        """The caches' stack, rows in this order: theirs when they are its rows so, else a new one."""
        stack = caches[0].stack
        if stack is not None and stack.conv.shape[0] == len(caches) and \
                all(c.stack is stack and c.row == i for i, c in enumerate(caches)):
            return stack
        stack = cls(torch.stack([c.conv for c in caches]), torch.stack([c.state for c in caches]))
        for i, c in enumerate(caches):
            c.hold(stack.conv[i], stack.state[i])
            c.stack, c.row = stack, i
        return stack
