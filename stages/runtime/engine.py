"""The engine core (sequences, admission, schedulers, what to do with sampled tokens) and an
in-process engine.

`EngineCore` does no compute: it hands out batches and applies what the last stage sampled.
Running sequences belong to one of a fixed number of micro-batch groups, each with its own
scheduler; the cache slots (max_running) are shared: a group that plans its next batch admits
waiting sequences into any free slot, up to an even share of the work. The coordinator plans and
consumes the groups' batches in one fixed order whatever the pipeline depth, so what goes into
every batch depends only on the requests and never on how many stages run them — that is what
makes PP=1/2/4 bit-identical.

`LocalEngine` runs the core with stages in this process: the whole model for one stage,
or a layer split without any transport, which the tests use to check the split itself.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque

from raymoe.stages.runtime.batch import StepBatch
from raymoe.stages.files.loader import ModelFiles, open_mtp_head
from raymoe.stages.prefix.cache import PrefixCache
from raymoe.stages.text.requests import check_prompt
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.stages.runtime.sampler import ChunkSampling
from raymoe.stages.runtime.scheduler import PlannedChunk, Scheduler
from raymoe.stages.runtime.sequence import Sequence
from raymoe.stages.runtime.speculation import SpeculativeConfig, Speculation
from raymoe.stages.runtime.stage import Stage
from raymoe.stages.runtime.step_budget import PrefillBudget
from raymoe.stages.text.structured import check_grammar

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
                 max_running: int = 64, itl_target_s: float | None = None):
        self.config, self.tokenizer = config, tokenizer
        # while sequences decode, the prompt tokens of the steps in flight are bounded by this target
        self.prefill_budget = PrefillBudget(itl_target_s) if itl_target_s else None
        self.eos_ids = set(tokenizer.eos_token_ids) if tokenizer else set()
        self.groups = [Scheduler(max_batch_tokens, prefill_chunk) for _ in range(n_groups)]
        self.max_running = max_running
        self.cache_budget = None         # a stages.runtime.memory.CacheBudget: admission by memory, besides max_running
        self.prefix = None               # a stages.prefix.cache.PrefixCache (use_prefix_cache)
        self.prefill_tokens = 0          # prompt tokens run through the model (a prefix-cache hit skips its own)
        self.waiting: deque[Sequence] = deque()
        self.sequences: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self.speculation: Speculation | None = None
        self._planned_at: dict[int, float] = {}    # id(plan) -> when a decode or verify step was planned

    def use_speculation(self, config: SpeculativeConfig | None):
        """Decoding sequences send drafts with their tokens (speculative decoding, stages/runtime/speculation.py)."""
        self.speculation = None if config is None else Speculation(config)
        for scheduler in self.groups:
            scheduler.speculation = self.speculation

    def use_prefix_cache(self, model, budget: int, mode: str):
        """A prefix cache of `budget` bytes over all stages (0: none), in blocks of the schedulers' grid."""
        self.prefix = PrefixCache.for_model(model, budget, self.groups[0].grid, mode)

    def add_request(self, request_id, prompt_ids: list[int], params: SamplingParams,
                    seq_id: int | None = None) -> Sequence:
        """seq_id: a sequence re-admitted under the id it had (a restarted coordinator); new ones count on."""
        check_prompt(prompt_ids, self.config.vocab, self.config.context_length)
        params.validate(vocab=self.config.vocab)      # token ids of logit_bias and stop_token_ids
        if params.grammar is not None:
            check_grammar(params.grammar, self.tokenizer)
        seq = Sequence(next(self._ids) if seq_id is None else seq_id, request_id, prompt_ids, params,
                       self.tokenizer, self.eos_ids, self.config.context_length)
        if self.cache_budget is not None:
            self.cache_budget.check(seq.max_length)
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq)
        return seq

    def continue_ids(self, first: int):
        """New sequences get ids from `first` on (a coordinator that took over from a dead one: past its ids)."""
        self._ids = itertools.count(first)

    def alive(self, seq: Sequence) -> bool:
        """Whether `seq` has not ended (a sequence re-admitted under its id is another one)."""
        return self.sequences.get(seq.seq_id) is seq

    def running(self) -> int:
        return sum(len(g.running) for g in self.groups)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.running() > 0

    def next_batch(self, group: int):
        """Admit waiting sequences into the group (free slots, up to its even share of all work, and with a
        cache budget while every stage has room for the next one's cache), then plan its next batch.
        Admission is first come, first served: a long sequence that does not fit yet holds back those
        behind it, so that it is not overtaken for ever."""
        scheduler, running = self.groups[group], self.running()
        share = -(-(running + len(self.waiting)) // len(self.groups))
        while self.waiting and running < self.max_running and len(scheduler.running) < share:
            seq = self.waiting[0]
            if self.cache_budget is not None:
                need = self.cache_budget.need(seq.max_length)
                if not self.cache_budget.fits(need):
                    break
                self.cache_budget.take(need)
                seq.cache_need = need
            self.waiting.popleft()
            seq.group = group
            if self.prefix is not None:
                self.prefix.admit(seq)
            scheduler.running.append(seq)
            running += 1
        limit = None
        if self.prefill_budget is not None and any(g.decoding() for g in self.groups):
            limit = self.prefill_budget.allowance(sum(1 for g in self.groups if g.running))
        planned = scheduler.next_batch(limit)
        if planned is not None:
            batch, plan = planned
            self.prefill_tokens += sum(max(0, min(c.start + c.length, len(c.seq.prompt_ids)) - c.start) for c in plan)
            if self.prefill_budget is not None:
                self.prefill_budget.planned(plan, sum(c.length for c in plan if c.length > 1 and not c.drafts))
            if self.prefix is not None:
                self.prefix.plan(batch, plan)
            if self.speculation is not None and not any(c.seq.prefilling for c in plan):
                self._planned_at[id(plan)] = time.perf_counter()
        return planned

    def plan_ahead(self, plan: list[PlannedChunk], steps: int = 1,
                   max_rows: int = 1) -> tuple[StepBatch, list[PlannedChunk]] | None:
        """The step after `plan` (the chunks in flight), planned while `plan` computes, for the pipeline that would
        otherwise wait idle for its result: every running sequence is in `plan`, decoding, and none can be let in,
        so that this is the batch that would be planned once the tokens are back, for the sequences that go on. Each
        row continues from the token the last stage samples for its sequence (StepBatch.follow), which a one-stage
        pipeline can run, embedding what it sampled, and stages linked so that the last passes it back to the first
        (Stage.link); with `steps` > 1 it runs that many decode steps in one call (fewer where a sequence's
        max_tokens or context comes first), the returned plan's chunks step after step, in the batch's row order.
        At most `max_rows` sequences (rows that each compute as they would alone, so the bits do not depend on the
        batch). None where the next step is not certain to be that one (one may be let in, a sequence ends by
        max_tokens or the context with `plan`) or needs a token here first (a penalty's or a grammar's history, a
        test's script)."""
        chunks_of: dict[Sequence, list[PlannedChunk]] = {}
        for c in plan:
            chunks_of.setdefault(c.seq, []).append(c)
        seqs = list(chunks_of)
        if (self.waiting and self.running() < self.max_running) or self.running() != len(seqs) \
                or len(seqs) > max_rows:
            return None
        rows = []       # (seq, tokens it has in flight, where the last of them goes)
        for seq, chunks in chunks_of.items():
            params, pending = seq.params, len(chunks)
            start = seq.n_tokens + pending - 1
            last = max(chunks, key=lambda c: c.start)
            if (last.start + last.length != start or seq.finish_reason is not None or seq.cancelled
                    or seq.script is not None or params.needs_history
                    or (self.speculation is not None and not self.speculation.may_follow(seq))):
                return None
            steps = min(steps, params.max_tokens - len(seq.output_ids) - pending, seq.context_length - start - 1)
            rows.append((seq, pending, start))
        if steps < 1:
            return None
        sampling = [ChunkSampling(params=seq.params, seed=seq.seed, position=len(seq.output_ids) + pending,
                                  first=r, tip=r, seq_id=seq.seq_id) for r, (seq, pending, _) in enumerate(rows)]
        batch = StepBatch(seq_ids=[seq.seq_id for seq in seqs], start_pos=[start for _, _, start in rows],
                          lengths=[1] * len(rows), logit_rows=list(range(len(rows))), sampling=sampling,
                          follow=True, steps=steps, end_ids=[seq.end_ids for seq in seqs])
        ahead = [PlannedChunk(seq, start + i, 1) for i in range(steps) for seq, _, start in rows]
        if self.prefix is not None:
            self.prefix.plan(batch, ahead)
        return batch, ahead

    def ahead_parts(self, batch: StepBatch, ahead: list[PlannedChunk]) -> dict[int, tuple[list[PlannedChunk], list[int]]]:
        """A plan of plan_ahead by micro-batch group: {group: (its chunks, their indices in the call's results)},
        each consumed as that group's step."""
        parts: dict[int, tuple[list, list]] = {}
        for i, c in enumerate(ahead):
            chunks, indices = parts.setdefault(c.seq.group, ([], []))
            chunks.append(c)
            indices.append(i)
        if self.prefill_budget is not None and batch.steps == 1:    # it measures one step's cost
            for chunks, _ in parts.values():
                self.prefill_budget.planned(chunks, 0)
        return parts

    def drop_ahead(self, ahead: list[PlannedChunk]):
        """A step planned ahead whose sequence ended before it (its result is not used)."""
        if self.prefill_budget is not None:
            self.prefill_budget.forget(ahead)

    def consume(self, results: list[tuple], plan, follow: bool = False) -> list[Sequence]:
        """Apply what the last stage sampled for one batch (per chunk: token, its logprobs, prompt logprobs);
        returns the finished sequences (their caches in the stages are the caller's to release). A sequence
        whose update raised is among them, with its error set. `follow`: the plan of a follow batch (plan_ahead),
        whose call stops after a step where a row's sequence ended: its chunks past the results were not computed,
        and those of a sequence that had already ended (a stop string, a cancel) are not used."""
        if self.prefill_budget is not None:
            self.prefill_budget.done(plan)
        planned_at = self._planned_at.pop(id(plan), None)
        if planned_at is not None:
            self.speculation.observe(sum(c.length for c in plan), time.perf_counter() - planned_at)
        finished = []
        for i, c in enumerate(plan):
            seq = c.seq
            if seq in finished:     # it ended at an earlier step of a several-step call (plan_ahead)
                continue
            if follow and (i >= len(results) or not self.alive(seq)):
                continue
            result = results[i] if i < len(results) else "the stage returned no result for this step"
            try:
                if isinstance(result, str):     # its sampling failed; the last stage logged the traceback
                    seq.error = f"internal error: {result}"
                else:
                    seq.record(c.length, *result[:3])
                    if c.drafts:
                        self.speculation.verified(seq, c.drafts, len(result[0]) - 1)
                    if len(result) > 3:     # an MTP head's drafts after its token (stages/runtime/mtp.py)
                        self.speculation.proposed(seq, result[3])
            except Exception as e:     # a bug or bad numbers in this sequence: it alone fails
                log.exception("sequence %s (request %r) failed", seq.seq_id, seq.request_id)
                seq.error = f"internal error: {type(e).__name__}: {e}"
            if seq.error:
                seq.finish_reason = "error"
            if seq.finish_reason is not None:
                self.finish(seq)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str | None = None):
        """Remove a sequence (done, or cancelled with `reason`)."""
        if reason is not None and seq.finish_reason is None:
            seq.finish_reason = reason
        if seq.group is None:
            if seq in self.waiting:
                self.waiting.remove(seq)
        else:
            self.groups[seq.group].drop(seq)
            if seq.cache_need is not None:
                self.cache_budget.give(seq.cache_need)
                seq.cache_need = None
        if self.prefix is not None:
            self.prefix.finish(seq)
        self.sequences.pop(seq.seq_id, None)

    def forget_caches(self) -> list[int]:
        """After a stage lost its state: every live sequence recomputes its caches from its tokens, and the
        prefix cache, which the stages no longer hold, is empty."""
        if self.prefix is not None:
            self.prefix.clear()
        if self.prefill_budget is not None:
            self.prefill_budget.forget_in_flight()
        self._planned_at.clear()
        for seq in self.sequences.values():
            seq.n_cached = seq.cached_tokens = 0
            seq.prefix_restore = None
        return list(self.sequences)


class LocalEngine(EngineCore):
    def __init__(self, model: ModelFiles, n_stages: int = 1, mode: str = "auto",
                 scheduler: Scheduler | None = None, device: str = "cpu", prefix_cache_bytes: int = 0,
                 speculation: SpeculativeConfig | None = None):
        super().__init__(model.config, model.tokenizer)
        if scheduler is not None:
            self.groups = [scheduler]
        self.use_prefix_cache(model, prefix_cache_bytes, mode)
        self.use_speculation(speculation)
        self.model = model
        mtp = open_mtp_head(model, speculation.model) if speculation and speculation.method == "mtp" else None
        self.stages = [Stage(model, r, mode, device=device, mtp=mtp) for r in split_layers(model.n_layers, n_stages)]

    def step(self) -> list[Sequence]:
        """Run the next batch through every stage; returns the sequences that finished."""
        planned = self.next_batch(0)
        if planned is None:
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
