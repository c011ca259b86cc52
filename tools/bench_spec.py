"""Speculative decoding at full size: batch-1 greedy decode of the full-size synthetic files with n-gram drafts and
without, in raymoe and in llama.cpp, on the same prompt, and the cost of a verify step by its rows.

    python -m raymoe.tools.bench_spec --real-dir DIR [--repeat 3] [--tokens 128] [--models gpt-oss-20b,...]

The prompt is 8 random tokens said 4 times, for an n-gram drafter to find; but the random weights of the synthetic
files do not continue it, and their greedy text hardly repeats a token, so the n-gram drafter finds little to
propose there. So the raymoe run also measures drafts of known quality through the drafter interface: the tokens
the plain run gave (right by construction: what speculation gains at full acceptance) and their neighbours (wrong by
construction: what it costs when it never pays, once the draft length has fallen to none).
Engines, each in a process of its own after the files left the page cache:
- raymoe in process (LocalEngine, `--dtype auto`, every core), without drafts, then (same process) with the right
  and the wrong drafts; and in a process of its own with `{"method": "ngram"}` at its defaults (the same tokens,
  checked);
- llama.cpp as llama-cpp-python users get it (n_threads = cores), without drafts and with its prompt-lookup
  drafter (`LlamaPromptLookupDecoding()` at its defaults).
The verify-step curve times one step of a sequence's token and k drafts (k + 1 = 1, 2, 4, 8 rows) and the weight
bytes it must read: every matrix a token reads but the routed experts, and each expert that any row routes to
(counted from the router's choices), over the read rate measured at the start.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from raymoe.kernels.threads import node_cores
from raymoe.tools.bench_real import (REAL_MODELS, cpu_model, llama_cpp_system_info, random_ids,
                                     read_bandwidth_gb_s, real_file, run_child, spread)

ENGINES = ("raymoe", "raymoe-ngram", "llama.cpp", "llama.cpp-ngram")
NGRAM = {"method": "ngram"}
PROMPT = 32           # prompt tokens: 8 random ids, 4 times
VERIFY_ROWS = (1, 2, 4, 8)


def weight_bytes(path: str) -> tuple[int, int, int]:
    """(bytes a token reads besides the routed experts, bytes of one expert of one layer, experts one token reads
    over all layers)."""
    import gguf
    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    n_expert = int(reader.fields[f"{arch}.expert_count"].parts[-1][0])
    n_used = int(reader.fields[f"{arch}.expert_used_count"].parts[-1][0])
    names = {t.name for t in reader.tensors}
    dense = experts = layers = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        if "_exps." in t.name:
            experts += int(t.n_bytes)
            layers += t.name.endswith("ffn_down_exps.weight")
        else:
            dense += int(t.n_bytes)
    return dense, experts // (layers * n_expert), n_used * layers


def prompt_ids() -> list[int]:
    return random_ids(PROMPT // 4, 0) * 4


class Oracle:
    """A drafter that knows the greedy text (a benchmark's: drafts that are right by construction, or with
    `wrong`, wrong by construction: each the right token's neighbour)."""

    def __init__(self, text: list[int], wrong: bool = False):
        self.text, self.wrong = text, wrong

    def propose(self, seq, k: int) -> list[int]:
        n = seq.n_tokens
        if self.text[:n] != seq.prompt_ids + seq.output_ids:
            return []
        return [t + 1 if self.wrong else t for t in self.text[n:n + k]]


def count_experts(engine) -> list:
    """Wrap each MoE layer's router to record how many distinct experts a step's rows route to; returns the list
    the counts of the layers of each step are added to."""
    touched = [0]
    for stage in engine.stages:
        for layer in stage.layers:
            ffn = layer.ffn
            if not hasattr(ffn, "spec") or not hasattr(ffn.spec, "route"):
                continue
            route = ffn.spec.route

            def counted(logits, k, route=route):
                weights, ids = route(logits, k)
                touched[0] += int(torch.unique(ids).numel())
                return weights, ids
            ffn.spec = dataclasses.replace(ffn.spec, route=counted)
    return touched


def bench_raymoe(path: str, n_decode: int, speculate: bool) -> dict:
    from raymoe.stages.files.loader import open_model
    from raymoe.stages.runtime.batch import StepBatch
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.runtime.speculation import MAX_DRAFTS, SpeculativeConfig
    from raymoe.stages.text.sampling_params import SamplingParams

    torch.set_num_threads(node_cores())
    engine = LocalEngine(open_model(path), mode="auto",
                         speculation=SpeculativeConfig.parse(NGRAM) if speculate else None)
    engine.eos_ids = set()
    out = {}

    def generate(n):
        engine.add_request(0, prompt_ids(), SamplingParams(max_tokens=n, temperature=0))
        engine.run_until_done(lambda s: out.__setitem__("tokens", s.output_ids))

    def decode_tok_s() -> float:
        first = time.perf_counter()
        generate(1)
        first = time.perf_counter() - first
        start = time.perf_counter()
        generate(n_decode + 1)
        return n_decode / (time.perf_counter() - start - first)

    result = {"decode_tok_s": decode_tok_s(), "tokens": out["tokens"]}
    if speculate:
        result["speculation"] = engine.speculation.load()
        return result
    # drafts that are right: the tokens just decoded, through the drafter interface, up to 7 a step (the draft
    # length adapts to the measured cost of a step's rows)
    engine.use_speculation(SpeculativeConfig(num_speculative_tokens=MAX_DRAFTS))
    engine.speculation.drafter = Oracle(prompt_ids() + result["tokens"])
    result["oracle_tok_s"] = decode_tok_s()
    result["oracle_same"] = out["tokens"] == result["tokens"]
    result["oracle_speculation"] = engine.speculation.load()
    # drafts never accepted: the draft length must fall to none (the cost of speculation that does not pay), on the
    # first request the engine speculates for (it learns what a step costs and that drafts fail) and on the next
    engine.use_speculation(SpeculativeConfig.parse(NGRAM))
    engine.speculation.drafter = Oracle(prompt_ids() + result["tokens"], wrong=True)
    result["wrong_first_tok_s"] = decode_tok_s()
    result["wrong_tok_s"] = decode_tok_s()
    result["wrong_same"] = out["tokens"] == result["tokens"]
    result["wrong_speculation"] = engine.speculation.load()
    # the verify-step curve: a sequence's token and k drafts, rows rolled back before the next
    stage = engine.stages[0]
    touched = count_experts(engine)
    prompt = random_ids(PROMPT, 1)
    stage.forward(StepBatch(seq_ids=[7], start_pos=[0], lengths=[PROMPT], token_ids=prompt, logit_rows=[PROMPT - 1]))
    curve = {}
    for rows in VERIFY_ROWS:
        times, experts = [], []
        for i in range(6):
            touched[0] = 0
            tokens = random_ids(rows, 100 + i)
            batch = StepBatch(seq_ids=[7], start_pos=[PROMPT], lengths=[rows], token_ids=tokens,
                              logit_rows=list(range(rows)), drafts=[rows - 1])
            start = time.perf_counter()
            stage.forward(batch)
            times.append(time.perf_counter() - start)
            experts.append(touched[0])
        curve[rows] = {"step_s": statistics.median(times[1:]), "experts": statistics.median(experts[1:])}
    result["verify_curve"] = curve
    return result


def bench_llama_cpp(path: str, n_decode: int, speculate: bool) -> dict | None:
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None
    cores = node_cores()
    llm = Llama(model_path=path, n_ctx=PROMPT + n_decode + 64, n_threads=cores, n_threads_batch=cores,
                verbose=False, draft_model=LlamaPromptLookupDecoding() if speculate else None)
    prompt = prompt_ids()

    def generate(n):
        tokens = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            tokens.append(token)
            if len(tokens) == n:
                break
        return tokens
    generate(2)             # maps the file in
    first = time.perf_counter()
    generate(1)
    first = time.perf_counter() - first
    start = time.perf_counter()
    tokens = generate(n_decode + 1)
    return {"decode_tok_s": n_decode / (time.perf_counter() - start - first), "tokens": tokens}


def run_engine(spec: str, n_decode: int) -> dict | None:
    engine, path = spec.split(":", 1)
    if engine.startswith("raymoe"):
        return bench_raymoe(path, n_decode, engine.endswith("ngram"))
    return bench_llama_cpp(path, n_decode, engine.endswith("ngram"))


def run_in_child(engine: str, path: str, folder: str, n_decode: int) -> dict | str:
    return run_child(["raymoe.tools.bench_spec", "--engine", f"{engine}:{path}", "--tokens", str(n_decode)], folder)


def ratio(rounds, a: str, b: str) -> str:
    return spread([r[a]["decode_tok_s"] / r[b]["decode_tok_s"] for r in rounds
                   if isinstance(r.get(a), dict) and isinstance(r.get(b), dict)])


def bench_spec(folder: str, models: list[str], repeat: int, n_decode: int) -> dict:
    cores = node_cores()
    bw, lo, hi = read_bandwidth_gb_s(cores)
    print(f"host: {cpu_model()}, {cores} cores; memory read {bw:.1f} GB/s ({lo:.1f}-{hi:.1f})")
    print(f"llama.cpp: {llama_cpp_system_info() or 'not installed (pip install llama-cpp-python)'}")
    report = {"host": {"cpu": cpu_model(), "cores": cores, "read_gb_s": [bw, lo, hi]}}
    for model in models:
        path = real_file(model, folder)
        print(f"\n== {model}: batch 1, greedy, {PROMPT}-token prompt, {n_decode} tokens; {repeat} rounds", flush=True)
        rounds = []
        for i in range(repeat):
            order = ENGINES if i % 2 == 0 else ENGINES[::-1]
            rounds.append({e: run_in_child(e, path, folder, n_decode) for e in order})
            print(f"  round {i + 1}: " + ", ".join(f"{e} {r['decode_tok_s']:.2f}" if isinstance(r, dict) else
                                                   f"{e} ({r})" for e, r in rounds[-1].items()) + " tok/s", flush=True)
        for r in rounds:
            if isinstance(r.get("raymoe"), dict) and isinstance(r.get("raymoe-ngram"), dict):
                same = r["raymoe"]["tokens"] == r["raymoe-ngram"]["tokens"]
                print(f"  same tokens with drafts: {same}; drafts: {r['raymoe-ngram']['speculation']}")
        print(f"  raymoe ngram / raymoe:            {ratio(rounds, 'raymoe-ngram', 'raymoe')}x")
        plain = [r["raymoe"] for r in rounds if isinstance(r.get("raymoe"), dict)]
        for kind in ("oracle", "wrong"):
            for r in plain:
                print(f"  {kind} drafts: same tokens {r[kind + '_same']}; {r[kind + '_speculation']}")
        print(f"  raymoe right drafts / raymoe:     {spread([r['oracle_tok_s'] / r['decode_tok_s'] for r in plain])}x")
        print(f"  raymoe wrong drafts / raymoe:     {spread([r['wrong_first_tok_s'] / r['decode_tok_s'] for r in plain])}x "
              f"on the first request, {spread([r['wrong_tok_s'] / r['decode_tok_s'] for r in plain])}x on the next  "
              f"(target >= 0.95)")
        print(f"  raymoe ngram / llama.cpp lookup:  {ratio(rounds, 'raymoe-ngram', 'llama.cpp-ngram')}x  (target >= 1.2)")
        print(f"  llama.cpp lookup / llama.cpp:     {ratio(rounds, 'llama.cpp-ngram', 'llama.cpp')}x")
        print(f"  raymoe / llama.cpp (no drafts):   {ratio(rounds, 'raymoe', 'llama.cpp')}x")
        dense, per_expert, one_token = weight_bytes(path)
        curves = [r["raymoe"]["verify_curve"] for r in rounds if isinstance(r.get("raymoe"), dict)]
        if curves:
            print("  verify step: rows, time, experts read (all layers), bytes to read / read rate, ratio "
                  "(target <= 1.25)")
            for rows in VERIFY_ROWS:
                t = statistics.median(c[str(rows)]["step_s"] for c in curves)
                # a decode step's experts are routed inside its compiled call, where the count does not see them
                experts = statistics.median(c[str(rows)]["experts"] for c in curves) or one_token
                floor = (dense + experts * per_expert) / (bw * 1e9)
                print(f"    {rows}: {1000 * t:.1f} ms, {experts:.0f} experts, {1000 * floor:.1f} ms, {t / floor:.2f}x")
        report[model] = rounds
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raymoe.tools.bench_spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--real-dir", help="folder of the full-size synthetic files (made when missing)")
    p.add_argument("--models", default=",".join(REAL_MODELS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128, help="decoded tokens a run times")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--engine", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine:
        print(json.dumps(run_engine(args.engine, args.tokens)))
        return 0
    if not args.real_dir:
        p.error("--real-dir is required")
    report = bench_spec(args.real_dir, args.models.split(","), args.repeat, args.tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
