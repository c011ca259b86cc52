"""Batch generation: JSONL prompts in, JSONL generations out (DESIGN §2).

    python -m deploy.generate --model MODEL --input IN.jsonl --output OUT.jsonl [flags]

Each output line matches its input line, in order; a bad line gets {"id", "error"} and the
rest of the batch still runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from stages.errors import RaymoeError, RequestError
from stages.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m deploy.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a .gguf file, an HF model directory, or tiny-qwen35moe")
    p.add_argument("--input", required=True, help="JSONL requests")
    p.add_argument("--output", required=True, help="JSONL results (one line per input line, same order)")
    p.add_argument("--pp", type=int, default=1, choices=[1, 2, 4], help="pipeline stages")
    p.add_argument("--ep", type=int, default=0, help="expert actors per stage (0: experts run in the stage)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="float32 is exact; bfloat16 is faster and approximate")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
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


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except RaymoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    from tqdm import tqdm

    from stages.engine import LocalEngine
    from stages.loader import open_model
    from stages.requests import prompt_ids, sampling_params

    if args.device != "cpu":
        raise RaymoeError("--device cuda needs CUDA stages, which this build does not have yet; use --device cpu")
    if args.pp != 1 or args.ep:
        raise RaymoeError("--pp > 1 and --ep need the Ray cluster, which this build does not have yet; use --pp 1")
    defaults = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, logprobs=args.logprobs,
                              prompt_logprobs=args.prompt_logprobs)
    try:
        defaults.validate()
    except RequestError as e:
        raise RaymoeError(f"bad sampling flag: {e}") from None
    requests = read_requests(args.input)
    model = open_model(args.model)
    engine = LocalEngine(model, dtype=DTYPES[args.dtype])

    results: list[dict | None] = [None] * len(requests)
    index_of = {}
    for i, (rid, request, error) in enumerate(requests):
        if error is None:
            try:
                seq = engine.add_request(rid, prompt_ids(request, model.tokenizer), sampling_params(request, defaults))
                index_of[seq.seq_id] = i
                continue
            except RequestError as e:
                error = str(e)
        results[i] = {"id": rid, "error": error}

    start = time.perf_counter()
    bar = tqdm(total=len(index_of), desc="generating", unit="req", file=sys.stderr, disable=None)

    def on_finish(seq):
        results[index_of[seq.seq_id]] = seq.result()
        bar.update(1)

    engine.run_until_done(on_finish)
    bar.close()
    elapsed = time.perf_counter() - start

    with open(args.output, "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    done = [r for r in results if "error" not in r]
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in done)
    gen_tokens = sum(r["usage"]["completion_tokens"] for r in done)
    print(f"{len(results)} requests ({len(results) - len(done)} failed), {prompt_tokens} prompt + {gen_tokens} "
          f"generated tokens in {elapsed:.2f} s: {(prompt_tokens + gen_tokens) / max(elapsed, 1e-9):.1f} tok/s "
          f"({gen_tokens / max(elapsed, 1e-9):.1f} generated tok/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
