"""One forward step's batch: chunks of several sequences laid end to end in one flat tensor."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class PrefixOps:
    """A step's prefix-cache work, in the order a stage does it: restore sequences that start from cached
    blocks, drop evicted blocks, run the step, then store the blocks its chunks completed. Blocks are
    `block` tokens, named by their hash chain (stages/prefix/index.py)."""
    block: int
    clear: bool = False                           # first forget every block (the index was dropped)
    restore: dict = field(default_factory=dict)   # seq_id -> [block hashes], its caches start from them
    drop: list = field(default_factory=list)      # block hashes
    # (seq_id, block index, hash, keys and values?, snapshot?): what to keep of a block the step completed
    store: list = field(default_factory=list)

    def __bool__(self):
        return bool(self.clear or self.restore or self.drop or self.store)


@dataclass
class StepBatch:
    seq_ids: list[int]
    start_pos: list[int]          # absolute position of each chunk's first token
    lengths: list[int]            # tokens of each chunk (1 for a decode step)
    token_ids: list[int] | torch.Tensor | None = None   # [T] flat token ids, needed by the first stage
    logit_rows: list[int] = field(default_factory=list)   # flat rows whose logits the last stage computes
    # per chunk, what the last stage samples from its logits (stages/runtime/sampler.py); None: it returns the logits
    sampling: list | None = None
    # micro-batches the pipeline computes at once (at most its stages): a stage actor sizes its share of
    # the node's cores by it (kernels.threads.share_of_cores); it changes no result
    computing: int = 1
    # what the stages do with their prefix caches around this step (stages/prefix/cache.py decides)
    prefix: PrefixOps | None = None
    # token_ids unset: each chunk (one token) is the token the last stage sampled last for its sequence, planned
    # before that token was back (a one-stage pipeline, or stages linked by shm rings; stages/runtime/engine.py plan_ahead)
    follow: bool = False
    # a follow batch: decode steps to run in this one call, each row from the token its row sampled the step
    # before; the results are each step's rows, step after step. It stops after a step where a row sampled a token
    # of its end_ids (per row: its sequence's end and stop tokens)
    steps: int = 1
    end_ids: list[frozenset] = field(default_factory=list)
    # per chunk, how many of its tokens are drafts (speculative decoding; empty: none): a verify chunk is a decode
    # token and its drafts, which the mixers take one after another as decode steps would (stages/layers/cache.py)
    drafts: list[int] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def decoding(self) -> bool:
        """One token of every sequence: each layer runs its decode step (stages/layers/block.py Block.decode)."""
        return bool(self.lengths) and all(n == 1 for n in self.lengths)

    def verifies(self, chunk: int) -> bool:
        """Whether chunk `chunk` is a verify chunk (a decode token and drafts)."""
        return bool(self.drafts) and self.drafts[chunk] > 0

    def segments(self):
        """(seq_id, slice of flat rows, start position) for each chunk."""
        row = 0
        for sid, start, n in zip(self.seq_ids, self.start_pos, self.lengths):
            yield sid, slice(row, row + n), start
            row += n

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(s, s + n) for s, n in zip(self.start_pos, self.lengths)])


def mergeable(batch: StepBatch) -> bool:
    """A decode step that merge_decode_steps can join with others: its tokens at hand, its sampling planned,
    no prefix-cache work."""
    return batch.decoding and not batch.follow and not batch.prefix and batch.sampling is not None


def merge_decode_steps(batches: list[StepBatch]) -> StepBatch:
    """Mergeable decode steps of distinct sequences as one step, their chunks in order: the last stage's
    results are theirs, laid end to end (one per sequence). Rows and logit rows move by those before."""
    sampling, logit_rows, row = [], [], 0
    for b in batches:
        shift = len(logit_rows)
        sampling += [replace(c, first=c.first + shift, tip=None if c.tip is None else c.tip + shift) for c in b.sampling]
        logit_rows += [r + row for r in b.logit_rows]
        row += b.n_tokens
    return StepBatch(seq_ids=[s for b in batches for s in b.seq_ids],
                     start_pos=[p for b in batches for p in b.start_pos],
                     lengths=[n for b in batches for n in b.lengths],
                     token_ids=[t for b in batches for t in b.token_ids],
                     logit_rows=logit_rows, sampling=sampling, computing=batches[0].computing)


@dataclass
class StepContext:
    """What every layer of a stage sees for one step: the batch, positions, and per-sequence caches."""
    batch: StepBatch
    positions: torch.Tensor
    caches: dict                   # seq_id -> {layer index: cache}
    memo: dict = field(default_factory=dict)   # per-step values shared by layers (e.g. RoPE tables)
