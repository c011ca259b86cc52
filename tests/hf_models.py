"""Tiny HF transformers models built in the tests: the exact float32 oracles (docs/model-formats.md §5)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

QWEN_CONFIG = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=6, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
    max_position_embeddings=4096, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)


def randomise(model: torch.nn.Module, seed: int, scale: float = 0.15):
    """Non-trivial random weights: logits with real spread, norms away from their init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def make_qwen35moe(out_dir: str, seed: int = 0, **overrides):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(**{**QWEN_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).float().eval()
    randomise(model, seed)
    model.save_pretrained(out_dir)
    return model


def make_qwen3next(out_dir: str, seed: int = 0, **overrides):
    """Qwen3.5-MoE's tiny shapes (their V heads 3 per K head, so grouped and tiled orders differ), with
    Qwen3-Next's rope (no multi-section) and full attention every 4th layer."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = {k: v for k, v in QWEN_CONFIG.items() if k != "rope_parameters"}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    cfg = Qwen3NextConfig(**{**config, **overrides})
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(cfg).float().eval()
    randomise(model, seed)
    model.save_pretrained(out_dir)
    return model


# gpt-oss: every feature the released checkpoints use, at a size that runs in seconds. The window (8) is
# shorter than the test prompts; a small rope_theta puts YaRN's ramp over several frequencies, so that
# `truncate` changes some of them.
GPTOSS_CONFIG = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=True,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
)

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def random_mxfp4(g: torch.Generator, experts: int, rows: int, cols: int, exponents=(121, 125)):
    """Random MXFP4 weights in the released checkpoint's layout: blocks [E, rows, cols/32, 16] u8 (low nibble =
    even element), scales [E, rows, cols/32] u8 (e8m0, 127 = 2^0)."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(*exponents, (experts, rows, cols // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def mxfp4_to_float(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`LUT[code] * 2^(scale - 127)`, [E, rows, cols] (the formula of docs/model-formats.md §4)."""
    lut = torch.tensor(FP4_VALUES)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()        # [E, R, G, 16, 2]: even, odd
    values = lut[codes].reshape(*blocks.shape[:-1], 32)
    values = values * torch.pow(2.0, scales.float() - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def make_gptoss(out_dir: str, seed: int = 0, mxfp4: bool = True, **overrides):
    """Write an HF gpt-oss checkpoint (experts as MXFP4 `*_blocks`/`*_scales` like the released one, or plain
    float) and return transformers' model loaded from it in float32, dequantised (the oracle)."""
    import json
    import os

    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config

    cfg = GptOssConfig(**{**GPTOSS_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    H, E, I = cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size
    tensors = {}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("router.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 4 / H ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / p.shape[-1] ** 0.5)
        for name, p in model.state_dict().items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                rows, cols = (2 * I, H) if name.endswith("gate_up_proj") else (H, I)
                blocks, scales = random_mxfp4(g, E, rows, cols)
                weight = mxfp4_to_float(blocks, scales).transpose(1, 2).contiguous()   # HF [E, in, out]
                p.copy_(weight)
                if mxfp4:
                    tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
                    continue
            tensors[name] = p.detach().clone().contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out_dir)
    if mxfp4:
        path = os.path.join(out_dir, "config.json")
        config = json.load(open(path))
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                       "lm_head"],
        }
        json.dump(config, open(path, "w"), indent=2)
        oracle = GptOssForCausalLM.from_pretrained(out_dir, quantization_config=Mxfp4Config(dequantize=True),
                                                   dtype=torch.float32)
    else:
        oracle = GptOssForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    oracle = oracle.float().eval()
    for name, p in model.state_dict().items():     # the oracle holds exactly the weights built here
        assert torch.equal(oracle.state_dict()[name], p), name
    return oracle


def hf_logprobs(model, ids):
    """The oracle's log-softmax over the vocabulary at every position of ids."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def run_one(model_files, prompt, scheduler=None, mode="float32", **params):
    """One request through the in-process engine (greedy, 1 token unless params say otherwise)."""
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.text.sampling_params import SamplingParams

    engine = LocalEngine(model_files, mode=mode, scheduler=scheduler)
    seq = engine.add_request("r", prompt, SamplingParams(**{"max_tokens": 1, "temperature": 0, **params}))
    engine.run_until_done()
    return seq.result()


def assert_prompt_logprobs_match(result: dict, ref: torch.Tensor, tol: float):
    """Our prompt logprobs (and their top alternatives) equal the oracle's log-softmax `ref` to tol."""
    entries, ids = result["prompt_logprobs"], result["prompt_token_ids"]
    assert entries[0] is None and len(entries) == len(ids)
    ours = torch.tensor([e["logprob"] for e in entries[1:]])
    theirs = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(ours, theirs, atol=tol, rtol=0), (ours - theirs).abs().max()
    for i, e in enumerate(entries[1:]):
        top_ids = [t for t, _ in e["top"]]
        top_lp = torch.tensor([lp for _, lp in e["top"]])
        assert torch.allclose(top_lp, ref[i][top_ids], atol=tol, rtol=0)
        assert torch.allclose(top_lp, torch.topk(ref[i], len(top_ids)).values, atol=tol, rtol=0)


def assert_greedy_matches(model_files, oracle, prompt: list[int], n_new: int = 24):
    """Greedy continuation of exactly n_new tokens (no stop at end tokens) equals the oracle's."""
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.text.sampling_params import SamplingParams

    engine = LocalEngine(model_files, mode="float32")
    engine.eos_ids = set()
    seq = engine.add_request("r", prompt, SamplingParams(max_tokens=n_new, temperature=0))
    engine.run_until_done()
    with torch.no_grad():
        ref = oracle.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    assert seq.output_ids == ref[0, len(prompt):].tolist()


@dataclass
class Oracle:
    """A family's tiny transformers model, its HF directory (with the family's tiny tokenizer), the GGUF
    deploy.convert writes from it, and a random prompt."""
    family: str             # the tools.tiny_tokenizer family and ORACLES key
    dir: str
    model: torch.nn.Module
    gguf: str
    prompt: list


# family -> (builder, prompt length): one oracle per family in raymoe.stages.families.registry.FAMILIES
ORACLES = {"qwen35moe": (make_qwen35moe, 70), "gptoss": (make_gptoss, 48), "qwen3next": (make_qwen3next, 70)}


def build_oracle(family: str, root: str) -> Oracle:
    from raymoe.deploy.convert import convert
    from raymoe.stages.text.tokenizer import Tokenizer
    from raymoe.tools.tiny_tokenizer import build_tiny_tokenizer

    make, prompt_len = ORACLES[family]
    d = os.path.join(root, family)
    build_tiny_tokenizer(d, family)
    model = make(d, seed=0, vocab_size=Tokenizer.from_hf_dir(d).vocab_size)
    gguf = convert(d, os.path.join(root, f"{family}.gguf"), "f32", progress=False)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1))
    return Oracle(family, d, model, gguf, prompt.tolist())
