"""The coordinator actor: owns every sequence, schedules micro-batches, keeps the pipeline full.

Every micro-batch group (see stages.runtime.engine.EngineCore) may have a batch in flight at once, so
with at least as many groups as stages every stage has work. Batches are planned round-robin over
the groups and their results consumed in the order they were planned, whatever the pipeline depth:
the same requests give the same batches, and the same outputs, at every PP. Decode steps planned while the pipeline
is busy go out together as one step (_submit_held, docs/merged-steps.md), with the same bits. When a stage actor
dies, the pipeline replaces it and every live sequence recomputes its caches from its tokens; the outputs are
unchanged.

The scheduler loop never ends on an error: an exception it did not expect is logged with its
traceback and fails only the sequences it concerns (those of the micro-batch at hand), with an
error result; everything else goes on. check_health() reports a loop that makes no progress:
work waiting and no step completed for stall_timeout seconds.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import ray
import torch

from raymoe.stages.runtime.batch import merge_decode_steps, mergeable
from raymoe.stages.runtime.engine import EngineCore
from raymoe.stages.errors import RaymoeError, RequestError
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.memory import CacheBudget, GiB
from raymoe.stages.runtime.speculation import SpeculativeConfig, speculation_load
from raymoe.stages.prefix.cache import prefix_load_off
from raymoe.stages.text.requests import line_grammar, prompt_ids, sampling_params
from raymoe.stages.text.sampling_params import SamplingParams

from .outputs import Outputs
from .pipeline import Pipeline, PipelineSpec

log = logging.getLogger("raymoe.coordinator")
# A pipeline that fails more than MAX_RESTARTS times within RESTART_WINDOW seconds is given up: it
# cannot work (a stage that dies on every step). Restarts spread over a long life never add up to that.
MAX_RESTARTS = 5
MAX_FAILED_TURN_WAIT_S = 1.0    # the longest the loop waits after a turn that raised (doubling from 2 ms)
RESTART_WINDOW = 600.0
OOM_ERROR = ("a stage ran out of memory while running this request; lower --max-running or --max-model-len "
             "(or give the stages more memory)")


class QueueFullError(RaymoeError):
    """The coordinator's bounded queue is full: try again later (HTTP 503)."""


def out_of_memory(e: ray.exceptions.RayError) -> bool:
    """Whether a failed step ran out of memory: Ray's memory monitor killed the stage (OutOfMemoryError, or an
    actor death whose exit type Ray records as NODE_OUT_OF_MEMORY), or the stage's forward raised an
    allocation failure. An actor killed by the kernel's OOM killer reads as any other crash (Ray's message
    then names the OOM killer only as one possible cause): it is restarted, within MAX_RESTARTS per
    RESTART_WINDOW."""
    if isinstance(e, ray.exceptions.OutOfMemoryError):
        return True
    if isinstance(e, ray.exceptions.RayActorError):
        return "NODE_OUT_OF_MEMORY" in str(e)
    return isinstance(getattr(e, "cause", None), (MemoryError, torch.OutOfMemoryError))


@ray.remote
class Coordinator:
    def __init__(self, spec: PipelineSpec):
        """spec.args: resolved settings, with max_running as the memory plan allows (cluster.engine.plan_memory)."""
        args = spec.args
        model = open_model(args.model, args.max_model_len)
        args.configure_chat(model.tokenizer)
        self.core = EngineCore(model.config, model.tokenizer, args.microbatches, args.max_batch_tokens,
                               args.prefill_chunk, args.max_running,
                               args.itl_target_ms / 1000 if args.itl_target_ms else None)
        speculative = SpeculativeConfig.parse(args.speculative_config)
        if spec.cache_budget is not None:     # the last stage's MTP head (checked by cluster.engine.pipeline_spec)
            self.core.cache_budget = CacheBudget(model, spec.ranges(), spec.cache_budget, args.step_chunk,
                                                 mtp=speculative is not None and speculative.method == "mtp")
        # its size as planned (cluster.engine.plan_memory), over all stages: the same decisions at any --pp
        self.core.use_prefix_cache(model, int((args.prefix_cache_gb or 0) * GiB), args.dtype)
        self.core.use_speculation(speculative)
        # a request's sampling values over the job's (deploy.generate flags) over the model's over the built-in ones
        self.model_defaults = SamplingParams.from_dict(model.sampling_defaults)
        self.spec = spec
        self.pipeline = None
        # group -> (refs, plan, batch, part): refs None while held (_submit_held); part: its rows of a merged step's
        # results, a slice, or of a follow call's, a list of indices (None: all of them)
        self.in_flight: dict[int, tuple] = {}
        # group -> (refs, plan, batch, part): the step after the one in flight, sent before its tokens are back (a
        # pipeline that chains steps; _launch_ahead), each group's share of it
        self.ahead: dict[int, tuple] = {}
        self.ahead_steps = self.ahead_dropped = 0      # sequences' steps sent ahead, and of those the ones not used
        self.merged_steps = 0                           # steps that carried several groups' decode steps
        self.to_release: list[int] = []                 # finished sequences whose stage caches are still held
        self.next_group = 0
        self.wake = asyncio.Event()
        self.outputs = Outputs()
        self.fault = dict(args.fault_injection or {})
        self.scripts = dict(args.scripted_outputs or {})
        self.steps = self.restarts = 0                 # restarts: over the coordinator's life (load() shows it)
        self.recent_restarts: deque[float] = deque()    # when each restart of the last RESTART_WINDOW s happened
        self.stats = {"first_token_s": deque(maxlen=100_000), "started": {}}
        self.max_queued = args.max_queued               # None: unbounded
        self.loop_task = None
        self.error: str | None = None
        self.stall_timeout = args.stall_timeout
        self.progress_at = time.monotonic()             # when the last step completed (or work arrived)
        self.current: tuple[int, list | None] | None = None   # (group, plan) the loop is handling

    def start(self) -> str | None:
        """Start the stage actors and wait until every one has loaded its weights. Returns a warning for the
        user, or None."""
        self.pipeline = Pipeline(self.spec)
        return self.pipeline.fallback

    # ---- requests -------------------------------------------------------------------------
    def _ensure_loop(self):
        if self.loop_task is None or self.loop_task.done():
            self.loop_task = asyncio.get_running_loop().create_task(self._run())
            self.loop_task.add_done_callback(self._loop_ended)

    @staticmethod
    def _loop_ended(task):
        # only failing to fail a micro-batch ends the loop: say so (the watchdog then reports the stall)
        if not task.cancelled() and task.exception() is not None:
            log.error("the scheduler loop ended", exc_info=task.exception())

    async def submit(self, request_id, request: dict, defaults: dict | None = None, collect: bool = True) -> int:
        """Queue one request (a JSONL line / API body). Returns its sequence id; bad requests raise
        RequestError with a one-line message. With max_queued set, a request that would wait for a cache
        slot while max_queued others already do raises QueueFullError. With collect=False the
        result only goes to stream() (a server), not to wait_finished() (a batch job)."""
        return self._add(request_id, request, defaults, collect).seq_id

    async def readmit(self, sequences: list[tuple], next_seq_id: int):
        """After a coordinator died (cluster.engine.ClusterEngine): its unfinished sequences, each as
        (seq_id, request_id, request, defaults, collect, delivered), queued again under their ids; new ones
        get ids from next_seq_id on (past every id the dead one gave). `delivered`
        ({"token_ids", "logprobs", "text_chars"}, or None) is what their reader already got: those tokens are
        replayed as if sampled, so the sequence recomputes its caches from prompt and tokens (as after a stage
        restart) and goes on from there; its stream starts after them. Sampling draws depend only on the seed
        and the token's position (stages/runtime/sampler.py): a seeded or greedy sequence continues as it would have."""
        self.core.continue_ids(next_seq_id)
        for seq_id, request_id, request, defaults, collect, delivered in sequences:
            seq = self._add(request_id, request, defaults, collect, seq_id)
            if not delivered:
                continue
            tokens = delivered["token_ids"]
            for token, entry in zip(tokens, delivered["logprobs"] or [None] * len(tokens)):
                seq.append_token(token, entry)
            self.outputs.text_sent[seq_id] = delivered["text_chars"]
            if seq.finish_reason is not None:       # it ended with those tokens, but its reader had not heard so
                self._finish(seq, None)

    def _add(self, request_id, request: dict, defaults: dict | None, collect: bool, seq_id: int | None = None):
        if self.error:
            raise RaymoeError(self.error)
        config = self.core.config
        job = {k: v for k, v in (defaults or {}).items() if v is not None}
        params = sampling_params(request, SamplingParams.from_dict(job, self.model_defaults), config.context_length,
                                 config.vocab)
        ids = prompt_ids(request, self.core.tokenizer)
        params.grammar = line_grammar(request, self.core.tokenizer, ids)
        if not self.in_flight and not self.core.has_work():
            self.progress_at = time.monotonic()         # idle until now: the stall clock starts here
        seq = self.core.add_request(request_id, ids, params, seq_id)
        if self.scripts:
            seq.script = self.script_for(seq.prompt_ids)
        if seq_id is None and self.max_queued is not None and self.queued() > self.max_queued:
            self.core.finish(seq, "abort")
            raise QueueFullError(f"the server is busy: {self.max_queued} requests are already waiting for a "
                                 f"cache slot; retry later")
        self.outputs.add(seq.seq_id, collect)
        self.stats["started"][seq.seq_id] = time.perf_counter()
        self._ensure_loop()
        self.wake.set()
        return seq

    async def submit_many(self, requests: list, defaults: dict | None = None) -> list:
        """[(id, request)] -> [seq_id or {"error": message}] in the same order."""
        out = []
        for rid, request in requests:
            try:
                out.append(await self.submit(rid, request, defaults))
            except RequestError as e:
                out.append({"error": str(e)})
        return out

    async def cancel(self, seq_id: int):
        self._cancel(seq_id)

    def _cancel(self, seq_id: int):
        seq = self.core.sequences.get(seq_id)
        if seq is None:
            return
        seq.cancelled = True              # when busy: finished when its in-flight step returns
        busy = any(c.seq is seq for _, plan, _, _ in self.in_flight.values() for c in plan)
        if not busy:
            self._finish(seq, "abort")

    async def wait_finished(self, timeout: float = 1.0) -> list[tuple[int, dict]]:
        """(seq_id, result) of the sequences finished since the last call (waits up to timeout for one)."""
        out = await self.outputs.wait_finished(timeout)
        if self.error and not out:
            raise RaymoeError(self.error)
        return out

    @ray.method(num_returns="streaming")
    async def stream(self, seq_id: int):
        """Updates of one sequence: {"token_ids": [new ids], "logprobs": [...], "text_delta": text added since
        the last update}, the last one with "finished": the final result (whose "text" is the whole text: a
        stop string may have cut what the deltas held)."""
        queue = self.outputs.open_stream(seq_id, running=seq_id in self.core.sequences)
        if queue is None:
            raise RequestError(f"unknown sequence {seq_id}")
        finished = False
        try:
            while not finished:
                update = await queue.get()
                finished = "finished" in update
                yield update
        finally:
            if self.outputs.close_stream(seq_id, finished):
                # a server's sequence whose reader went away (Ray cancels this task when the replica's is
                # cancelled): free it here too, as the replica's own cancel() call may be cancelled with it
                self._cancel(seq_id)

    # ---- load (for a server's metrics and back-pressure) ----------------------------------------
    def queued(self) -> int:
        """Sequences that cannot run yet for lack of a free cache slot."""
        return max(0, self.core.running() + len(self.core.waiting) - self.core.max_running)

    def load(self) -> dict:
        """running: sequences holding cache slots; waiting: not yet admitted; queued: waiting for lack
        of a slot (what max_queued bounds); slots: how many sequences can hold caches at once; cache_used:
        the share of the fullest stage's cache memory that running sequences hold (admission by memory);
        prefill_tokens: prompt tokens run through the model; prefix_cache: its size, use and hit rate (the
        share of looked-up prompt tokens that a hit skipped; docs/prefix-cache.md)."""
        if self.error:
            raise RaymoeError(self.error)
        budget, cache_used = self.core.cache_budget, None
        if budget is not None:
            cache_used = round(max(u / b if b else 0.0 for u, b in zip(budget.used, budget.budget)), 4)
        return {"running": self.core.running(), "waiting": len(self.core.waiting), "queued": self.queued(),
                "slots": self.core.max_running, "cache_used": cache_used, "max_queued": self.max_queued,
                "sequences": len(self.core.sequences), "steps": self.steps, "restarts": self.restarts,
                "prefill_tokens": self.core.prefill_tokens,
                "prefix_cache": self.core.prefix.load() if self.core.prefix is not None else prefix_load_off(),
                "speculation": self.speculation_load()}

    def speculation_load(self) -> dict:
        spec = self.core.speculation
        return spec.load() if spec is not None else speculation_load(0, 0, 0)

    def check_health(self):
        """Raise RaymoeError naming why the engine cannot serve: it gave up, or work has waited
        stall_timeout seconds without a step completing (a hung stage, a stuck loop)."""
        if self.error:
            raise RaymoeError(self.error)
        stalled = time.monotonic() - self.progress_at
        if (self.in_flight or self.core.has_work()) and stalled > self.stall_timeout:
            raise RaymoeError(f"no step completed for {stalled:.0f} s while requests wait "
                              f"(stall timeout {self.stall_timeout:g} s)")

    def pipeline_stats(self) -> dict:
        return {"stages": self.pipeline.stats(), "transport": self.pipeline.transport, "steps": self.steps,
                "restarts": self.restarts,
                "first_token_s": list(self.stats["first_token_s"]), "cpu_s": time.process_time(),
                "prefill_tokens": self.core.prefill_tokens, "ahead_steps": self.ahead_steps,
                "ahead_dropped": self.ahead_dropped, "merged_steps": self.merged_steps,
                "prefix_cache": self.core.prefix.load() if self.core.prefix is not None else prefix_load_off(),
                "speculation": self.speculation_load()}

    def shutdown(self):
        """Stop the scheduler loop (were it to see the stages die, it would restart them), then the
        pipeline's actors. Requests submitted after this are refused."""
        self.error = self.error or "the engine was shut down"
        if self.loop_task is not None:
            self.loop_task.cancel()
        if self.pipeline is not None:
            self.pipeline.shutdown()
            self.pipeline = None

    # ---- the loop ---------------------------------------------------------------------------
    def _launch(self):
        groups = len(self.core.groups)
        planned_now = []
        for _ in range(groups):     # every group may be in flight, whatever the pipeline depth (module doc)
            g = self.next_group
            self.next_group = (g + 1) % groups
            if g in self.in_flight:
                continue
            self.current = (g, None)
            planned = self.core.next_batch(g)
            if planned is not None:
                planned_now.append((g, *planned))
        for g, batch, plan in planned_now:
            self.in_flight[g] = (None, plan, batch, None)
        self._submit_held()
        if self.pipeline.chains and not self.ahead and self.in_flight:
            self._launch_ahead()

    def _submit_held(self):
        """Send the planned steps. While the pipeline computes as many steps as are worth computing at once
        (Pipeline.concurrent_steps), the next ones wait; then the decode steps waiting go as that many steps or
        fewer, each of up to rows_computed_alone sequences: a step reads the weights once for all of its
        sequences. Every product computes each of those rows as it would alone, so each sequence gets the bits
        of its own group's step, and the outputs stay the same at every --pp."""
        held = [(g, plan, batch) for g, (refs, plan, batch, _) in self.in_flight.items() if refs is None]
        if not held:
            return
        # steps computing: those sent, and the one sent ahead (the groups of a merged step or a follow call share its
        # refs)
        sent = len({id(f[0]) for f in [*self.in_flight.values(), *self.ahead.values()] if f[0] is not None})
        limit = self.pipeline.rows_computed_alone
        if limit > 1:
            free = self.pipeline.concurrent_steps - sent
            if free <= 0:
                return
            limit = min(limit, -(-sum(b.n_tokens for _, _, b in held if mergeable(b)) // free))
        runs: list[list] = []
        for g, plan, batch in held:
            run = runs[-1] if runs else None
            if (run and mergeable(batch) and all(mergeable(b) for _, _, b in run)
                    and sum(b.n_tokens for _, _, b in run) + batch.n_tokens <= limit):
                run.append((g, plan, batch))
            else:
                runs.append([(g, plan, batch)])
        for run in runs:
            # how many steps compute at once: a step alone in the pipeline gets every core of its stage's node
            run[0][2].computing = sent + len(runs)
            self._send(run)

    def _send(self, run: list):
        """Submit the steps of `run` ((group, plan, batch) each) as one step."""
        g, plan, batch = run[0]
        self.current = (g, plan)
        if len(run) == 1:
            self.in_flight[g] = (self.pipeline.submit(batch), plan, batch, None)
        else:
            try:
                refs = self.pipeline.submit(merge_decode_steps([b for _, _, b in run]))
            except Exception:       # each alone, so that only the group whose step cannot go fails
                for one in run:
                    one[2].computing = batch.computing
                    self._send([one])
                return
            row = 0
            for g, plan, batch in run:
                self.in_flight[g] = (refs, plan, batch, slice(row, row + len(batch.seq_ids)))
                row += len(batch.seq_ids)
            self.merged_steps += 1
        self._maybe_inject_fault()

    def _launch_ahead(self):
        """One step in flight on a pipeline that chains steps (Pipeline.chains: one stage, or stages linked by shm
        rings), the decode step of every running sequence: send the next step now (stages/runtime/engine.py plan_ahead), so
        that the stages start it as soon as this one ends instead of waiting for the coordinator to consume the
        result and plan again, as vLLM's asynchronous scheduling does. It is the step the coordinator would send
        next, so the outputs are the same. With steps_per_call > 1 it runs that many steps (StepBatch.steps). When
        a sequence ends with an end token the stages compute no step past it; after a stop string or a cancel,
        which only the coordinator sees, they compute up to steps_per_call for nothing. Not while the step in
        flight holds a sequence that has ended: it may stop early, so the next one's positions are not known."""
        flights = list(self.in_flight.values())
        refs = flights[0][0]
        if refs is None or any(r is not refs or any(sid not in self.core.sequences for sid in batch.seq_ids)
                               for r, _, batch, _ in flights):
            return
        plan = [c for _, chunks, _, _ in flights for c in chunks]
        self.current = (None, plan)
        # several sequences only where each row computes as it would alone (a merged step's rule, _submit_held)
        planned = self.core.plan_ahead(plan, self.spec.args.steps_per_call, max(1, self.pipeline.rows_computed_alone))
        if planned is not None:
            batch, ahead = planned
            refs = self.pipeline.submit(batch)
            for g, (chunks, indices) in self.core.ahead_parts(batch, ahead).items():
                self.ahead[g] = (refs, chunks, batch, indices)
            self.ahead_steps += len(ahead)

    def _take_ahead(self, group: int):
        """After a step of `group` was consumed: its share of the step sent ahead is now its step in flight, if a
        sequence of it goes on."""
        if group not in self.ahead:
            return
        refs, plan, batch, part = self.ahead.pop(group)
        if any(self.core.alive(c.seq) for c in plan):
            self.in_flight[group] = (refs, plan, batch, part)
        else:       # they ended (or were cancelled) with the tokens before: their caches are released after this step
            self.core.drop_ahead(plan)
            self.ahead_dropped += len(plan)

    def script_for(self, prompt_ids: list[int]) -> list[int] | None:
        """Test hook (EngineArgs.scripted_outputs, {text: token ids}): a sequence whose prompt's text holds a
        key writes that key's tokens in place of those it samples (its model still runs every step), so
        that a test can drive the whole serving path with an output no random model would write."""
        text = self.core.tokenizer.decode(prompt_ids)
        return next((ids for key, ids in self.scripts.items() if key in text), None)

    def _maybe_inject_fault(self):
        """Test hook: right after the Nth micro-batch was launched, kill a stage actor once, or with
        kind "oom" make its next forward run out of memory."""
        if self.fault and self.steps + len(self.in_flight) >= self.fault["after_steps"]:
            stage = self.pipeline.stages[self.fault["stage"]]
            if self.fault.get("kind") == "oom":
                stage.fail_next_forward.remote()
            else:
                ray.kill(stage, no_restart=True)
            self.fault = {}

    async def _run(self):
        failed = 0      # turns in a row that raised
        while True:
            self.current = None
            try:
                await self._turn()
                failed = 0
            except Exception as e:
                log.exception("the scheduler failed; failing the sequences concerned and going on")
                self._fail_current(e)
                failed += 1
                # a fault that comes back every turn (a bug) must not starve the actor's event loop (a turn that
                # raises before it awaits never yields) nor flood the log
                await asyncio.sleep(min(MAX_FAILED_TURN_WAIT_S, 0.001 * 2 ** min(failed, 20)))

    async def _turn(self):
        """Free finished sequences' caches, launch what can run, then wait for a micro-batch and consume it."""
        if self.to_release:
            self.pipeline.release(self.to_release)
            self.to_release = []
        self._launch()
        self.current = None
        if not self.in_flight:
            self.wake.clear()
            await self.wake.wait()
            return
        # the oldest micro-batch sent first: results are consumed in the order batches were planned, whatever the
        # pipeline depth (a stage runs its calls in order, so nothing is lost by waiting for it)
        g, (refs, plan, batch, part) = next((g, f) for g, f in self.in_flight.items() if f[0] is not None)
        try:
            results = await self._gather(refs)
            if isinstance(part, slice):
                results = results[part]
            elif part is not None:      # a follow call that stopped early returns fewer
                results = [results[i] for i in part if i < len(results)]
        except ray.exceptions.RayError as e:
            oom = out_of_memory(e)
            log.warning("micro-batch failed (%s%s); restarting the pipeline", type(e).__name__,
                        ", out of memory" if oom else "")
            if oom:     # recomputing these would rebuild the state that did not fit: they fail
                for c in plan:
                    if c.seq.seq_id in self.core.sequences:
                        c.seq.error = OOM_ERROR
                        self._finish(c.seq, "error")
            await self._recover()
            return
        del self.in_flight[g]
        self.current = (g, plan)
        self.steps += 1
        self.progress_at = time.monotonic()
        self._consume(results, plan, batch.follow)
        self._take_ahead(g)
        self.current = None

    def _fail_current(self, e: Exception):
        """Fail the sequences of the micro-batch the loop was handling when `e` was raised: its plan (the step
        planned ahead of every running sequence's: that plan), else every sequence of its group, else (nothing at
        hand) every live sequence. So do those of its group's share of the step sent ahead, which the stages
        compute anyway: none of them could go on from where the coordinator knows it."""
        group, plan = self.current or (None, None)
        self.current = None
        if group is None and plan is None:
            self.in_flight.clear()
            victims = list(self.core.sequences.values())
        elif group is None:
            victims = [c.seq for c in plan]
            for seq in victims:
                self.in_flight.pop(seq.group, None)
        else:
            self.in_flight.pop(group, None)
            victims = [c.seq for c in plan] if plan else [
                s for s in self.core.sequences.values() if s.group == group]
        for g in [g for g in self.ahead if group is None or g == group]:
            _, chunks, _, _ = self.ahead.pop(g)
            self.core.drop_ahead(chunks)
            victims += [c.seq for c in chunks]
        for seq in victims:
            if seq.seq_id in self.core.sequences:
                seq.error = f"internal error: {type(e).__name__}: {e}"
                self._finish(seq, "error")
        if self.core.prefix is not None:     # its step's prefix work may not have reached the stages
            self.core.prefix.drop_all(self.core.sequences.values())

    async def _gather(self, refs):
        results = await asyncio.gather(*refs)
        return results[-1]

    def _consume(self, results, plan, follow: bool = False):
        # a several-step call's chunks are its sequences' in turn; those of a sequence that had ended are not used
        seqs = [seq for seq in dict.fromkeys(c.seq for c in plan) if self.core.alive(seq)]
        before = {c.seq.seq_id: len(c.seq.output_ids) for c in plan}
        finished = self.core.consume(results, plan, follow)
        now = time.perf_counter()
        for seq in seqs:
            new = seq.output_ids[before[seq.seq_id]:]
            if new and before[seq.seq_id] == 0:
                self.stats["first_token_s"].append(now - self.stats["started"].pop(seq.seq_id, now))
            if new and seq not in finished:
                self._publish(seq, new, before[seq.seq_id])
            if seq.cancelled and seq not in finished:
                self._finish(seq, "abort")
        for seq in finished:
            self._publish(seq, seq.output_ids[before[seq.seq_id]:], before[seq.seq_id], final=True)
        self.to_release.extend(s.seq_id for s in finished)

    def _publish(self, seq, new_ids, first_index, final=False):
        if final:
            self.stats["started"].pop(seq.seq_id, None)
        self.outputs.publish(seq, new_ids, first_index, final)

    def _finish(self, seq, reason):
        self.core.finish(seq, reason)
        # The stages free its caches when the scheduler loop next turns, never from here: Ray cancels
        # the tasks that a cancelled request (a client that went away) submitted, and a stage whose
        # ordered queue then misses one waits 30 s and fails.
        self.to_release.append(seq.seq_id)
        self.wake.set()
        self._publish(seq, [], len(seq.output_ids), final=True)

    async def _recover(self):
        """A stage (or expert) actor died: drop every in-flight step, replace the dead actors, and let
        every live sequence recompute its caches from its tokens. The restart empties every stage's prefix
        store, and forget_caches the index of it."""
        self.in_flight.clear()      # stale steps still queued on live stages run before their reset
        self.ahead.clear()
        self.restarts += 1
        now = time.monotonic()
        self.recent_restarts.append(now)
        while self.recent_restarts[0] < now - RESTART_WINDOW:
            self.recent_restarts.popleft()
        if len(self.recent_restarts) > MAX_RESTARTS:
            self._give_up(f"the pipeline failed {len(self.recent_restarts)} times within {RESTART_WINDOW / 60:g} "
                          f"minutes; giving up")
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.pipeline.restart)
        except RaymoeError as e:        # its actors cannot be placed again (a node was lost, and no other has room)
            self._give_up(str(e))
            return
        self.core.forget_caches()
        self.progress_at = time.monotonic()

    def _give_up(self, error: str):
        """The engine cannot go on: every request is refused with `error`, and so is every server stream in flight.
        A batch job's sequences end without a result: wait_finished raises the error, the job stops with it, and
        --resume generates what it had not written."""
        self.error = error
        for seq in list(self.core.sequences.values()):
            if seq.seq_id in self.outputs.uncollected:
                seq.error = error
                self._finish(seq, "error")
            else:
                self.core.finish(seq, "error")
                self.to_release.append(seq.seq_id)
