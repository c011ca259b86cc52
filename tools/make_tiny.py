"""Deterministic tiny random models: an HF directory and its GGUF, written without transformers.

    python -m raymoe.tools.make_tiny --arch qwen35moe|gptoss --out DIR

DIR/hf holds config.json, model.safetensors and the tokenizer; DIR/<name>.gguf is the same
model through deploy.convert. The tests build their oracle models with it; the embedded default
models (models/) are trained ones, see tools.train_tiny.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

CACHE_DIR = os.environ.get("RAYMOE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "raymoe"))


def qwen35moe_config(vocab_size: int) -> dict:
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab_size, "hidden_size": 128, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128,
        "num_experts": 16, "num_experts_per_tok": 4, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu",
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        "torch_dtype": "float32",
    }


def qwen35moe_tensors(c: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF-named random weights: projections ~ N(0, scale), norms near their zero-centred init."""
    g = torch.Generator().manual_seed(seed)
    H, E, Fe, S = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    hd, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    dk, dv, nk, nv = (c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_num_key_heads"],
                      c["linear_num_value_heads"])
    conv_dim = 2 * dk * nk + dv * nv
    scale = 1.5 / H ** 0.5

    def rnd(*shape, s=scale):
        return torch.randn(shape, generator=g) * s

    t = {"model.embed_tokens.weight": rnd(c["vocab_size"], H, s=1.0), "model.norm.weight": rnd(H, s=0.3),
         "lm_head.weight": rnd(c["vocab_size"], H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = rnd(H, s=0.3)
        t[p + "post_attention_layernorm.weight"] = rnd(H, s=0.3)
        if c["layer_types"][i] == "full_attention":
            t.update({p + "self_attn.q_proj.weight": rnd(2 * nh * hd, H), p + "self_attn.k_proj.weight": rnd(nkv * hd, H),
                      p + "self_attn.v_proj.weight": rnd(nkv * hd, H), p + "self_attn.o_proj.weight": rnd(H, nh * hd),
                      p + "self_attn.q_norm.weight": rnd(hd, s=0.3), p + "self_attn.k_norm.weight": rnd(hd, s=0.3)})
        else:
            la = p + "linear_attn."
            t.update({la + "in_proj_qkv.weight": rnd(conv_dim, H), la + "in_proj_z.weight": rnd(nv * dv, H),
                      la + "in_proj_b.weight": rnd(nv, H), la + "in_proj_a.weight": rnd(nv, H),
                      la + "conv1d.weight": rnd(conv_dim, 1, c["linear_conv_kernel_dim"], s=0.5),
                      la + "dt_bias": rnd(nv, s=0.5), la + "A_log": torch.rand(nv, generator=g) * 2 - 1,
                      la + "norm.weight": 1 + rnd(dv, s=0.3), la + "out_proj.weight": rnd(H, nv * dv)})
        t[p + "mlp.gate.weight"] = rnd(E, H, s=4 * scale)
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            t.update({q + "gate_proj.weight": rnd(Fe, H), q + "up_proj.weight": rnd(Fe, H),
                      q + "down_proj.weight": rnd(H, Fe, s=1.5 / Fe ** 0.5)})
        t.update({p + "mlp.shared_expert.gate_proj.weight": rnd(S, H), p + "mlp.shared_expert.up_proj.weight": rnd(S, H),
                  p + "mlp.shared_expert.down_proj.weight": rnd(H, S, s=1.5 / S ** 0.5),
                  p + "mlp.shared_expert_gate.weight": rnd(1, H)})
    return t


def gptoss_config(vocab_size: int) -> dict:
    """Shaped like gpt-oss-20b's config.json (v4 `rope_scaling` spelling, MXFP4 experts), scaled down."""
    n_layers = 4
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": vocab_size, "hidden_size": 128, "num_hidden_layers": n_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "attention_bias": True,
        "intermediate_size": 64, "num_local_experts": 16, "num_experts_per_tok": 4, "experts_per_token": 4,
        "rms_norm_eps": 1e-5, "sliding_window": 16, "max_position_embeddings": 131072,
        "initial_context_length": 4096, "tie_word_embeddings": False, "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
        "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
        "torch_dtype": "bfloat16",
    }


def gptoss_tensors(c: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF-named random weights; experts as MXFP4 `*_blocks` / `*_scales` like the released checkpoints."""
    g = torch.Generator().manual_seed(seed)
    H, E, I = c["hidden_size"], c["num_local_experts"], c["intermediate_size"]
    hd, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    scale = 1.5 / H ** 0.5

    def rnd(*shape, s=scale):
        return torch.randn(shape, generator=g) * s

    def mxfp4(rows, cols):
        # random e2m1 codes; e8m0 scales 2^-6..2^-3 give weights of about the size of `scale`
        blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
        scales = torch.randint(121, 125, (E, rows, cols // 32), generator=g, dtype=torch.int32).to(torch.uint8)
        return blocks, scales

    t = {"model.embed_tokens.weight": rnd(c["vocab_size"], H, s=1.0), "model.norm.weight": 1 + rnd(H, s=0.3),
         "lm_head.weight": rnd(c["vocab_size"], H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + rnd(H, s=0.3)
        t[p + "post_attention_layernorm.weight"] = 1 + rnd(H, s=0.3)
        for name, out, inp in (("q_proj", nh * hd, H), ("k_proj", nkv * hd, H), ("v_proj", nkv * hd, H),
                               ("o_proj", H, nh * hd)):
            t[f"{p}self_attn.{name}.weight"] = rnd(out, inp, s=1.5 / inp ** 0.5)
            t[f"{p}self_attn.{name}.bias"] = rnd(out, s=0.2)
        t[p + "self_attn.sinks"] = rnd(nh, s=1.0)
        t[p + "mlp.router.weight"] = rnd(E, H, s=4 * scale)
        t[p + "mlp.router.bias"] = rnd(E, s=0.2)
        e = p + "mlp.experts."
        t[e + "gate_up_proj_blocks"], t[e + "gate_up_proj_scales"] = mxfp4(2 * I, H)
        t[e + "gate_up_proj_bias"] = rnd(E, 2 * I, s=0.2)
        t[e + "down_proj_blocks"], t[e + "down_proj_scales"] = mxfp4(H, I)
        t[e + "down_proj_bias"] = rnd(E, H, s=0.2)
    return t


ARCHS = {"qwen35moe": (qwen35moe_config, qwen35moe_tensors), "gptoss": (gptoss_config, gptoss_tensors)}


def make_tiny(arch: str, out_dir: str, seed: int = 0, gguf_type: str = "f32") -> str:
    """Write DIR/hf and DIR/tiny-<arch>.gguf; returns the GGUF path."""
    from safetensors.torch import save_file

    from raymoe.deploy.convert import convert
    from raymoe.tools.tiny_tokenizer import build_tiny_tokenizer
    from raymoe.stages.text.tokenizer import Tokenizer

    make_config, make_tensors = ARCHS[arch]
    hf_dir = os.path.join(out_dir, "hf")
    os.makedirs(hf_dir, exist_ok=True)
    build_tiny_tokenizer(hf_dir, arch)
    config = make_config(Tokenizer.from_hf_dir(hf_dir).vocab_size)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(make_tensors(config, seed), os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    return convert(hf_dir, os.path.join(out_dir, f"tiny-{arch}.gguf"), gguf_type, progress=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raymoe.tools.make_tiny", description="write a tiny random model")
    p.add_argument("--arch", required=True, choices=sorted(ARCHS))
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--type", default="f32", choices=["f32", "f16", "bf16", "q8_0"], help="GGUF tensor type")
    args = p.parse_args(argv)
    path = make_tiny(args.arch, args.out, args.seed, args.type)
    print(f"wrote {os.path.join(args.out, 'hf')} and {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
