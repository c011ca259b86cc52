"""How much of a CPU decode step runs inside the compiled libraries (docs/compiled-step.md).

    python -m raymoe.tools.c_time --model PATH [--tokens 40] [--sequences 1] [--threads 2] [--mode auto] [--separate]

Every function of the compiled libraries (kernels/csrc) that Python calls is wrapped in a timer; the in-process
engine then runs `sequences` requests of 8-token prompts and one token each, and the same with `tokens` + 1 tokens
each: the difference is `tokens` decode steps of `sequences` sequences. --separate makes every layer's calls from
Python, as without kernels/token_calls.py. Prints a step's time, each function's share (a call that calls
others from C counts them inside) and the time outside every call: Python, torch and the engine's own work. Each
timer costs about a microsecond a call.
"""
from __future__ import annotations

import argparse
import ctypes
import time
from collections import defaultdict

import torch


def _libraries() -> list:
    """The compiled libraries a step calls into, loaded (and their functions' argument types set)."""
    from raymoe.kernels import attention, blocks, deltanet, native, norms, rope, token_calls
    token_calls.library()
    native.int8_rows()
    native.f32_gemm()
    return [lib for lib in (blocks.library(), norms._library(), native.few_rows(), deltanet.library(),
                            attention._library(), rope._library()) if lib is not None]


def wrap_calls(totals: dict, counts: dict):
    """Replaces each loaded library function that Python has set up (its ctypes object cached on the library)
    by one that adds its time and a count under its name; returns the function that puts them back."""
    wrapped = []
    for lib in _libraries():
        for name, fn in list(vars(lib).items()):
            if not (name.startswith("raymoe_") and isinstance(fn, ctypes._CFuncPtr)):
                continue

            def timed(*args, fn=fn, name=name):
                start = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    totals[name] += time.perf_counter() - start
                    counts[name] += 1
            setattr(lib, name, timed)
            wrapped.append((lib, name, fn))

    def unwrap():
        for lib, name, fn in wrapped:
            setattr(lib, name, fn)
    return unwrap


def measure(path: str, tokens: int, sequences: int = 1, threads: int = 2, mode: str = "auto",
            separate: bool = False) -> dict:
    """{"step_s": a decode step's time, "calls": {function: (seconds, calls) a step}, "outside_s": the rest}."""
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.layers.block import Block
    from raymoe.stages.files.loader import open_model
    from raymoe.stages.text.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    totals, counts = defaultdict(float), defaultdict(int)
    unwrap, token_calls = wrap_calls(totals, counts), Block._token_calls
    try:
        engine = LocalEngine(open_model(path), mode=mode)
        engine.eos_ids = set()
        if separate:
            Block._token_calls = lambda self, x: (None, None)

        def generate(n: int) -> tuple[float, dict, dict]:
            totals.clear()
            counts.clear()
            for i in range(sequences):
                engine.add_request(i, list(range(100 + i, 108 + i)), SamplingParams(max_tokens=n, temperature=0))
            start = time.perf_counter()
            engine.run_until_done()
            return time.perf_counter() - start, dict(totals), dict(counts)

        generate(4)         # warm up: the libraries' first calls, the layers' calls made
        one, one_t, one_n = generate(1)
        many, many_t, many_n = generate(tokens + 1)
    finally:
        unwrap()
        Block._token_calls = token_calls
    step = (many - one) / tokens
    calls = {name: ((many_t[name] - one_t.get(name, 0)) / tokens, (many_n[name] - one_n.get(name, 0)) / tokens)
             for name in many_t}
    return {"step_s": step, "calls": calls, "outside_s": step - sum(t for t, _ in calls.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raymoe.tools.c_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file or HF folder")
    p.add_argument("--tokens", type=int, default=40, help="decode steps measured (default 40)")
    p.add_argument("--sequences", type=int, default=1, help="sequences decoding together (default 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", default="auto", help="--dtype of the engine (default auto)")
    p.add_argument("--separate", action="store_true", help="each layer's calls from Python (no token_calls)")
    args = p.parse_args(argv)
    r = measure(args.model, args.tokens, args.sequences, args.threads, args.mode, args.separate)
    step = r["step_s"]
    print(f"decode step {step * 1e3:.1f} ms ({args.tokens} steps of {args.sequences} sequences, {args.threads} "
          f"threads, {args.mode}{', separate calls' if args.separate else ''})")
    for name, (t, n) in sorted(r["calls"].items(), key=lambda item: -item[1][0]):
        if n > 0:
            print(f"  {name:<28} {t * 1e3:7.2f} ms {100 * t / step:5.1f}%  {n:6.1f} calls a step")
    print(f"  {'outside the calls':<28} {r['outside_s'] * 1e3:7.2f} ms {100 * r['outside_s'] / step:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
