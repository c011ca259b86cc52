"""The engine core (sequences, schedulers, what to do with logits) and an in-process engine.

`EngineCore` does no compute: it hands out batches and consumes logits. Sequences are
spread over a fixed number of micro-batch groups (by sequence id), each with its own
scheduler, so what goes into every batch depends only on the requests and never on how
many pipeline stages run them — that is what makes PP=1/2/4 bit-identical.

`LocalEngine` runs the core with stages in this process: the whole model for one stage,
or a layer split without any transport, which the tests use to check the split itself.
"""
from __future__ import annotations

import itertools
import logging

import torch

from .loader import ModelFiles
from .requests import check_prompt
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .stage import Stage

log = logging.getLogger("raymoe.engine")


def split_layers(n_layers: int, n_stages: int, split: list[int] | None = None) -> list[range]:
    """Layer ranges per stage: `split` gives the layer counts, else an even split (earlier stages
    take the remainder)."""
    if split is None:
        if not 1 <= n_stages <= n_layers:
            raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages")
        base, extra = divmod(n_layers, n_stages)
        split = [base + (1 if i < extra else 0) for i in range(n_stages)]
    if len(split) != n_stages or any(n < 1 for n in split) or sum(split) != n_layers:
        raise ValueError(f"split {split} does not give {n_stages} stages of >= 1 layer covering {n_layers} layers")
    bounds = [0, *itertools.accumulate(split)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class EngineCore:
    def __init__(self, config, tokenizer, n_groups: int = 1, max_batch_tokens: int = 512, prefill_chunk: int = 256,
                 max_running: int = 64):
        self.config, self.tokenizer = config, tokenizer
        self.eos_ids = set(tokenizer.eos_token_ids) if tokenizer else set()
        self.groups = [Scheduler(max_batch_tokens, prefill_chunk, max(1, max_running // n_groups))
                       for _ in range(n_groups)]
        self.sequences: dict[int, Sequence] = {}
        self._ids = itertools.count()

    def add_request(self, request_id, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        check_prompt(prompt_ids, self.config.vocab, self.config.context_length)
        seq = Sequence(next(self._ids), request_id, prompt_ids, params, self.tokenizer, self.eos_ids,
                       self.config.context_length)
        self.sequences[seq.seq_id] = seq
        self.group_of(seq).add(seq)
        return seq

    def group_of(self, seq: Sequence) -> Scheduler:
        return self.groups[seq.seq_id % len(self.groups)]

    def has_work(self) -> bool:
        return any(g.has_work() for g in self.groups)

    def next_batch(self, group: int):
        return self.groups[group].next_batch()

    def consume(self, logits: torch.Tensor, plan) -> list[Sequence]:
        """Apply one batch's logits: prompt logprobs, sampling, stop checks. Returns finished sequences
        (their caches in the stages are the caller's to release); a sequence whose sampling raised is
        among them, with its error set."""
        finished = []
        for c in plan:
            seq = c.seq
            try:
                self._apply(seq, c, logits)
            except Exception as e:     # a bug or bad numbers in this sequence: it alone fails
                log.exception("sequence %s (request %r) failed", seq.seq_id, seq.request_id)
                seq.error = f"internal error: {type(e).__name__}: {e}"
                seq.finish_reason = "error"
            if seq.finish_reason is not None:
                self.finish(seq)
                finished.append(seq)
        return finished

    def _apply(self, seq: Sequence, c, logits: torch.Tensor):
        at_tip = c.start + c.length == len(seq.tokens)
        if c.all_rows:
            rows = logits[c.logit_row:c.logit_row + c.length]
            seq.record_prompt_logprobs(c.start, torch.log_softmax(rows, -1))
            last = rows[-1]
        else:
            last = logits[c.logit_row] if at_tip else None
        seq.n_cached += c.length
        if at_tip:
            seq.append_token(last)

    def finish(self, seq: Sequence, reason: str | None = None):
        """Remove a sequence (done, or cancelled with `reason`)."""
        if reason is not None and seq.finish_reason is None:
            seq.finish_reason = reason
        self.group_of(seq).drop(seq)
        self.sequences.pop(seq.seq_id, None)

    def forget_caches(self) -> list[int]:
        """After a stage lost its state: every live sequence recomputes its caches from its tokens."""
        for seq in self.sequences.values():
            seq.n_cached = 0
        return list(self.sequences)


class LocalEngine(EngineCore):
    def __init__(self, model: ModelFiles, n_stages: int = 1, mode: str = "auto",
                 scheduler: Scheduler | None = None, n_groups: int = 1):
        super().__init__(model.config, model.tokenizer, n_groups)
        if scheduler is not None:
            self.groups = [scheduler]
        self.model = model
        self.stages = [Stage(model, r, mode) for r in split_layers(model.n_layers, n_stages)]
        self._next_group = 0

    def step(self) -> list[Sequence]:
        """Run the next non-empty group's batch through every stage; returns the sequences that finished."""
        for _ in range(len(self.groups)):
            group = self._next_group
            self._next_group = (self._next_group + 1) % len(self.groups)
            planned = self.next_batch(group)
            if planned is not None:
                break
        else:
            return []
        batch, plan = planned
        x = None
        for stage in self.stages:
            x = stage.forward(batch, x)
        finished = self.consume(x, plan)
        for seq in finished:
            for stage in self.stages:
                stage.release(seq.seq_id)
        return finished

    def run_until_done(self, on_finish=None):
        while self.has_work():
            for seq in self.step():
                if on_finish:
                    on_finish(seq)
