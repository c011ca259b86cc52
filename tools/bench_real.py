"""The real-size benchmark: the full-size synthetic gpt-oss-20b and Qwen3.5-35B-A3B files of
tools.make_synthetic, run as their users run them, against llama.cpp as its users get it.

    python -m raymoe.tools.bench_real --real-dir DIR [--repeat 3] [--quick] [--json FILE]
    (also: python -m raymoe.tools.bench --sections real --real-dir DIR)

Every engine runs in a process of its own, in the default environment (nothing set for OpenMP),
after both files were dropped from the page cache, one engine at a time (a 24 GB machine):
- llama.cpp (llama-cpp-python, a default `pip install` build) with n_threads = cores, as
  llama-server defaults, and with cores / 2, llama-cpp-python's own default;
- raymoe in-process (stages.runtime.engine.LocalEngine, every core): load, load + the first answer,
  prefill, batch-1 and 4-sequence decode, peak RSS;
- raymoe as users run it: `python -m raymoe.deploy.generate` at its defaults, PP=1 and PP=2, on one
  request, and on 4 at once (generate4: the aggregate); decode tok/s = (tokens - requests) / (job time -
  TTFT), from the job's own summary line.
The rounds (--repeat) run every engine once each (every other round in reverse order, so that a
drifting host favours no engine), so ratios are taken within a round; the report
gives each figure's median and its range. It starts with the host: CPU model, cores, memory read
bandwidth with every core (median of several reads), llama.cpp's system info, and the roofline
(weight bytes a token reads / read bandwidth).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from raymoe.kernels.threads import node_cores
from raymoe.tools.timing import timed

REAL_MODELS = ("gpt-oss-20b", "qwen3.5-35b-a3b")
# deploy.generate's engines: (--pp, requests at once)
GENERATE = {"generate": (1, 1), "generate-pp2": (2, 1), "generate4": (1, 4), "generate4-pp2": (2, 4)}
ENGINES = ("llama.cpp", "llama.cpp-half", "raymoe", *GENERATE)
FIELDS = ("load_s", "first_answer_s", "peak_rss_gb", "prefill_tok_s", "decode_tok_s", "batch4_tok_s")
VOCAB = 2000          # prompt ids drawn below it: real tokens of the synthetic files' tokenizer
# targets (decode): raymoe / llama.cpp with n_threads = cores, per model; the product path / the engine; PP=2 / PP=1
ENGINE_TARGET = {"gpt-oss-20b": 1.15, "qwen3.5-35b-a3b": 1.4}
PRODUCT_TARGET = {"gpt-oss-20b": 1.1, "qwen3.5-35b-a3b": 1.3}


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def peak_rss_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def real_file(model: str, folder: str) -> str:
    path = os.path.join(folder, f"{model}.gguf")
    if not os.path.exists(path):
        print(f"writing the full-size {model} file to {path} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "raymoe.tools.make_synthetic", "--model", model, "--out", path], check=True)
    return path


def evict_from_page_cache(path: str) -> None:
    """Drops the file's pages from the page cache, so that every engine loads it from the disk and
    starts with the same free memory: else the engine that runs first pays the disk and the next
    ones read memory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)        # a file just written has dirty pages, which stay cached and are written back
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # while the next engine loads
    finally:
        os.close(fd)


# ---- the host ------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def read_bandwidth_gb_s(threads: int, reads: int = 7) -> tuple[float, float, float]:
    """Memory read speed with `threads` threads: a sum over 1 GB (far past any cache), `reads`
    times; (median, min, max) in GB/s."""
    torch.set_num_threads(threads)
    x = torch.ones(256 << 20)
    x.sum()
    speeds = sorted(x.nbytes / timed(lambda: x.sum()) / 1e9 for _ in range(reads))
    return statistics.median(speeds), speeds[0], speeds[-1]


def llama_cpp_system_info() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.llama_print_system_info().decode().strip()


def bytes_per_token(path: str) -> int:
    """Weight bytes one decoded token reads: every matrix but the embedding (one row is read), and of
    the routed experts' stacks only the share the router picks (top-k of the experts)."""
    import gguf
    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def meta(key):
        return int(reader.fields[f"{arch}.{key}"].parts[-1][0])

    share = meta("expert_used_count") / meta("expert_count")
    names = {t.name for t in reader.tensors}
    total = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        total += int(t.n_bytes * share) if "_exps." in t.name else int(t.n_bytes)
    return total


# ---- the engines, each in a process of its own -----------------------------------------------------

def bench_raymoe(path: str, n_prompt: int, n_decode: int) -> dict:
    """Load, prefill, batch-1 and 4-sequence decode in this process (PP=1, `--dtype auto`, every core)."""
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.files.loader import open_model
    from raymoe.stages.text.sampling_params import SamplingParams
    from raymoe.stages.runtime.scheduler import Scheduler

    torch.set_num_threads(node_cores())
    start = time.perf_counter()
    engine = LocalEngine(open_model(path), mode="auto", scheduler=Scheduler(max_batch_tokens=n_prompt,
                                                                            prefill_chunk=n_prompt))
    load = time.perf_counter() - start
    engine.eos_ids = set()

    def generate(n_seqs, prompt_len, n):
        for i in range(n_seqs):
            engine.add_request(i, random_ids(prompt_len, i), SamplingParams(max_tokens=n, temperature=0))
        engine.run_until_done()

    first = timed(lambda: generate(1, n_prompt, 1))      # warm-up (the first answer), as llama.cpp's below
    prefill = timed(lambda: generate(1, n_prompt, 1))
    one = timed(lambda: generate(1, 8, 1))
    decode = timed(lambda: generate(1, 8, n_decode + 1)) - one
    one_b = timed(lambda: generate(4, 8, 1))
    decode_b = timed(lambda: generate(4, 8, n_decode // 2 + 1)) - one_b
    return {"load_s": load, "first_answer_s": load + first, "peak_rss_gb": peak_rss_bytes() / 1e9,
            "prefill_tok_s": n_prompt / prefill, "decode_tok_s": n_decode / decode,
            "batch4_tok_s": 4 * (n_decode // 2) / decode_b}


def bench_llama_cpp(path: str, n_prompt: int, n_decode: int, threads: int) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    start = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=n_prompt + n_decode + 16, n_batch=n_prompt, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    load = time.perf_counter() - start
    prompt = random_ids(n_prompt, 0)
    # one whole prompt first: llama.cpp maps the file, and a first prompt would time the disk paging the
    # weights in (raymoe's load has read them all); counted in first_answer_s
    first = timed(lambda: (llm.eval(prompt), llm.sample()))
    llm.reset()
    prefill = timed(lambda: llm.eval(prompt))
    llm.reset()
    llm.eval(prompt[:8])

    def decode():
        for _ in range(n_decode):
            llm.eval([prompt[8]])
    return {"load_s": load, "first_answer_s": load + first, "peak_rss_gb": peak_rss_bytes() / 1e9,
            "prefill_tok_s": n_prompt / prefill, "decode_tok_s": n_decode / timed(decode), "batch4_tok_s": None}


SUMMARY = re.compile(r"(\d+) generated tokens in ([\d.]+) s.*TTFT p50 (\d+) ms; stages busy ([\d%/]+)")


def bench_generate(path: str, n_decode: int, pp: int, sequences: int = 1) -> dict:
    """`python -m raymoe.deploy.generate` at its defaults (and --pp) on `sequences` requests of an 8-token prompt
    and n_decode + 1 new tokens each, as a user runs it: its own local Ray cluster, its summary line.
    decode_tok_s counts every sequence's tokens after its first (the requests start together)."""
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "in.jsonl"), os.path.join(d, "out.jsonl")
        with open(src, "w") as f:
            for i in range(sequences):
                f.write(json.dumps({"id": i, "prompt_token_ids": random_ids(8, i), "max_tokens": n_decode + 1,
                                    "temperature": 0, "ignore_eos": True}) + "\n")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "raymoe.deploy.generate", "--model", path, "--input", src,
                               "--output", out, "--pp", str(pp)], capture_output=True, text=True)
        wall = time.perf_counter() - start
    match = SUMMARY.search(proc.stderr)
    if proc.returncode or not match:
        raise RuntimeError(f"deploy.generate failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    tokens, elapsed, ttft = int(match[1]), float(match[2]), int(match[3]) / 1000
    # stages_busy: the share of the job each stage computed; the rest of a PP=1 step is the Ray path's cost
    return {"load_s": wall - elapsed, "decode_tok_s": (tokens - sequences) / (elapsed - ttft),
            "stages_busy": match[4]}


def run_engine(spec: str, quick: bool) -> dict | None:
    """One engine on one file (the child process's work): ENGINE:PATH."""
    engine, path = spec.split(":", 1)
    # 128 decode tokens: `deploy.generate` is timed from its first token after the load, the engine in process
    # after two prefills, and a job's first 32 tokens decoded 1-7% slower than its later ones (2026-12-04)
    n_prompt, n_decode = (64, 8) if quick else (512, 128)
    cores = node_cores()
    if engine == "raymoe":
        return bench_raymoe(path, n_prompt, n_decode)
    if engine.startswith("llama.cpp"):
        return bench_llama_cpp(path, n_prompt, n_decode, cores if engine == "llama.cpp" else max(1, cores // 2))
    pp, sequences = GENERATE[engine]
    # several sequences decode half the tokens each, as the in-process batch4 figure
    return bench_generate(path, n_decode // 2 if sequences > 1 else n_decode, pp, sequences)


def run_in_child(engine: str, path: str, folder: str, quick: bool) -> dict | str:
    return run_child(["raymoe.tools.bench_real", "--engine", f"{engine}:{path}"] + (["--quick"] if quick else []), folder)


def run_child(module_args: list[str], folder: str) -> dict | str:
    """`python -m MODULE_ARGS` in the default environment after the full-size files of `folder` left the page cache:
    the JSON object its output ends with, "not installed" where that is null, else what ended it (child_failure)."""
    for model in REAL_MODELS:      # the other file's pages too: they would be reclaimed during the load
        cached = os.path.join(folder, f"{model}.gguf")
        if os.path.exists(cached):
            evict_from_page_cache(cached)
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}     # the default environment
    proc = subprocess.run([sys.executable, "-m", *module_args], capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{") or line == "null"]
    result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    if result is None:
        return "not installed" if proc.returncode == 0 else child_failure(proc.returncode, proc.stderr)
    return result


def child_failure(returncode: int, stderr: str) -> str:
    """What ended an engine's child: the signal that killed it (a default llama.cpp build dies of SIGILL in its
    AMX product on some AMX hosts), else the last line it wrote."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return (stderr.strip().splitlines() or [f"exit status {returncode}"])[-1]


# ---- the report ------------------------------------------------------------------------------------

def spread(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.2f}" if len(values) == 1 else f"{med:.2f} ({min(values):.2f}-{max(values):.2f})"


def ratio_line(name: str, rounds: list[dict], a: str, b: str, target: float | None) -> str:
    values = [r[a]["decode_tok_s"] / r[b]["decode_tok_s"] for r in rounds
              if isinstance(r.get(a), dict) and isinstance(r.get(b), dict)]
    if not values:
        return f"  {name}: -"
    goal = f"  (target >= {target})" if target else ""
    return f"  {name}: {spread(values)}x{goal}"


def bench_real(folder: str, quick: bool, repeat: int = 3) -> dict:
    cores = node_cores()
    bw, bw_lo, bw_hi = read_bandwidth_gb_s(cores)
    print(f"host: {cpu_model()}, {cores} cores; memory read {bw:.1f} GB/s with {cores} threads "
          f"(median of 7 reads, {bw_lo:.1f}-{bw_hi:.1f})")
    info = llama_cpp_system_info()
    print(f"llama.cpp: {info or 'not installed (pip install llama-cpp-python)'}")
    report = {"host": {"cpu": cpu_model(), "cores": cores, "read_gb_s": [bw, bw_lo, bw_hi]}, "llama_cpp": info}
    for model in REAL_MODELS:
        path = real_file(model, folder)
        per_token = bytes_per_token(path)
        roof = bw * 1e9 / per_token
        print(f"\n== {model} ({os.path.getsize(path) / 1e9:.1f} GB; a token reads {per_token / 1e9:.2f} GB of "
              f"weights: roofline {roof:.1f} tok/s); prefill {64 if quick else 512} tokens; {repeat} rounds")
        rounds = []
        for i in range(repeat):
            # every other round in reverse: a host that drifts within a round favours neither end of the list
            order = ENGINES if i % 2 == 0 else ENGINES[::-1]
            rounds.append({engine: run_in_child(engine, path, folder, quick) for engine in order})
            busy = {e: r["stages_busy"] for e, r in rounds[-1].items() if isinstance(r, dict) and "stages_busy" in r}
            print(f"  round {i + 1}: stages busy {busy}; " + ", ".join(
                f"{e} {r['decode_tok_s']:.2f}" if isinstance(r, dict) else f"{e} ({r})" for e, r in rounds[-1].items())
                + " decode tok/s", flush=True)
        print(f"{'engine':<15}" + "".join(f"{f:>22}" for f in FIELDS) + f"{'of roofline':>14}")
        for engine in ENGINES:
            got = [r[engine] for r in rounds if isinstance(r[engine], dict)]
            if not got:
                print(f"{engine:<15}  {rounds[-1][engine]}")
                continue
            decode = statistics.median(g["decode_tok_s"] for g in got)
            batch_1 = GENERATE.get(engine, (1, 1))[1] == 1
            share = f"{100 * decode / roof:>13.0f}%" if batch_1 else ""
            print(f"{engine:<15}" + "".join(f"{spread([g.get(f) for g in got]):>22}" for f in FIELDS) + share)
        print("decode ratios (median of rounds, range):")
        print(ratio_line("raymoe engine / llama.cpp (n_threads = cores)", rounds, "raymoe", "llama.cpp",
                         ENGINE_TARGET[model]))
        print(ratio_line("raymoe engine / llama.cpp (n_threads = cores / 2)", rounds, "raymoe", "llama.cpp-half", None))
        print(ratio_line("deploy.generate defaults / llama.cpp (cores)", rounds, "generate", "llama.cpp",
                         PRODUCT_TARGET[model]))
        print(ratio_line("deploy.generate defaults / raymoe engine", rounds, "generate", "raymoe", 0.95))
        print(ratio_line("deploy.generate --pp 2 / --pp 1", rounds, "generate-pp2", "generate", 0.9))
        print(ratio_line("deploy.generate, 4 sequences, --pp 2 / --pp 1", rounds, "generate4-pp2", "generate4", 1.0))
        report[model] = {"bytes_per_token": per_token, "roofline_tok_s": roof, "rounds": rounds}
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raymoe.tools.bench_real", description=__doc__.split("\n\n")[0])
    p.add_argument("--real-dir", help="folder for the full-size synthetic files (made when missing; ~28 GB)")
    p.add_argument("--repeat", type=int, default=3, help="rounds of every engine (default 3)")
    p.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run, numbers are rough)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--engine", help=argparse.SUPPRESS)       # ENGINE:PATH, JSON out (internal)
    args = p.parse_args(argv)
    if args.engine:
        print(json.dumps(run_engine(args.engine, args.quick)))
        return 0
    if not args.real_dir:
        p.error("--real-dir is required (a folder with room for ~28 GB of model files)")
    report = bench_real(args.real_dir, args.quick, args.repeat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
