"""MTP drafts in raymoe against llama.cpp's `draft-mtp` on the same GGUF and prompts, greedy, batch 1.

    python -m raymoe.tools.bench_mtp [--model tiny-qwen35moe] [--llama-speculative PATH] [--drafts 2] [--tokens 64]

    python -m raymoe.tools.bench_mtp --full FILE     # a full-size file with a head (tools.make_synthetic --mtp)

For each prompt it prints what raymoe's head drafted and kept with a fixed draft length (every step sends `--drafts`
drafts, as llama.cpp's `--spec-draft-n-max` does), and, with `--llama-speculative` (the vendored llama.cpp's
`llama-speculative-simple`, built with CMake from the llama-cpp-python sdist), what llama.cpp's head drafted and kept
with `--spec-type draft-mtp`. Then raymoe's decode with the head at its defaults (the draft length it chooses), as a
ratio to its decode without drafts in the same run, over `--repeat` rounds with their spread.

With `--full`, a full-size file's batch-1 greedy decode in one process (one load): without drafts, with 1 to 3 of
the head's drafts a step (a synthetic head: its drafts are wrong, so this is what drafting costs), and with the
head running but its drafts replaced by the right tokens (what a head that is always right would give).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

PROMPTS = ["The Python interpreter", "A list is", "When an exception is raised,", "The import statement",
           "A module is a file containing", "The for statement in Python"]


def raymoe_fixed(files, prompts: list[str], drafts: int, tokens: int) -> list[dict]:
    """Per prompt: raymoe's counts when every step sends `drafts` drafts of the head."""
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.runtime.speculation import SpeculativeConfig, speculation_load
    from raymoe.stages.text.sampling_params import SamplingParams

    engine = LocalEngine(files, mode="float32",
                         speculation=SpeculativeConfig(method="mtp", num_speculative_tokens=drafts))
    engine.speculation.length = lambda acceptance, rows, most: most
    out = []
    for prompt in prompts:      # one after another: batch 1
        seq = engine.add_request(prompt, files.tokenizer.encode(prompt),
                                 SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        engine.run_until_done()
        out.append(speculation_load(seq.draft_tokens, seq.accepted_tokens, seq.verify_steps))
    return out


def llama_fixed(binary: str, path: str, prompts: list[str], drafts: int, tokens: int, threads: int) -> list[dict]:
    """Per prompt: llama-speculative-simple's counts with its MTP head (greedy, `drafts` at most a step)."""
    out = []
    for prompt in prompts:
        run = subprocess.run([binary, "-m", path, "--spec-type", "draft-mtp", "--spec-draft-n-max", str(drafts),
                              "-p", prompt, "-n", str(tokens), "--temp", "0", "-t", str(threads), "-c", "512",
                              "--ignore-eos"], capture_output=True, text=True, timeout=600)
        log = run.stdout + run.stderr
        counts = {k: int(v) for k, v in re.findall(r"(n_drafted|n_accept|n_predict)\s*=\s*(\d+)", log)}
        if run.returncode or "n_drafted" not in counts:
            raise SystemExit(f"llama-speculative-simple failed ({run.returncode}):\n{log[-2000:]}")
        out.append({"draft_tokens": counts["n_drafted"], "accepted_tokens": counts["n_accept"],
                    "tokens": counts["n_predict"]})
    return out


def decode_rate(files, prompts: list[str], tokens: int, speculative: str | None) -> tuple[float, dict | None]:
    """tok/s of greedy decode of the prompts one after another (batch 1) at the engine's defaults."""
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.runtime.speculation import SpeculativeConfig
    from raymoe.stages.text.sampling_params import SamplingParams

    engine = LocalEngine(files, speculation=SpeculativeConfig.parse(speculative))
    start, n = time.perf_counter(), 0
    for prompt in prompts:
        seq = engine.add_request(prompt, files.tokenizer.encode(prompt),
                                 SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        engine.run_until_done()
        n += len(seq.output_ids)
    return n / (time.perf_counter() - start), engine.speculation.load() if engine.speculation else None


def full_size(path: str, tokens: int, repeat: int) -> dict:
    """tok/s of each way of decoding a full-size file (module doc), every round in turn."""
    from raymoe.kernels.threads import node_cores
    from raymoe.stages.files.loader import open_model
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.runtime.speculation import SpeculativeConfig, Speculation
    from raymoe.stages.text.sampling_params import SamplingParams
    import torch

    torch.set_num_threads(node_cores())
    files = open_model(path)
    engine = LocalEngine(files, speculation=SpeculativeConfig(method="mtp", num_speculative_tokens=3))
    engine.eos_ids = set()
    prompt = [(7 * i + 3) % 2000 for i in range(8)]

    def decode(k: int | None, right: list[int] | None = None) -> tuple[float, list[int], dict | None]:
        engine.use_speculation(None if k is None else SpeculativeConfig(method="mtp", num_speculative_tokens=k))
        if k is not None:
            engine.speculation.length = lambda acceptance, rows, most: most
        if right is not None:
            real = Speculation.proposed.__get__(engine.speculation)
            engine.speculation.proposed = lambda seq, drafts: real(
                seq, right[len(seq.output_ids):len(seq.output_ids) + len(drafts)])
        engine.add_request("warm-up", prompt, SamplingParams(max_tokens=2, temperature=0))
        engine.run_until_done()
        seq = engine.add_request("r", prompt, SamplingParams(max_tokens=tokens, temperature=0))
        start = time.perf_counter()         # the 8-token prompt's step is timed too, in every way alike
        engine.run_until_done()
        return tokens / (time.perf_counter() - start), seq.output_ids, \
            engine.speculation.load() if engine.speculation else None

    rounds = []
    for _ in range(repeat):
        plain, want, _ = decode(None)
        row = {"plain": round(plain, 2)}
        for k in (1, 2, 3):
            rate, got, load = decode(k)
            row[f"head_{k}"] = round(rate, 2)
            row[f"head_{k}_accepted"] = load["accepted_tokens"]
            assert got == want, "drafts changed the tokens"
            rate, got, load = decode(k, right=want)
            row[f"right_{k}"] = round(rate, 2)
            assert got == want, "drafts changed the tokens"
        rounds.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return {"file": path, "tokens": tokens, "rounds": rounds,
            "over_plain_median": {key: round(statistics.median(r[key] / r["plain"] for r in rounds), 3)
                                  for key in rounds[0] if key != "plain" and not key.endswith("accepted")}}


def total(rows: list[dict]) -> dict:
    drafted, accepted = sum(r["draft_tokens"] for r in rows), sum(r["accepted_tokens"] for r in rows)
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raymoe.tools.bench_mtp", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-qwen35moe", help="a GGUF with an MTP head (default %(default)s)")
    p.add_argument("--llama-speculative", help="path of llama.cpp's llama-speculative-simple")
    p.add_argument("--drafts", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--full", help="a full-size GGUF with an MTP head (tools.make_synthetic --mtp)")
    args = p.parse_args(argv)
    if args.full:
        print(json.dumps(full_size(args.full, args.tokens, args.repeat), indent=2))
        return 0

    from raymoe.stages.files.loader import open_model

    files = open_model(args.model)
    report = {"model": files.path, "drafts": args.drafts, "tokens": args.tokens, "prompts": PROMPTS}
    report["raymoe_fixed"] = raymoe_fixed(files, PROMPTS, args.drafts, args.tokens)
    report["raymoe_fixed_total"] = total(report["raymoe_fixed"])
    if args.llama_speculative:
        report["llama_cpp_fixed"] = llama_fixed(args.llama_speculative, files.path, PROMPTS, args.drafts,
                                                args.tokens, args.threads)
        report["llama_cpp_fixed_total"] = total(report["llama_cpp_fixed"])
    ratios, loads = [], []
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": args.drafts})
    for _ in range(args.repeat):
        plain, _ = decode_rate(files, PROMPTS, args.tokens, None)
        drafted, load = decode_rate(files, PROMPTS, args.tokens, mtp)
        ratios.append(drafted / plain)
        loads.append(load)
    report["decode_with_mtp_over_without"] = {"median": round(statistics.median(ratios), 3),
                                              "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
    report["decode_with_mtp_counts"] = loads
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
