"""In-process engine: a scheduler driving a list of stages one after another.

With one stage this is the whole model in one process (`--pp 1`); with several it runs a
layer split without any transport, which the tests use to check the split itself.
"""
from __future__ import annotations

import itertools

import torch

from .loader import ModelFiles
from .requests import check_prompt
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .stage import Stage


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Even split, earlier stages taking the remainder."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for i in range(n_stages):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class LocalEngine:
    def __init__(self, model: ModelFiles, n_stages: int = 1, dtype: torch.dtype = torch.float32,
                 scheduler: Scheduler | None = None):
        self.model = model
        self.stages = [Stage(model, r, dtype) for r in split_layers(model.n_layers, n_stages)]
        self.scheduler = scheduler or Scheduler()
        self.eos_ids = set(model.tokenizer.eos_token_ids) if model.tokenizer else set()
        self._ids = itertools.count()

    def add_request(self, request_id, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        cfg = self.model.config
        check_prompt(prompt_ids, cfg.vocab, cfg.context_length)
        seq = Sequence(next(self._ids), request_id, prompt_ids, params, self.model.tokenizer, self.eos_ids,
                       cfg.context_length)
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        """Run one batch through every stage; returns the sequences that finished."""
        planned = self.scheduler.next_batch()
        if planned is None:
            return []
        batch, plan = planned
        x = None
        for stage in self.stages:
            x = stage.forward(batch, x)
        return self._consume(x, plan)

    def _consume(self, logits: torch.Tensor, plan) -> list[Sequence]:
        finished = []
        for c in plan:
            seq = c.seq
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
            if seq.finish_reason is not None:
                finished.append(seq)
                self.scheduler.finish(seq)
                for stage in self.stages:
                    stage.release(seq.seq_id)
        return finished

    def run_until_done(self, on_finish=None):
        while self.scheduler.has_work():
            for seq in self.step():
                if on_finish:
                    on_finish(seq)
