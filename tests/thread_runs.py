"""Runs that the thread-count tests compare bit for bit: the engine on prompts of many lengths, and a
synthetic file with two layers of a released model's full widths."""
import dataclasses
import json

import torch

from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.tools import make_synthetic as ms

PROMPT_LENGTHS = [70, 5, 300, 9, 17, 33, 2, 40, 11, 6, 3, 25]


def generate(path: str, mode: str, n_threads: int) -> str:
    """Prompts of many lengths (prefill chunks, batched decode of up to 12 sequences), greedy and
    seeded; the results as JSON text, so that equal text means equal bits."""
    torch.set_num_threads(n_threads)
    engine = LocalEngine(open_model(path), mode=mode)
    engine.eos_ids = set()
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i, n in enumerate(PROMPT_LENGTHS):
        ids = torch.randint(0, min(2000, engine.config.vocab), (n,), generator=g).tolist()
        params = SamplingParams(max_tokens=4, temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=2, prompt_logprobs=2)
        seqs.append(engine.add_request(f"r{i}", ids, params))
    engine.run_until_done()
    return json.dumps([s.result() for s in seqs])


def full_width(model: str, path) -> str:
    """Two layers of the released model's widths (one of each layer kind), with few experts and a
    short vocabulary: the sizes where torch splits an op among its threads."""
    spec = ms.MODELS[model]
    cfg = spec.make_config(2, 4096)
    if model == "qwen3.5-35b-a3b":
        cfg = dataclasses.replace(cfg, n_expert=16, full_attention_interval=2)      # DeltaNet, then attention
    else:
        cfg = dataclasses.replace(cfg, n_expert=4, n_expert_used=2)
    plan = ms.tensor_plan(spec.family, cfg, mix=spec.default_mix)
    ms.write_synthetic(str(path), model, cfg, plan, ms.synthetic_tokenizer(spec.tokenizer_family),
                       ms.FILE_TYPES[spec.default_mix], progress=False)
    return str(path)
