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
from raymoe.stages.runtime.speculation import ROWS_ALONE


@dataclass
class PlannedChunk:
    seq: Sequence
    start: int
    length: int
    drafts: int = 0         # of its tokens, those that are drafts (a verify chunk; stages/runtime/speculation.py)


class Scheduler:
    def __init__(self, max_batch_tokens: int = 512, prefill_chunk: int = 256):
        self.max_batch_tokens, self.prefill_chunk = max_batch_tokens, prefill_chunk
        # the most tokens of one sequence a step runs; prefill chunks start and end on its multiples
        # whenever the token budget allows, and are the prefix cache's blocks
        self.grid = min(max_batch_tokens, prefill_chunk)
        self.running: list[Sequence] = []
        # speculative decoding (stages/runtime/speculation.py Speculation): drafts(seq, rows) gives the drafts a
        # decoding sequence sends with its token, in a step that holds `rows` decode rows before it; asks(seq, rows)
        # how many an MTP head drafts after the token the step samples
        self.speculation = None

    def decoding(self) -> bool:
        return any(not s.prefilling for s in self.running)

    def next_batch(self, prefill_limit: int | None = None) -> tuple[StepBatch, list[PlannedChunk]] | None:
        """The next step: every decode, then prompt chunks up to the token budget, and up to prefill_limit
        prompt tokens when given (stages/runtime/step_budget.py)."""
        budget = self.max_batch_tokens
        prompt_left = budget if prefill_limit is None else prefill_limit
        decoders = [s for s in self.running if not s.prefilling]
        # drafts only while the step's decode rows stay within what products compute row by row (the same bits)
        spare = ROWS_ALONE - len(decoders)
        chosen = []         # (seq, start, tokens, drafts)
        for seq in decoders + [s for s in self.running if s.prefilling]:
            limit = min(budget, self.prefill_chunk, prompt_left if seq.prefilling else budget)
            if limit <= 0:
                break
            start, n = seq.next_chunk(limit, self.grid)
            tokens = seq.token_slice(start, n)
            drafts = []
            if self.speculation is not None and not seq.prefilling and not seq.cancelled and spare > 0:
                drafts = self.speculation.drafts(seq, ROWS_ALONE - spare - 1)[:min(spare, budget - n)]
                spare -= len(drafts)
            chosen.append((seq, start, tokens + drafts, len(drafts)))
            budget -= n + len(drafts)
            if seq.prefilling:
                prompt_left -= n
        if not chosen:
            return None
        plan, sampling, logit_rows, row = [], [], [], 0
        for seq, start, tokens, drafts in chosen:
            n = len(tokens)
            if drafts:
                c, rows = seq.verify_sampling(tokens[1:], len(logit_rows)), list(range(row, row + n))
            else:
                c, rows = seq.sampling(start, n, row, len(logit_rows))
            if self.speculation is not None and c.tip is not None and not seq.cancelled:
                c.mtp = self.speculation.asks(seq, min(sum(d is not seq for d in decoders), ROWS_ALONE - 1))
            logit_rows.extend(rows)
            plan.append(PlannedChunk(seq, start, n, drafts))
            sampling.append(c)
            row += n
        # a list, not a tensor: it pickles in microseconds on its way to the first stage
        batch = StepBatch(seq_ids=[s.seq_id for s, _, _, _ in chosen], start_pos=[st for _, st, _, _ in chosen],
                          lengths=[len(t) for _, _, t, _ in chosen], token_ids=[t for c in chosen for t in c[2]],
                          logit_rows=logit_rows, sampling=sampling)
        if any(d for *_, d in chosen):
            batch.drafts = [d for *_, d in chosen]
        return batch, plan

    def drop(self, seq: Sequence):
        if seq in self.running:
            self.running.remove(seq)
