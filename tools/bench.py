"""Benchmark: raymoe against its peers on the same model files, and the cluster's scaling.

    python -m raymoe.tools.bench [--quick] [--repeat N] [--json FILE] [--plot FILE.png] [--real-dir DIR]
                           [--sections engines,pp,hops,coordinator,real]

Builds (once, cached under RAYMOE_CACHE) a synthetic qwen35moe of hidden 1024, 8 layers,
32 experts top-4, expert FF 512, 32k vocabulary (~450M parameters, ~90M active) as F32 and
Q8_0 GGUF, and a gpt-oss of similar size with MXFP4 experts. Then, in one run:
- engines: prefill tok/s (512-token prompt), batch-1 decode tok/s (128 tokens) and aggregate
  decode tok/s with 16 concurrent sequences, for raymoe on each file, llama.cpp (through
  llama-cpp-python, if installed: `make bench-deps`) on the same files, and HF transformers;
- pp: aggregate decode tok/s of PP=1, 2, 4 on the Ray cluster with 16 sequences in flight,
  each stage actor's peak RSS next to its weight bytes;
- hops: per-hop latency of each transport (object_store, gloo, shm) for decode-sized (1 and 64
  rows) and a prefill-sized activation, next to a memcpy of the same bytes; and PP=2 decode tok/s of
  the embedded tiny-qwen35moe over each transport (1 and 16 sequences);
- coordinator: the coordinator actor's CPU time per step with 64 running sequences on a
  248k-token vocabulary, greedy and sampled;
- real (only when named): tools/bench_real.py, the full-size files of the released shapes run as
  users run them (deploy.generate at its defaults, PP=1 and 2), the engine in-process, and
  llama.cpp at n_threads = cores and cores / 2, in rounds (at least 3).
Machines are noisy: only ratios measured in one run mean anything, and every report prints the
host's memory read speed beside its figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from raymoe.tools.timing import timed
from raymoe.tools.make_tiny import CACHE_DIR, gptoss_config, gptoss_tensors, qwen35moe_config, qwen35moe_tensors

QWEN_SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
                  linear_num_value_heads=8, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
                  shared_expert_intermediate_size=512, vocab_size=32000)
GPTOSS_SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                    head_dim=64, intermediate_size=512, num_local_experts=32, num_experts_per_tok=4,
                    experts_per_token=4, sliding_window=128, vocab_size=32000,
                    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(8)])
VOCAB = 32000
THREADS = 2


def build_model(name: str, arch: str, make_config, make_tensors, shape: dict, gguf_types: list[str]) -> dict:
    """{"hf": dir, "<type>": gguf path} for a bench model, built once and cached."""
    from safetensors.torch import save_file

    from raymoe.deploy.convert import convert
    from raymoe.tools.tiny_tokenizer import build_tiny_tokenizer

    root = os.path.join(CACHE_DIR, f"bench-{name}-v2")
    hf = os.path.join(root, "hf")
    if not os.path.exists(os.path.join(hf, "model.safetensors")):
        os.makedirs(hf, exist_ok=True)
        print(f"building {name} ...", file=sys.stderr)
        build_tiny_tokenizer(hf, arch)
        config = {**make_config(shape["vocab_size"]), **shape}
        with open(os.path.join(hf, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        save_file(make_tensors(config, 0), os.path.join(hf, "model.safetensors.tmp"), metadata={"format": "pt"})
        os.replace(os.path.join(hf, "model.safetensors.tmp"), os.path.join(hf, "model.safetensors"))
    files = {"hf": hf}
    for kind in gguf_types:
        path = os.path.join(root, f"{name}-{kind}.gguf")
        if not os.path.exists(path):
            print(f"converting {name} to {kind} ...", file=sys.stderr)
            convert(hf, path, kind, progress=False)
        files[kind] = path
    return files


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- engines ---------------------------------------------------------------------------------

def bench_raymoe(path: str, n_prompt: int, n_decode: int, batch: int, mode: str = "float32") -> dict:
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.files.loader import open_model
    from raymoe.stages.text.sampling_params import SamplingParams
    from raymoe.stages.runtime.scheduler import Scheduler

    engine = LocalEngine(open_model(path), mode=mode, scheduler=Scheduler(max_batch_tokens=n_prompt,
                                                                  prefill_chunk=n_prompt))
    engine.eos_ids = set()

    def generate(n_seqs, prompt_len, n):
        for i in range(n_seqs):
            engine.add_request(i, random_ids(prompt_len, i), SamplingParams(max_tokens=n, temperature=0))
        engine.run_until_done()

    generate(1, n_prompt, 2)                # warm-up at full size, as for every engine: steady state is timed
    prefill = timed(lambda: generate(1, n_prompt, 1))
    one = timed(lambda: generate(1, 8, 1))
    decode = timed(lambda: generate(1, 8, n_decode + 1)) - one
    one_b = timed(lambda: generate(batch, 8, 1))
    decode_b = timed(lambda: generate(batch, 8, n_decode // 4 + 1)) - one_b
    return {"prefill_tok_s": n_prompt / prefill, "decode_tok_s": n_decode / decode,
            "batch16_tok_s": batch * (n_decode // 4) / decode_b}


def bench_llama_cpp(path: str, n_prompt: int, n_decode: int) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_ctx=n_prompt + n_decode + 16, n_batch=n_prompt, n_threads=THREADS,
                n_threads_batch=THREADS, verbose=False)
    prompt = random_ids(n_prompt, 0)
    llm.eval(prompt)
    llm.reset()
    prefill = timed(lambda: llm.eval(prompt))
    llm.reset()
    llm.eval(prompt[:8])
    token = prompt[8]

    def decode():
        for _ in range(n_decode):
            llm.eval([token])
    return {"prefill_tok_s": n_prompt / prefill, "decode_tok_s": n_decode / timed(decode), "batch16_tok_s": None}


def bench_transformers(hf_dir: str, n_prompt: int, n_decode: int) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([random_ids(n_prompt, 0)])

    def generate(x, n):
        with torch.inference_mode():
            model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    generate(ids[:, :16], 2)
    with torch.inference_mode():
        model(ids)
        prefill = timed(lambda: model(ids))
    one = timed(lambda: generate(ids[:, :8], 1))
    decode = timed(lambda: generate(ids[:, :8], n_decode + 1)) - one
    return {"prefill_tok_s": n_prompt / prefill, "decode_tok_s": n_decode / decode, "batch16_tok_s": None}


# raymoe-f32 is the exact float32 mode; the Q8_0 and MXFP4 files run in their own format (`--dtype auto`);
# raymoe-int8 requantises the F32 file to int8 rows
RAYMOE_DTYPES = {"raymoe-f32": "float32", "raymoe-q8_0": "auto", "raymoe-int8": "int8", "raymoe-gptoss-mxfp4": "auto"}
FLOAT32_ENGINES = {name for name, dtype in RAYMOE_DTYPES.items() if dtype == "float32"}
ENGINES = ["raymoe-f32", "raymoe-q8_0", "raymoe-int8", "llama.cpp-f32", "llama.cpp-q8_0", "transformers-f32",
           "raymoe-gptoss-mxfp4", "llama.cpp-gptoss-mxfp4"]


def run_engine(name: str, quick: bool) -> dict | None:
    """One engine's numbers, measured in this process."""
    torch.set_num_threads(THREADS)
    n_prompt, n_decode = (128, 32) if quick else (512, 128)
    qwen = build_model("qwen35moe", "qwen35moe", qwen35moe_config, qwen35moe_tensors, QWEN_SHAPE, ["f32", "q8_0"])
    oss = build_model("gptoss", "gptoss", gptoss_config, gptoss_tensors, GPTOSS_SHAPE, ["f32"])
    runs = {
        "raymoe-f32": lambda: bench_raymoe(qwen["f32"], n_prompt, n_decode, 16, RAYMOE_DTYPES["raymoe-f32"]),
        "raymoe-q8_0": lambda: bench_raymoe(qwen["q8_0"], n_prompt, n_decode, 16, RAYMOE_DTYPES["raymoe-q8_0"]),
        "raymoe-int8": lambda: bench_raymoe(qwen["f32"], n_prompt, n_decode, 16, RAYMOE_DTYPES["raymoe-int8"]),
        "llama.cpp-f32": lambda: bench_llama_cpp(qwen["f32"], n_prompt, n_decode),
        "llama.cpp-q8_0": lambda: bench_llama_cpp(qwen["q8_0"], n_prompt, n_decode),
        "transformers-f32": lambda: bench_transformers(qwen["hf"], n_prompt, n_decode),
        "raymoe-gptoss-mxfp4": lambda: bench_raymoe(oss["f32"], n_prompt, n_decode, 16, RAYMOE_DTYPES["raymoe-gptoss-mxfp4"]),
        "llama.cpp-gptoss-mxfp4": lambda: bench_llama_cpp(oss["f32"], n_prompt, n_decode),
    }
    return runs[name]()


FIELDS = ("prefill_tok_s", "decode_tok_s", "batch16_tok_s")


def run_engine_process(name: str, quick: bool) -> dict | str | None:
    """One engine's numbers from a fresh process of its own (thread pools left spinning by one
    engine, OpenMP, OpenBLAS or ggml, must not slow the next); an error line, or None when
    llama-cpp-python is missing."""
    import subprocess

    from raymoe.kernels.native import blas_has_own_threads

    cmd = [sys.executable, "-m", "raymoe.tools.bench", "--engine", name] + (["--quick"] if quick else [])
    # OpenMP workers spin, which suits a process that has the cores to itself, except where float32
    # products run on BLAS's own threads (kernels/native.py)
    passive = name in FLOAT32_ENGINES and blas_has_own_threads()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE" if passive else "ACTIVE"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{") or line == "null"]
    if proc.returncode != 0 or not lines:
        return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(lines[-1])


def bench_engines(quick: bool, repeat: int = 1) -> dict:
    """Each figure is the median of `repeat` rounds; a round runs every engine once, so that a slow
    spell of this shared machine lands on all engines alike."""
    import statistics

    n_prompt, n_decode = (128, 32) if quick else (512, 128)
    for kind in ("qwen35moe", "gptoss"):        # build the files once, before any timing
        build_model(kind, kind, *((qwen35moe_config, qwen35moe_tensors, QWEN_SHAPE, ["f32", "q8_0"])
                                  if kind == "qwen35moe" else (gptoss_config, gptoss_tensors, GPTOSS_SHAPE, ["f32"])))
    rounds = {name: [] for name in ENGINES}
    problems = {}
    for i in range(repeat):
        print(f"round {i + 1} of {repeat} ...", file=sys.stderr)
        for name in ENGINES:
            r = run_engine_process(name, quick)
            if isinstance(r, dict):
                rounds[name].append(r)
            else:
                problems[name] = r or "(llama-cpp-python is not installed: make bench-deps)"
    results = {name: {k: (statistics.median(r[k] for r in runs) if runs[0][k] is not None else None) for k in FIELDS}
               for name, runs in rounds.items() if runs}
    print(f"\n== engines: {THREADS} threads; prefill {n_prompt} tokens, decode {n_decode} tokens, batch of 16; "
          f"median of {repeat} round(s)")
    print(f"{'engine':<26}{'prefill tok/s':>15}{'decode tok/s':>15}{'batch16 tok/s':>15}")
    for name in ENGINES:
        if name in results:
            r = results[name]
            print(f"{name:<26}" + "".join(f"{r[k]:>15.1f}" if r[k] is not None else f"{'-':>15}" for k in FIELDS))
        else:
            print(f"{name:<26}  {problems.get(name, '?')}")
    print_ratios(results)
    return results


def print_ratios(r: dict):
    def ratio(a, b, key):
        if a in r and b in r and r[a][key] and r[b][key]:
            return f"{r[a][key] / r[b][key]:.2f}x"
        return "n/a"
    print("ratios (targets in parentheses):")
    print(f"  decode  raymoe-f32 / llama.cpp-f32   {ratio('raymoe-f32', 'llama.cpp-f32', 'decode_tok_s')}  (>= 1.0)")
    print(f"  decode  raymoe-q8_0 / llama.cpp-q8_0 {ratio('raymoe-q8_0', 'llama.cpp-q8_0', 'decode_tok_s')}  (>= 0.7)")
    print(f"  prefill raymoe-f32 / llama.cpp-f32   {ratio('raymoe-f32', 'llama.cpp-f32', 'prefill_tok_s')}  (>= 1.5)")
    if "raymoe-f32" in r:
        x = r["raymoe-f32"]
        print(f"  batch16 / batch-1 decode (raymoe-f32) {x['batch16_tok_s'] / x['decode_tok_s']:.2f}x  (>= 5)")
    print(f"  decode  raymoe-f32 / transformers     {ratio('raymoe-f32', 'transformers-f32', 'decode_tok_s')}  (>= 2)")
    print(f"  prefill raymoe-f32 / transformers     {ratio('raymoe-f32', 'transformers-f32', 'prefill_tok_s')}  (>= 1)")
    print("approximate modes, for reference (raymoe-q8_0 and raymoe-gptoss-mxfp4 run --dtype auto):")
    for a, b, key in (("raymoe-int8", "llama.cpp-f32", "prefill_tok_s"), ("raymoe-int8", "llama.cpp-f32", "decode_tok_s"),
                      ("raymoe-q8_0", "llama.cpp-q8_0", "prefill_tok_s"),
                      ("raymoe-gptoss-mxfp4", "llama.cpp-gptoss-mxfp4", "prefill_tok_s"),
                      ("raymoe-gptoss-mxfp4", "llama.cpp-gptoss-mxfp4", "decode_tok_s")):
        print(f"  {key.split('_')[0]:<7} {a} / {b}  {ratio(a, b, key)}")
    if "raymoe-q8_0" in r:
        x = r["raymoe-q8_0"]
        print(f"  batch16 / batch-1 decode (raymoe-q8_0) {x['batch16_tok_s'] / x['decode_tok_s']:.2f}x")


def read_bandwidth_gb_s() -> float:
    """This host's memory read speed with the benchmark's threads: a plain sum over 256 MB, best of 5.
    Figures from hosts that read at different speeds are not comparable; every report prints it."""
    torch.set_num_threads(THREADS)
    x = torch.ones(64 << 20)
    return x.nbytes / min(timed(lambda: x.sum()) for _ in range(5)) / 1e9


# ---- cluster ---------------------------------------------------------------------------------

def bench_pipeline(path: str, quick: bool) -> tuple[dict, dict]:
    """Aggregate decode throughput of PP=1/2/4 with 16 concurrent sequences, and stage memory."""
    from raymoe.cluster.engine import ClusterEngine, EngineArgs

    n_seqs, n_tokens = 16, (8 if quick else 32)
    requests = [(i, {"prompt_token_ids": random_ids(16, i), "max_tokens": n_tokens, "temperature": 0})
                for i in range(n_seqs)]
    tok_s, rss = {}, {}
    print(f"\n== pipeline: {n_seqs} sequences x {n_tokens} tokens, 1 torch thread per stage actor")
    for pp in (1, 2, 4):
        engine = ClusterEngine(EngineArgs(path, pp=pp, threads=1))
        try:
            for batch in (requests[:pp], requests):            # warm-up, then the measured run
                start = time.perf_counter()
                engine.submit_many(batch)
                done = 0
                while done < len(batch):
                    done += len(engine.wait_finished(5))
            tok_s[str(pp)] = n_seqs * n_tokens / (time.perf_counter() - start)
            rss[str(pp)] = [{"layers": s["layers"], "weights_mb": s["parameter_bytes"] / 2**20,
                             "caches_mb": s["peak_cache_bytes"] / 2**20, "peak_rss_mb": s["peak_rss_bytes"] / 2**20}
                            for s in engine.stats()["stages"]]
        finally:
            engine.shutdown()
        print(f"PP={pp}: {tok_s[str(pp)]:8.1f} tok/s  ({tok_s[str(pp)] / tok_s['1']:.2f}x PP=1)   "
              "stage peak RSS / (weights + caches) (MB): " +
              ", ".join(f"{r['peak_rss_mb']:.0f}/({r['weights_mb']:.0f}+{r['caches_mb']:.0f}) = "
                        f"{r['peak_rss_mb'] / (r['weights_mb'] + r['caches_mb']):.2f}x" for r in rss[str(pp)]))
    return tok_s, rss


def bench_coordinator(quick: bool) -> dict:
    """The coordinator's CPU time per step with 64 running sequences on a 248k-token vocabulary (the tiny
    qwen35moe shape, vocabulary padded to Qwen3.5's): what it costs to own the sequences while the last
    stage samples. Greedy and sampled (temperature 1, top-p 0.9)."""
    from raymoe.cluster.engine import ClusterEngine, EngineArgs
    from raymoe.tools.make_tiny import qwen35moe_config, qwen35moe_tensors

    path = build_model("qwen35moe-248k", "qwen35moe", qwen35moe_config, qwen35moe_tensors,
                       {"vocab_size": 248320}, ["f32"])["f32"]
    n_seqs, n_tokens = 64, (8 if quick else 32)
    print(f"\n== coordinator: {n_seqs} sequences x {n_tokens} tokens, vocabulary 248320, PP=1, 4 micro-batch groups")
    out = {}
    engine = ClusterEngine(EngineArgs(path, pp=1, threads=1, max_running=n_seqs, max_model_len=512))
    try:
        for name, sampling in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 1.0, "top_p": 0.9})):
            requests = [(i, {"prompt_token_ids": random_ids(8, i), "max_tokens": n_tokens, "ignore_eos": True,
                             "seed": i, **sampling}) for i in range(n_seqs)]
            before, start = engine.stats(), time.perf_counter()
            engine.submit_many(requests)
            done = 0
            while done < n_seqs:
                done += len(engine.wait_finished(5))
            after, wall = engine.stats(), time.perf_counter() - start
            steps = after["steps"] - before["steps"]
            out[name] = {"cpu_ms_per_step": 1000 * (after["cpu_s"] - before["cpu_s"]) / steps,
                         "tok_s": n_seqs * n_tokens / wall}
            print(f"{name:<8} coordinator CPU {out[name]['cpu_ms_per_step']:6.2f} ms/step   "
                  f"{out[name]['tok_s']:7.1f} tok/s")
    finally:
        engine.shutdown()
    return out


def bench_hops(quick: bool) -> dict:
    from raymoe.tools.hops import measure_hops

    hidden = QWEN_SHAPE["hidden_size"]
    shapes = {f"decode 1x{hidden}": (1, hidden), f"decode 64x{hidden}": (64, hidden),
              f"prefill 512x{hidden}": (512, hidden)}
    hops = measure_hops(shapes, 10 if quick else 30)
    print("\n== transports: median per-hop time (us), float32 activations; call: actor calls included, "
          "oneway: the transfer alone (half a ping-pong)")
    print(f"{'activation':<20}{'bytes':>10}{'memcpy':>10}{'object_store':>14}{'gloo':>10}{'shm':>10}"
          f"{'gloo oneway':>13}{'shm oneway':>12}")
    for name, h in hops.items():
        print(f"{name:<20}{h['bytes']:>10}{1000 * h['memcpy_ms']:>10.1f}{1000 * h['object_store_ms']:>14.1f}"
              f"{1000 * h['gloo_ms']:>10.1f}{1000 * h['shm_ms']:>10.1f}{1000 * h['gloo_oneway_ms']:>13.1f}"
              f"{1000 * h['shm_oneway_ms']:>12.1f}")
    return {name: {k.replace("_ms", "_us"): (v * 1000 if k.endswith("_ms") else v) for k, v in h.items()}
            for name, h in hops.items()}


def bench_transports(quick: bool) -> dict:
    """End to end: decode tok/s of a PP=2 pipeline of the embedded tiny-qwen35moe (hidden 128, where the hops
    weigh most) over each transport, for 1 and 16 sequences; medians of 3 runs after a warm-up."""
    import statistics

    from raymoe.cluster.engine import ClusterEngine, EngineArgs

    n_tokens = 16 if quick else 64
    print(f"\n== transports end to end: PP=2, tiny-qwen35moe, decode tok/s ({n_tokens} tokens per sequence)")
    out = {}
    for transport in ("object_store", "gloo", "shm"):
        engine = ClusterEngine(EngineArgs("tiny-qwen35moe", pp=2, threads=1, transport=transport))
        try:
            rates = {}
            for n_seqs in (1, 16):
                requests = [(i, {"prompt_token_ids": [t % engine.config.vocab for t in random_ids(8, i)],
                                 "max_tokens": n_tokens,
                                 "ignore_eos": True, "temperature": 0}) for i in range(n_seqs)]
                runs = []
                for _ in range(4):      # a warm-up, then 3 measured
                    start = time.perf_counter()
                    engine.submit_many(requests)
                    done = 0
                    while done < n_seqs:
                        done += len(engine.wait_finished(5))
                    runs.append(n_seqs * n_tokens / (time.perf_counter() - start))
                rates[f"batch{n_seqs}_tok_s"] = statistics.median(runs[1:])
            out[transport] = rates
        finally:
            engine.shutdown()
        print(f"{transport:<14}batch 1 {rates['batch1_tok_s']:8.1f} tok/s   "
              f"16 sequences {rates['batch16_tok_s']:8.1f} tok/s")
    return out


def plot(report: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in report.get("engines", {}).items():
        if name.startswith("raymoe") and r.get("batch16_tok_s"):
            a.plot([1, 16], [r["decode_tok_s"], r["batch16_tok_s"]], marker="o",
                   label=f"{name} (--dtype {RAYMOE_DTYPES[name]})")
    a.set(xlabel="concurrent sequences", ylabel="decode tok/s", title="raymoe decode throughput", xscale="log")
    a.legend()
    pp = report.get("pp_tok_s", {})
    b.bar(list(pp), list(pp.values()))
    b.set(xlabel="pipeline stages (PP)", ylabel="aggregate tok/s (16 sequences)", title="pipeline scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raymoe.tools.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run, numbers are rough)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="draw throughput against concurrency and PP degree into this PNG")
    p.add_argument("--sections", default="engines,pp,hops")
    p.add_argument("--repeat", type=int, default=1, help="rounds of the engines section; figures are medians")
    p.add_argument("--real-dir", default=None,
                   help="section real: folder for the full-size synthetic files (made when missing; ~28 GB)")
    p.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)    # one engine, JSON out (internal)
    args = p.parse_args(argv)
    if args.engine:
        print(json.dumps(run_engine(args.engine, args.quick)))
        return 0
    sections = set(args.sections.split(","))
    report = {"read_gb_s": read_bandwidth_gb_s()}
    print(f"{os.cpu_count()} cores; this host reads memory at {report['read_gb_s']:.1f} GB/s ({THREADS} threads)")
    if "real" in sections:
        if not args.real_dir:
            p.error("section real needs --real-dir (a folder with room for ~28 GB of model files)")
        from raymoe.tools.bench_real import bench_real
        report["real"] = bench_real(args.real_dir, args.quick, max(args.repeat, 3))
    if sections & {"engines", "pp", "hops"}:
        print("synthetic qwen35moe: hidden 1024, 8 layers, 32 experts top-4, expert FF 512, vocab 32000")
    if "engines" in sections:
        report["engines"] = bench_engines(args.quick, args.repeat)
    if sections & {"pp", "hops", "coordinator"}:
        from raymoe.cluster.engine import connect_ray
        connect_ray(8)
    if "coordinator" in sections:
        report["coordinator"] = bench_coordinator(args.quick)
    if "pp" in sections:
        qwen = build_model("qwen35moe", "qwen35moe", qwen35moe_config, qwen35moe_tensors, QWEN_SHAPE, ["f32"])
        report["pp_tok_s"], report["stage_rss_mb"] = bench_pipeline(qwen["f32"], args.quick)
    if "hops" in sections:
        report["hop_us"] = bench_hops(args.quick)
        report["transport_tok_s"] = bench_transports(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
