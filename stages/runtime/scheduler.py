"""Continuous batching: which chunk of which sequence runs in one micro-batch group's next step.

Each step runs one decode token for every running sequence past its prompt, then fills
the rest of the token budget with prompt chunks (chunked prefill). A long prompt therefore
never stalls decoding. Admission (which waiting sequence joins which group) is the engine
core's (stages/runtime/engine.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from raymoe.stages.runtime.batch import StepBatch
from raymoe.stages.runtime.sequence import Sequence


@dataclass
class PlannedChunk:
    seq: Sequence
    start: int
    length: int


class Scheduler:
    def __init__(self, max_batch_tokens: int = 512, prefill_chunk: int = 256):
        self.max_batch_tokens, self.prefill_chunk = max_batch_tokens, prefill_chunk
        # the most tokens of one sequence a step runs; prefill chunks start and end on its multiples
        # whenever the token budget allows, and are the prefix cache's blocks
        self.grid = min(max_batch_tokens, prefill_chunk)
        self.running: list[Sequence] = []

    def decoding(self) -> bool:
        return any(not s.prefilling for s in self.running)

    def next_batch(self, prefill_limit: int | None = None) -> tuple[StepBatch, list[PlannedChunk]] | None:
        """The next step: every decode, then prompt chunks up to the token budget, and up to prefill_limit
        prompt tokens when given (stages/runtime/step_budget.py)."""
        budget = self.max_batch_tokens
        prompt_left = budget if prefill_limit is None else prefill_limit
        chosen = []
        for seq in [s for s in self.running if not s.prefilling] + [s for s in self.running if s.prefilling]:
            limit = min(budget, self.prefill_chunk, prompt_left if seq.prefilling else budget)
            if limit <= 0:
                break
            start, n = seq.next_chunk(limit, self.grid)
            chosen.append((seq, start, n))
            budget -= n
            if seq.prefilling:
                prompt_left -= n
        if not chosen:
            return None
        plan, sampling, logit_rows, row = [], [], [], 0
        for seq, start, n in chosen:
            c, rows = seq.sampling(start, n, row, len(logit_rows))
            logit_rows.extend(rows)
            plan.append(PlannedChunk(seq, start, n))
            sampling.append(c)
            row += n
        # a list, not a tensor: it pickles in microseconds on its way to the first stage
        tokens = [t for seq, start, n in chosen for t in seq.token_slice(start, n)]
        batch = StepBatch(seq_ids=[s.seq_id for s, _, _ in chosen], start_pos=[st for _, st, _ in chosen],
                          lengths=[n for _, _, n in chosen], token_ids=tokens, logit_rows=logit_rows,
                          sampling=sampling)
        return batch, plan

    def drop(self, seq: Sequence):
        if seq in self.running:
            self.running.remove(seq)
