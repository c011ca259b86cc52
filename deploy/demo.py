"""`make run`: a PP=2 batch generation on the cluster, checked against PP=1; at PP=2 a model with an MTP head drafts
with it (speculative decoding), which changes no token.

    python -m raymoe.deploy.demo [--model tiny-qwen35moe] [--input examples/prompts.jsonl] [--output out/generations.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from raymoe.stages.errors import RaymoeError


class Collected:
    """The batch job's writer interface, keeping the results in a list."""
    done: frozenset = frozenset()

    def __init__(self):
        self.results: list[dict] = []

    def write(self, result: dict):
        self.results.append(result)


def run_batch(model: str, pp: int, path: str, defaults, speculative: dict | None = None
              ) -> tuple[list[dict], float, dict | None]:
    """The results, the seconds they took after start-up, and the drafts' counts (with `speculative`)."""
    from tqdm import tqdm

    from raymoe.cluster.engine import ClusterEngine, EngineArgs
    from raymoe.deploy.generate import StreamingJob
    from raymoe.deploy.results_file import LineReader, read_lines

    lines = read_lines(path)
    engine = ClusterEngine(EngineArgs(model, pp=pp, speculative_config=speculative))
    try:
        collected = Collected()
        reader = LineReader(lines, 64)
        try:
            with tqdm(desc="generating", unit="req", file=sys.stderr, disable=None) as bar:
                job = StreamingJob(engine, collected, defaults, 64, True, bar)
                elapsed = job.run(reader)
        finally:
            reader.close()
        if job.stopped:
            raise RaymoeError(job.stopped)
        return collected.results, elapsed, engine.stats().get("speculation") if speculative else None
    finally:
        engine.shutdown()


def mtp_config(model: str) -> dict | None:
    """Drafts with the model's MTP head, where it has one."""
    from raymoe.stages.files.loader import open_model, open_mtp_head

    try:
        open_mtp_head(open_model(model))
    except RaymoeError:
        return None
    return {"method": "mtp", "num_speculative_tokens": 2}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raymoe.deploy.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen35moe")
    p.add_argument("--input", default="examples/prompts.jsonl")
    p.add_argument("--output", default="out/generations.jsonl")
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args(argv)
    defaults = {"max_tokens": args.max_tokens, "temperature": 0}
    try:
        start = time.perf_counter()
        speculative = mtp_config(args.model)
        pp2, elapsed, drafts = run_batch(args.model, 2, args.input, defaults, speculative)
        pp1, _, _ = run_batch(args.model, 1, args.input, defaults)
    except RaymoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(args.output, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in pp2)
    print(f"\n{args.model}, PP=2 (two stage actors on Ray), greedy:")
    for r in pp2:
        reasoning = f"reasoning {r['reasoning_content']!r}, answer " if r.get("reasoning_content") else ""
        print(f"  [{r['id']}] " + (f"error: {r['error']}" if "error" in r else
                                   f"{reasoning}{r['text']!r} ({r['finish_reason']}, {len(r['token_ids'])} tokens)"))
    tokens = sum(len(r.get("token_ids", [])) for r in pp2)
    print(f"PP=2: {tokens} tokens generated in {elapsed:.2f} s ({tokens / elapsed:.1f} tok/s, after start-up)")
    if drafts:
        print(f"MTP drafts: {drafts['accepted_tokens']} of {drafts['draft_tokens']} kept "
              f"({drafts['acceptance_rate']:.0%}, {drafts['mean_accepted_length']:.2f} tokens a verify step; the draft "
              f"length falls to none where drafts cost more than they give, as on this tiny model)")
    same = [a.get("token_ids") for a in pp2] == [b.get("token_ids") for b in pp1]
    print(f"PP=1{' without drafts' if drafts else ''} gave the same tokens: {'yes' if same else 'NO'}   "
          f"(total {time.perf_counter() - start:.1f} s; "
          f"outputs in {args.output})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
