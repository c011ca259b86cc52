"""What structured outputs cost decode: 16 sequences of one chat prompt decoding 64 tokens each in-process
(stages.runtime.engine.LocalEngine), unconstrained (ignore_eos, so every one runs all 64) against constrained by a
JSON schema that cannot end within 64 tokens (so the batches are the same size), in alternating rounds.

    python -m raymoe.tools.bench_structured [--model tiny-qwen35moe] [--sequences 16] [--tokens 64] [--rounds 3]
                                     [--mode float32] [--threads 1]

It prints each round's decode tokens per second (of wall time, and of the process's CPU time at the median
step, which other work on a shared machine disturbs less) and the loss, by the median of the rounds. Torch
runs on one thread by default, so that CPU time is the work done (llguidance's mask threads included); a
real-size file is measured as users run it with `--mode auto --threads N`. The difference is the grammar's work on
the last stage: a matcher per sequence advanced by its last token, the mask of each sampled row, and the
history each step carries.
"""
import argparse
import statistics
import time

import torch

from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.requests import chat_prompt
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.stages.text.structured import output_grammar

# an array of at least 200 short strings: no answer ends within the benchmark's tokens
LONG = {"type": "array", "minItems": 200, "items": {"type": "string", "maxLength": 12}}


def rate(model, ids, n: int, tokens: int, grammar: str | None, mode: str = "float32") -> tuple[float, float]:
    """Decode tokens per second: of wall time over the whole decode, and of this process's CPU time at the
    median step (each step decodes one token of every sequence), which other work on a shared machine
    disturbs far less."""
    engine = LocalEngine(model, 1, mode)
    for i in range(n):
        engine.add_request(i, ids, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, grammar=grammar,
                                                  ignore_eos=grammar is None))
    engine.step()                       # the prefill (and first tokens): not decode
    wall, steps = time.perf_counter(), []
    while engine.has_work():
        start = time.process_time()
        engine.step()
        steps.append(time.process_time() - start)
    return n * len(steps) / (time.perf_counter() - wall), n / statistics.median(steps)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen35moe")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", default="float32", choices=("float32", "auto", "int8"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = open_model(args.model)
    tok = model.tokenizer
    ids = tok.encode(chat_prompt([{"role": "user", "content": "List words."}], tok, {"enable_thinking": False}))
    grammar = output_grammar(tok, ids, LONG, None)
    plain, constrained = [], []
    rate(model, ids, 2, 4, grammar, args.mode)     # warm up (compiled kernels, llguidance's tokenizer)
    for r in range(args.rounds):
        plain.append(rate(model, ids, args.sequences, args.tokens, None, args.mode))
        constrained.append(rate(model, ids, args.sequences, args.tokens, grammar, args.mode))
        print(f"round {r + 1}: unconstrained {plain[-1][0]:.1f} tok/s ({plain[-1][1]:.1f} per CPU s at the median step), "
              f"json_schema {constrained[-1][0]:.1f} tok/s ({constrained[-1][1]:.1f} per CPU s at the median step)")
    for i, what in enumerate(("wall time", "CPU time at the median step")):
        a, b = statistics.median(p[i] for p in plain), statistics.median(c[i] for c in constrained)
        print(f"median of rounds, by {what}: unconstrained {a:.1f} tok/s, json_schema {b:.1f} tok/s, "
              f"loss {100 * (1 - b / a):.1f}% ({args.sequences} sequences, {args.model})")


if __name__ == "__main__":
    main()
