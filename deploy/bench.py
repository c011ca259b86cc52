"""Benchmark: raymoe against its peers on the same synthetic weights, and the cluster's scaling.

    python -m deploy.bench [--quick] [--json FILE] [--sections engines,pp,hops]

Builds (once, cached) a qwen35moe of hidden 1024, 8 layers, 32 experts top-4, expert FF 512,
then measures in one run:
- engines: prefill tok/s (256-token prompt) and batch-1 decode tok/s, raymoe vs HF transformers;
- pp: aggregate decode tok/s of PP=1, 2, 4 on the Ray cluster with 16 concurrent sequences,
  and each stage actor's peak RSS next to its weight bytes;
- hops: per-hop latency of each transport for a decode-sized and a prefill-sized activation,
  next to a memcpy of the same bytes.
Machines are noisy: only ratios measured in one run mean anything.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from deploy.make_tiny import CACHE_DIR, qwen35moe_config, qwen35moe_tensors

BENCH_SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                   head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
                   linear_num_value_heads=8, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
                   shared_expert_intermediate_size=512, vocab_size=32000)


def bench_model_dir() -> str:
    """HF directory of the bench model (config, safetensors, tiny tokenizer), built on first use."""
    from safetensors.torch import save_file

    from deploy.tiny_tokenizer import build_tiny_tokenizer

    path = os.path.join(CACHE_DIR, "bench-qwen35moe-v1")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        os.makedirs(path, exist_ok=True)
        build_tiny_tokenizer(path, "qwen35moe")
        config = {**qwen35moe_config(BENCH_SHAPE["vocab_size"]), **BENCH_SHAPE}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        save_file(qwen35moe_tensors(config, seed=0), os.path.join(path, "model.safetensors.tmp"))
        os.replace(os.path.join(path, "model.safetensors.tmp"), os.path.join(path, "model.safetensors"))
    return path


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_raymoe(path: str, prompt: list[int], n_decode: int) -> dict:
    from stages.engine import LocalEngine
    from stages.loader import open_model
    from stages.sampling import SamplingParams

    engine = LocalEngine(open_model(path))
    engine.eos_ids = set()

    def generate(ids, n):
        engine.add_request("b", ids, SamplingParams(max_tokens=n, temperature=0))
        engine.run_until_done()

    generate(prompt[:16], 2)                                   # warm-up
    prefill = timed(lambda: generate(prompt, 1))
    short = prompt[:8]
    t_one = timed(lambda: generate(short, 1))
    t_all = timed(lambda: generate(short, n_decode + 1))
    return {"prefill_tok_s": len(prompt) / prefill, "decode_tok_s": n_decode / (t_all - t_one)}


def bench_transformers(path: str, prompt: list[int], n_decode: int) -> dict:
    from transformers import Qwen3_5MoeForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def generate(x, n):
        with torch.inference_mode():
            model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    generate(ids[:, :16], 2)
    with torch.inference_mode():
        prefill = timed(lambda: model(ids))
    short = ids[:, :8]
    t_one = timed(lambda: generate(short, 1))
    t_all = timed(lambda: generate(short, n_decode + 1))
    return {"prefill_tok_s": len(prompt) / prefill, "decode_tok_s": n_decode / (t_all - t_one)}


def bench_engines(path: str, quick: bool, threads: int) -> dict:
    torch.set_num_threads(threads)
    n_prompt, n_decode = (64, 16) if quick else (256, 128)
    prompt = torch.randint(0, BENCH_SHAPE["vocab_size"], (n_prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    results = {"raymoe-f32": bench_raymoe(path, prompt, n_decode),
               "transformers-f32": bench_transformers(path, prompt, n_decode)}
    ours, theirs = results["raymoe-f32"], results["transformers-f32"]
    print(f"\n== engines: {threads} threads, prefill {n_prompt} tokens, batch-1 decode {n_decode} tokens")
    print(f"{'engine':<20}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for name, r in results.items():
        print(f"{name:<20}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>15.1f}")
    print(f"{'raymoe / HF':<20}{ours['prefill_tok_s'] / theirs['prefill_tok_s']:>14.2f}x"
          f"{ours['decode_tok_s'] / theirs['decode_tok_s']:>14.2f}x")
    return results


def bench_pipeline(path: str, quick: bool) -> tuple[dict, dict]:
    """Aggregate decode throughput of PP=1/2/4 with 16 concurrent sequences, and stage memory."""
    from cluster.engine import ClusterEngine

    n_seqs, n_tokens = 16, (8 if quick else 32)
    g = torch.Generator().manual_seed(1)
    requests = [(i, {"prompt_token_ids": torch.randint(0, BENCH_SHAPE["vocab_size"], (16,), generator=g).tolist(),
                     "max_tokens": n_tokens, "temperature": 0}) for i in range(n_seqs)]
    tok_s, rss = {}, {}
    print(f"\n== pipeline: {n_seqs} sequences x {n_tokens} tokens, 1 torch thread per stage actor")
    for pp in (1, 2, 4):
        engine = ClusterEngine(path, pp=pp, threads=1)
        try:
            engine.submit_many(requests[:pp])          # warm-up
            done = 0
            while done < pp:
                done += len(engine.wait_finished(5))
            start = time.perf_counter()
            engine.submit_many(requests)
            done = 0
            while done < n_seqs:
                done += len(engine.wait_finished(5))
            tok_s[str(pp)] = n_seqs * n_tokens / (time.perf_counter() - start)
            stages = engine.stats()["stages"]
            rss[str(pp)] = [{"layers": s["layers"], "weights_mb": s["parameter_bytes"] / 2**20,
                             "peak_rss_mb": s["peak_rss_bytes"] / 2**20} for s in stages]
        finally:
            engine.shutdown()
        ratio = tok_s[str(pp)] / tok_s["1"]
        print(f"PP={pp}: {tok_s[str(pp)]:8.1f} tok/s  ({ratio:.2f}x PP=1)   stage peak RSS / weights (MB): " +
              ", ".join(f"{r['peak_rss_mb']:.0f}/{r['weights_mb']:.0f}" for r in rss[str(pp)]))
    return tok_s, rss


def bench_hops(quick: bool) -> dict:
    from cluster.hops import measure_hops

    hidden = BENCH_SHAPE["hidden_size"]
    hops = measure_hops({"decode 1x1024": (1, hidden), "prefill 512x1024": (512, hidden)}, 10 if quick else 30)
    print("\n== transports: median per-hop time (ms), float32 activations")
    print(f"{'activation':<20}{'bytes':>10}{'memcpy':>10}{'object_store':>14}{'gloo':>10}")
    for name, h in hops.items():
        print(f"{name:<20}{h['bytes']:>10}{h['memcpy_ms']:>10.3f}{h['object_store_ms']:>14.3f}{h['gloo_ms']:>10.3f}")
    return hops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run, numbers are rough)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the single-process engines")
    p.add_argument("--sections", default="engines,pp,hops")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    path = bench_model_dir()
    print(f"qwen35moe hidden 1024, 8 layers, 32 experts top-4, expert FF 512, vocab 32000 ({path})")
    report = {}
    if "engines" in sections:
        report["engines"] = bench_engines(path, args.quick, args.threads)
    if sections & {"pp", "hops"}:
        from cluster.engine import connect_ray
        connect_ray(8)
    if "pp" in sections:
        report["pp_tok_s"], report["stage_rss_mb"] = bench_pipeline(path, args.quick)
    if "hops" in sections:
        report["hop_ms"] = bench_hops(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
