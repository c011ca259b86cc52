"""Tiny HF transformers models built in the tests: the exact float32 oracles (DESIGN §6)."""
from __future__ import annotations

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


def randomise(model: torch.nn.Module, seed: int, scale: float = 0.2):
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
