"""Batch generation: JSONL prompts in, JSONL generations out (docs/model-formats.md §1).

    python -m deploy.generate --model MODEL --input IN.jsonl --output OUT.jsonl [flags]

Each output line matches its input line, in order; a bad line gets {"id", "error"} and the
rest of the batch still runs. SIGTERM or SIGINT ends the job without output, and stops the local
Ray cluster it started (exit status 128 + the signal number).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from stages.errors import RaymoeError, RequestError
from stages.loader import DEFAULT_MAX_MODEL_LEN
from stages.sampling import SamplingParams


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m deploy.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a .gguf file, an HF model directory, or tiny-qwen35moe / tiny-gptoss")
    p.add_argument("--input", required=True, help="JSONL requests")
    p.add_argument("--output", required=True, help="JSONL results (one line per input line, same order)")
    p.add_argument("--pp", type=int, default=1, choices=[1, 2, 4], help="pipeline stages (one Ray actor each)")
    p.add_argument("--ep", type=int, default=0, help="expert actors per stage (0: experts run in the stage)")
    p.add_argument("--transport", default="object_store", choices=["object_store", "gloo"],
                   help="how activations move between stages")
    p.add_argument("--split", default=None, help="layers per stage, e.g. 3,5 (default: even)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batch groups (>= --pp)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per actor (default: cores / 4, the same for every --pp)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "int8"],
                   help="auto: weights compute in their file's format, quantised ones with 8-bit activations (as "
                        "llama.cpp); float32: exact; int8: every weight matrix requantised to int8 rows")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                   help="context bound: sizes each sequence's cache (default %(default)s, or the model's if shorter)")
    p.add_argument("--max-running", type=int, default=None,
                   help="sequences holding caches at once (default: as many as memory allows, at most 64)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--logprobs", type=int, default=None, help="top-K logprobs per generated token")
    p.add_argument("--prompt-logprobs", type=int, default=None, help="top-K logprobs per prompt token")
    return p.parse_args(argv)


def read_requests(path: str) -> list[tuple[object, dict | None, str | None]]:
    """(id, request or None, error or None) for every non-blank line; a line's id defaults to its index."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise RaymoeError(f"{path}: cannot read input ({e})") from None
    for index, line in enumerate(lines):
        try:
            request = json.loads(line)
        except json.JSONDecodeError as e:
            out.append((index, None, f"line {index + 1} is not valid JSON ({e.msg})"))
            continue
        if not isinstance(request, dict):
            out.append((index, None, f"line {index + 1} is not a JSON object"))
            continue
        out.append((request.get("id", index), request, None))
    return out


SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
    from cluster.engine import disconnect_ray

    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in SIGNALS} if on_main_thread else {}
    _Signals.received, _Signals.deferred = None, False
    _handle_signals()
    try:
        return run(args)
    except RaymoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        signum = e.args[0]
        print(f"error: interrupted by {signal.Signals(signum).name}; no output written", file=sys.stderr)
        return 128 + signum
    finally:
        disconnect_ray()
        for s, handler in previous.items():
            signal.signal(s, handler)


def parse_split(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise RaymoeError(f"--split must be comma-separated layer counts, got {text!r}") from None


def run(args) -> int:
    from tqdm import tqdm

    from cluster.engine import ClusterEngine

    defaults = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    seed=args.seed, logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs)
    try:
        SamplingParams(**defaults).validate()
    except RequestError as e:
        raise RaymoeError(f"bad sampling flag: {e}") from None
    requests = read_requests(args.input)
    engine = ClusterEngine(args.model, pp=args.pp, ep=args.ep, dtype=args.dtype, transport=args.transport,
                           threads=args.threads, split=parse_split(args.split), microbatches=args.microbatches,
                           device=args.device, max_model_len=args.max_model_len, max_running=args.max_running)
    _handle_signals()       # ray.init replaced the SIGTERM handler
    try:
        try:
            SamplingParams(**defaults).validate(engine.config.context_length)
        except RequestError as e:
            raise RaymoeError(f"bad sampling flag: {e}") from None
        _Signals.deferred = True
        _check_signals()
        results, elapsed = generate_all(engine, requests, defaults, tqdm)
        stats = engine.stats()
        _check_signals()
    finally:
        engine.shutdown()

    with open(args.output, "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    done = [r for r in results if "error" not in r]
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in done)
    gen_tokens = sum(r["usage"]["completion_tokens"] for r in done)
    ttft = sorted(stats["first_token_s"])
    ttft_text = f", TTFT p50 {1000 * ttft[len(ttft) // 2]:.0f} ms" if ttft else ""
    print(f"{len(results)} requests ({len(results) - len(done)} failed), {prompt_tokens} prompt + {gen_tokens} "
          f"generated tokens in {elapsed:.2f} s: {(prompt_tokens + gen_tokens) / max(elapsed, 1e-9):.1f} tok/s "
          f"({gen_tokens / max(elapsed, 1e-9):.1f} generated tok/s){ttft_text}; pp={args.pp} ep={args.ep} "
          f"transport={args.transport}", file=sys.stderr)
    return 0


def _handle_signals():
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _interrupt)


def generate_all(engine, requests, defaults, tqdm) -> tuple[list[dict], float]:
    """Submit every good line, collect results as they finish; bad lines get their error in place."""
    results: list[dict | None] = [None] * len(requests)
    good = [(i, rid, req) for i, (rid, req, err) in enumerate(requests) if err is None]
    for i, (rid, _, err) in enumerate(requests):
        if err is not None:
            results[i] = {"id": rid, "error": err}
    start = time.perf_counter()
    submitted = engine.submit_many([(rid, req) for _, rid, req in good], defaults)
    index_of = {}
    for (i, rid, _), outcome in zip(good, submitted):
        if isinstance(outcome, dict):
            results[i] = {"id": rid, "error": outcome["error"]}
        else:
            index_of[outcome] = i
    with tqdm(total=len(index_of), desc="generating", unit="req", file=sys.stderr, disable=None) as bar:
        remaining = len(index_of)
        while remaining:
            _check_signals()
            for seq_id, result in engine.wait_finished(timeout=1.0):
                results[index_of[seq_id]] = result
                remaining -= 1
                bar.update(1)
    return results, time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
