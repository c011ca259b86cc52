"""Qwen3.5-MoE (GGUF arch `qwen35moe`): Gated DeltaNet layers, every Nth layer gated full attention,
routed + shared-expert MoE.

Weights use the GGUF conventions throughout (see docs/model-formats.md §2): tensor names `blk.N.*`, V heads in
tiled order (V head vh reads K head vh % n_k_heads), RMSNorm weights with the +1 baked in,
`ssm_a = -exp(A_log)`. `qwen35moe_hf.py` maps an HF checkpoint onto these conventions.
"""
from __future__ import annotations

from dataclasses import dataclass

from raymoe.kernels.moe import route_softmax_topk
from raymoe.kernels.rope import inv_frequencies

from raymoe.stages.layers import deltanet
from raymoe.stages.layers.attention import AttentionSpec
from raymoe.stages.layers.deltanet import DeltaNetConfig, DeltaNetSpec
from raymoe.stages.families.contract import Family, fields_from_gguf
from raymoe.stages.files.gguf_file import arch_key_reader
from raymoe.stages.layers.moe import MoESpec
from raymoe.stages.families.qwen35moe_hf import Qwen35MoeHFWeights
from raymoe.stages.files.safetensors_dir import hf_key_reader

ARCH = "qwen35moe"
TOKENIZER_PRE = "qwen35"


@dataclass
class Qwen35MoeConfig(DeltaNetConfig):
    rope_sections: list
    arch: str = ARCH
    mtp_layers: int = 0         # multi-token prediction heads after the layers (stages/runtime/mtp.py)


def config_from_gguf(meta: dict, where: str) -> Qwen35MoeConfig:
    key = arch_key_reader(meta, ARCH, where)
    cfg = Qwen35MoeConfig(
        **fields_from_gguf(meta, key), **deltanet.fields_from_gguf(key),
        n_layers=key("block_count") - key("nextn_predict_layers", 0), mtp_layers=key("nextn_predict_layers", 0),
        expert_ff=key("expert_feed_forward_length"), shared_ff=key("expert_shared_feed_forward_length", 0),
        rope_dim=key("rope.dimension_count"), rope_sections=list(key("rope.dimension_sections", [0, 0, 0, 0])),
        full_attention_interval=key("full_attention_interval", 4))
    cfg.validate(where)
    return cfg


def config_from_hf(hf: dict, where: str) -> Qwen35MoeConfig:
    if hf.get("model_type") == "qwen3_5_moe":
        hf = hf.get("text_config") or {}
    key = hf_key_reader(hf, where)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    n_layers = key("num_hidden_layers")
    head_dim = hf.get("head_dim") or key("hidden_size") // key("num_attention_heads")
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    cfg = Qwen35MoeConfig(
        n_layers=n_layers, hidden=key("hidden_size"), vocab=key("vocab_size"), n_head=key("num_attention_heads"),
        n_kv_head=key("num_key_value_heads"), head_dim=head_dim, rms_eps=float(key("rms_norm_eps")),
        rope_base=float(theta), rope_dim=int(head_dim * partial), rope_sections=(sections + [0, 0, 0, 0])[:4],
        n_expert=key("num_experts"), n_expert_used=key("num_experts_per_tok"),
        expert_ff=key("moe_intermediate_size"), shared_ff=hf.get("shared_expert_intermediate_size") or 0,
        **deltanet.fields_from_hf(key),
        full_attention_interval=deltanet.hf_full_attention_interval(hf, n_layers, where),
        context_length=hf.get("max_position_embeddings", 32768), mtp_layers=hf.get("mtp_num_hidden_layers") or 0)
    cfg.validate(where)
    return cfg


def attention_spec(cfg: Qwen35MoeConfig) -> AttentionSpec:
    return AttentionSpec(cfg.n_head, cfg.n_kv_head, cfg.head_dim, qk_norm=True, output_gate=True)


def deltanet_spec(cfg: Qwen35MoeConfig) -> DeltaNetSpec:
    return DeltaNetSpec(cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim, cfg.conv_kernel)


def layer_mixer(cfg: Qwen35MoeConfig, i: int):
    """Every `full_attention_interval`-th layer gated attention, the others Gated DeltaNet."""
    return attention_spec(cfg) if (i + 1) % cfg.full_attention_interval == 0 else deltanet_spec(cfg)


def rope(cfg: Qwen35MoeConfig):
    # partial RoPE: the multi-section form reduces to it for text, whose position components are all equal
    return inv_frequencies(cfg.rope_base, cfg.rope_dim), 1.0


def layer_ffn(cfg: Qwen35MoeConfig, i: int) -> MoESpec:
    return MoESpec(cfg.n_expert, cfg.n_expert_used, cfg.expert_ff, route_softmax_topk, shared_ff=cfg.shared_ff)


def gguf_metadata(cfg: Qwen35MoeConfig) -> dict:
    """The `qwen35moe.*` GGUF keys for cfg (the inverse of config_from_gguf)."""
    return {
        **cfg.gguf_metadata(), **deltanet.gguf_metadata(deltanet_spec(cfg)),
        "rope.dimension_count": cfg.rope_dim, "rope.dimension_sections": list(cfg.rope_sections),
        "expert_shared_feed_forward_length": cfg.shared_ff, "full_attention_interval": cfg.full_attention_interval,
    }


FAMILY = Family(arch=ARCH, hf_model_types=("qwen3_5_moe", "qwen3_5_moe_text"), tokenizer_pre=TOKENIZER_PRE,
                chat_format="qwen_xml", config_from_gguf=config_from_gguf, config_from_hf=config_from_hf,
                gguf_metadata=gguf_metadata, hf_weights=Qwen35MoeHFWeights, layer_mixer=layer_mixer, rope=rope,
                layer_ffn=layer_ffn, mtp_mixer=attention_spec)
