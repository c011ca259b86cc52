"""Batch generation: JSONL prompts in, JSONL generations out (docs/model-formats.md §1).

    python -m raymoe.deploy.generate --model MODEL --input IN.jsonl --output OUT.jsonl [flags]

Each output line matches its input line, in order (or as they finish, --unordered), written and
flushed as it finishes, with a bounded number of lines held; a bad line gets {"id", "error"} and the
rest of the batch still runs. A `messages` line's output has `reasoning_content` beside `text` (then the
answer alone), split as the server splits chat answers (docs/chat.md), and `tool_calls` when the line
offers `tools`; --chat-template and
--chat-template-kwargs steer the chat template, a line's `chat_template_kwargs` override the latter.
--resume keeps an earlier run's output and generates only the ids it lacks. SIGTERM or SIGINT ends the
job, while the model loads too, keeping the lines written so far, and stops the local Ray cluster it started
(exit status 128 + the signal number). Parquet, folders, URIs and --replicas go
through Ray Data (deploy/generate_data.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
import time

from raymoe.cluster.engine_args import EngineArgs, add_engine_flags
from raymoe.deploy.results_file import LineReader, ResultWriter, id_key, local_jsonl, read_lines
from raymoe.stages.text.chat import load_chat_template
from raymoe.stages.errors import RaymoeError, RequestError
from raymoe.stages.text.answers import split_chat_result
from raymoe.stages.text.sampling_params import SamplingParams


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m raymoe.deploy.generate", description=__doc__.split("\n\n")[0])
    add_engine_flags(p, ["model"])
    p.add_argument("--input", required=True,
                   help="requests: a JSONL file; through Ray Data also a .parquet file, a folder of either, or a URI")
    p.add_argument("--output", required=True,
                   help="results: a JSONL file, one line per input line, each written as it finishes; through Ray "
                        "Data also a folder (JSONL, or Parquet when the name ends in .parquet) or a URI")
    p.add_argument("--input-format", default="auto", choices=["auto", "jsonl", "parquet"],
                   help="auto: Parquet when the name ends in .parquet or a local folder holds .parquet files")
    order = p.add_mutually_exclusive_group()
    order.add_argument("--ordered", dest="ordered", action="store_true", default=True,
                       help="write results in input order (the default)")
    order.add_argument("--unordered", dest="ordered", action="store_false", help="write results as they finish")
    p.add_argument("--window", type=int, default=64,
                   help="lines read ahead of the oldest unwritten one (--ordered) or in flight (--unordered); "
                        "through Ray Data: rows per batch handed to a replica")
    p.add_argument("--resume", action="store_true",
                   help="keep the output's results and generate only the ids it lacks (a JSONL file output)")
    p.add_argument("--replicas", type=int, default=1,
                   help="independent pipelines (each --pp stages) fed by one Ray Data stream")
    add_engine_flags(p, ["placement", "pp", "ep", "transport", "split", "microbatches", "threads", "dtype", "device",
                         "max_model_len", "max_running", "prefix_cache_gb", "chat_template", "chat_template_kwargs",
                         "steps_per_call", "placement_timeout", "speculative_config"])
    # sampling defaults of the job; a line's own values override them, and they override the model's
    # (generation_config.json or GGUF general.sampling.*), which override the built-in ones (docs/sampling.md)
    p.add_argument("--max-tokens", type=int, default=None, help="default 64")
    p.add_argument("--temperature", type=float, default=None, help="default: the model's, else 1.0")
    p.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1.0")
    p.add_argument("--top-k", type=int, default=None, help="default: the model's, else 0 (off)")
    p.add_argument("--min-p", type=float, default=None, help="default: the model's, else 0 (off)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="default: the model's, else 1 (off)")
    p.add_argument("--presence-penalty", type=float, default=None, help="default 0")
    p.add_argument("--frequency-penalty", type=float, default=None, help="default 0")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--logprobs", type=int, default=None, help="top-K logprobs per generated token")
    p.add_argument("--prompt-logprobs", type=int, default=None, help="top-K logprobs per prompt token")
    return p.parse_args(argv)


SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "logprobs", "prompt_logprobs")
SIGNALS = (signal.SIGTERM, signal.SIGINT)
INTERRUPTED_SHUTDOWN_S = 3   # how long an interrupted job waits for the coordinator to stop the pipeline


class Interrupted(BaseException):
    """SIGTERM or SIGINT: unwind, so that the engine and the local Ray cluster are shut down."""


class _Signals:
    received: int | None = None
    deferred = False      # while generating: raised at the next check, never inside Ray's result handling


def _interrupt(signum, frame):
    # a second signal must not cut the clean-up short
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    _Signals.received = signum
    if not _Signals.deferred:
        raise Interrupted(signum)


def _check_signals():
    if _Signals.received is not None:
        raise Interrupted(_Signals.received)


def main(argv=None) -> int:
    args = parse_args(argv)
    from raymoe.cluster.engine import disconnect_ray

    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in SIGNALS} if on_main_thread else {}
    _Signals.received, _Signals.deferred = None, False
    _handle_signals()
    try:
        try:
            return run(args)
        except SystemError:
            # Interrupted raised inside a call into Ray's compiled code (waiting for the model to load) comes out so
            if _Signals.received is None:
                raise
            raise Interrupted(_Signals.received) from None
    except RaymoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        signum = e.args[0]
        print(f"error: interrupted by {signal.Signals(signum).name}; the results written so far stay in "
              f"{args.output} (rerun with --resume to finish)", file=sys.stderr)
        return 128 + signum
    finally:
        disconnect_ray()
        for s, handler in previous.items():
            signal.signal(s, handler)


def run(args) -> int:
    defaults = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    try:
        SamplingParams.from_dict(defaults)
    except RequestError as e:
        raise RaymoeError(f"bad sampling flag: {e}") from None
    if args.window < 1 or args.replicas < 1:
        raise RaymoeError("--window and --replicas must be at least 1")
    engine_args = EngineArgs.from_flags(args)
    engine_args.validate()
    # read here: Ray Data's replicas may run where the path means nothing
    engine_args = dataclasses.replace(engine_args, chat_template=load_chat_template(engine_args.chat_template))
    if args.replicas == 1 and args.input_format != "parquet" and local_jsonl(args.input) and local_jsonl(args.output):
        return run_local(args, engine_args, defaults)
    from raymoe.deploy import generate_data
    _Signals.deferred = False      # Ray Data blocks inside its own iterator: a signal interrupts it there
    return generate_data.run(args, engine_args, defaults, check_signals=_check_signals)


def run_local(args, engine_args: EngineArgs, defaults: dict) -> int:
    from tqdm import tqdm

    from raymoe.cluster.engine import ClusterEngine

    lines = read_lines(args.input)
    writer = ResultWriter(args.output, args.resume)
    try:
        engine = ClusterEngine(engine_args)     # our signal handlers stay through ray.init: see connect_ray
        interrupted = False
        try:
            try:
                SamplingParams.from_dict(defaults, context_length=engine.config.context_length)
            except RequestError as e:
                raise RaymoeError(f"bad sampling flag: {e}") from None
            _Signals.deferred = True
            _check_signals()
            reader = LineReader(lines, args.window)
            try:
                with tqdm(desc="generating", unit="req", file=sys.stderr, disable=None) as bar:
                    job = StreamingJob(engine, writer, defaults, args.window, args.ordered, bar)
                    elapsed = job.run(reader)
            finally:
                reader.close()
            stats = engine.stats()
        except Interrupted:
            interrupted = True
            raise
        finally:
            # interrupted, don't wait out a coordinator that is busy (reloading a dead stage's model takes
            # minutes at full size): killing it ends the pipeline's actors with it
            engine.shutdown(timeout=INTERRUPTED_SHUTDOWN_S if interrupted else 60)
    finally:
        writer.close()
    ttft = sorted(stats["first_token_s"])
    ttft_text = f", TTFT p50 {1000 * ttft[len(ttft) // 2]:.0f} ms" if ttft else ""
    # the share of the job each stage spent computing: the rest is waiting (its turn, Ray, the coordinator)
    busy = "/".join(f"{100 * min(1.0, s['busy_s'] / max(elapsed, 1e-9)):.0f}%" for s in stats["stages"])
    prefix = stats["prefix_cache"]
    prefix_text = (f"; prefix cache: {prefix['hit_tokens']} of {prefix['lookup_tokens']} prompt tokens hit "
                   f"({prefix['hits']} requests), {stats['prefill_tokens']} prefilled") if prefix["budget_bytes"] else ""
    spec = stats["speculation"]
    spec_text = (f"; speculation: {spec['accepted_tokens']} of {spec['draft_tokens']} drafts accepted "
                 f"({100 * spec['acceptance_rate']:.0f}%), {spec['mean_accepted_length']:.2f} tokens a verify step"
                 if spec["draft_tokens"] else "")
    nodes = len({s["node_id"] for s in stats["stages"]})      # where the stage processes ran, as Ray says
    restarts = stats["coordinator_restarts"]
    restarts = f"; the coordinator died and was replaced {restarts} times" if restarts else ""
    print(job.summary(elapsed) + f"{ttft_text}; stages busy {busy}; pp={args.pp} ep={args.ep} "
          f"nodes={nodes} transport={stats['transport']}{prefix_text}{spec_text}{restarts}",
          file=sys.stderr)
    if job.stopped:
        raise RaymoeError(job.stopped)
    return 0


class StreamingJob:
    """Feeds the engine from a lazy line iterator and writes each result as it finishes. At most
    `window` lines are held: in flight or, when ordered, waiting for an earlier line to be written."""

    def __init__(self, engine, writer: ResultWriter, defaults: dict, window: int, ordered: bool, bar):
        self.engine, self.writer, self.defaults, self.window, self.ordered, self.bar = (
            engine, writer, defaults, window, ordered, bar)
        self.in_flight: dict[int, int] = {}     # seq_id -> position
        self.chats: dict[int, dict] = {}        # seq_id -> `messages` line: its reasoning (and tool calls) go apart
        self.ready: dict[int, dict] = {}        # position -> result waiting for earlier ones (ordered)
        self.lines = 0                          # lines read
        self.read = self.written = 0            # positions taken (lines not skipped), results written
        self.seen: dict[str, int] = {}          # id key -> line number, this run (~100 bytes an id)
        self.stopped: str | None = None         # why reading stopped early (a repeated id)
        self.skipped = self.failed = self.prompt_tokens = self.generated_tokens = 0

    def run(self, lines: LineReader) -> float:
        start = time.perf_counter()
        exhausted = False
        while True:
            _check_signals()
            batch = []
            while not exhausted and self.read - self.written < self.window:
                # wait for input only when there is nothing else to do (then briefly: signals)
                line = lines.END if self.stopped else lines.get(0 if self.in_flight or batch else 0.5)
                if line is None:
                    break
                if line is lines.END:
                    exhausted = True
                    continue
                position = self._take(line)
                if position is not None:
                    batch.append((position, line))
            self._submit(batch)
            if not self.in_flight:
                if exhausted:
                    return time.perf_counter() - start
                continue
            for seq_id, result in self.engine.wait_finished(timeout=1.0):
                if seq_id in self.chats:
                    result = split_chat_result(result, self.engine.tokenizer, self.chats.pop(seq_id))
                self._emit(self.in_flight.pop(seq_id), result)

    def _take(self, line) -> int | None:
        """The position of a line to generate; errors are written (in turn) here, done ids skipped."""
        self.lines += 1
        rid, request, error = line
        key = id_key(rid)
        if key in self.writer.done:
            self.skipped += 1
            return None
        if key in self.seen:
            self.stopped = (f"line {self.lines} repeats the id {key} of line {self.seen[key]}: ids must be unique "
                            f"(--resume finds finished lines by id); the lines before it were written")
            return None
        self.seen[key] = self.lines
        self.read += 1
        if error is not None:
            self._emit(self.read - 1, {"id": rid, "error": error})
            return None
        return self.read - 1

    def _submit(self, batch):
        if not batch:
            return
        outcomes = self.engine.submit_many([(rid, request) for _, (rid, request, _) in batch], self.defaults)
        for (position, (rid, request, _)), outcome in zip(batch, outcomes):
            if isinstance(outcome, dict):
                self._emit(position, {"id": rid, "error": outcome["error"]})
            else:
                self.in_flight[outcome] = position
                if "messages" in request:
                    self.chats[outcome] = request

    def _emit(self, position: int, result: dict):
        if not self.ordered:
            self._write(result)
            return
        self.ready[position] = result
        while self.written in self.ready:          # in order: `written` is the next position to write
            self._write(self.ready.pop(self.written))

    def _write(self, result: dict):
        self.writer.write(result)
        self.written += 1
        self.bar.update(1)
        if "error" in result:
            self.failed += 1
        else:
            self.prompt_tokens += result["usage"]["prompt_tokens"]
            self.generated_tokens += result["usage"]["completion_tokens"]

    def summary(self, elapsed: float) -> str:
        skipped = f", {self.skipped} already in the output" if self.skipped else ""
        tokens = self.prompt_tokens + self.generated_tokens
        return (f"{self.written} requests ({self.failed} failed{skipped}), {self.prompt_tokens} prompt + "
                f"{self.generated_tokens} generated tokens in {elapsed:.2f} s: {tokens / max(elapsed, 1e-9):.1f} "
                f"tok/s ({self.generated_tokens / max(elapsed, 1e-9):.1f} generated tok/s)")


def _handle_signals():
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _interrupt)


if __name__ == "__main__":
    sys.exit(main())
