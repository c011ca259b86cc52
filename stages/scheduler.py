"""Continuous batching: which chunk of which sequence runs in the next step.

Each step runs one decode token for every running sequence past its prompt, then fills
the rest of the token budget with prompt chunks (chunked prefill), admitting waiting
sequences while there is room. A long prompt therefore never stalls decoding.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .batch import StepBatch
from .sequence import Sequence


@dataclass
class PlannedChunk:
    seq: Sequence
    start: int
    length: int
    first_row: int                 # index of this chunk's first row in the batch
    logit_row: int                 # index into the returned logits of the first row used by this chunk
    all_rows: bool                 # logits of every row (prompt logprobs) or only the last


class Scheduler:
    def __init__(self, max_batch_tokens: int = 512, prefill_chunk: int = 256, max_running: int = 64):
        self.max_batch_tokens, self.prefill_chunk, self.max_running = max_batch_tokens, prefill_chunk, max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_batch(self) -> tuple[StepBatch, list[PlannedChunk]] | None:
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.popleft())
        budget = self.max_batch_tokens
        chosen = []
        for seq in [s for s in self.running if not s.prefilling] + [s for s in self.running if s.prefilling]:
            if budget <= 0:
                break
            start, n = seq.next_chunk(min(budget, self.prefill_chunk))
            chosen.append((seq, start, n))
            budget -= n
        if not chosen:
            return None
        plan, logit_rows, row = [], [], 0
        for seq, start, n in chosen:
            all_rows = seq.wants_all_rows()
            ends_at_tip = start + n == len(seq.tokens)
            rows = range(row, row + n) if all_rows else (range(row + n - 1, row + n) if ends_at_tip else range(0))
            plan.append(PlannedChunk(seq, start, n, row, len(logit_rows), all_rows))
            logit_rows.extend(rows)
            row += n
        tokens = torch.tensor([t for seq, start, n in chosen for t in seq.tokens[start:start + n]], dtype=torch.long)
        batch = StepBatch(seq_ids=[s.seq_id for s, _, _ in chosen], start_pos=[st for _, st, _ in chosen],
                          lengths=[n for _, _, n in chosen], token_ids=tokens, logit_rows=logit_rows)
        return batch, plan

    def drop(self, seq: Sequence):
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
