"""Benchmark: raymoe against HF transformers on the same synthetic qwen35moe weights, same run.

    python -m deploy.bench [--quick] [--json FILE]

Builds (once, cached) a qwen35moe of hidden 1024, 8 layers, 32 experts top-4, expert FF 512,
and prints prefill tok/s (256-token prompt) and batch-1 decode tok/s for each engine, with
the ratio. Machines are noisy: only ratios measured in one run mean anything.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run, numbers are rough)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    n_prompt, n_decode = (64, 16) if args.quick else (256, 128)
    path = bench_model_dir()
    prompt = torch.randint(0, BENCH_SHAPE["vocab_size"], (n_prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    results = {"raymoe-f32": bench_raymoe(path, prompt, n_decode),
               "transformers-f32": bench_transformers(path, prompt, n_decode)}
    ours, theirs = results["raymoe-f32"], results["transformers-f32"]
    print(f"qwen35moe hidden 1024, 8 layers, 32 experts top-4, expert FF 512; {args.threads} threads; "
          f"prefill {n_prompt} tokens, decode {n_decode} tokens")
    print(f"{'engine':<20}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for name, r in results.items():
        print(f"{name:<20}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>15.1f}")
    print(f"{'raymoe / HF':<20}{ours['prefill_tok_s'] / theirs['prefill_tok_s']:>14.2f}x"
          f"{ours['decode_tok_s'] / theirs['decode_tok_s']:>14.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engines": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
