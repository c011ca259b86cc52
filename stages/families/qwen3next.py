"""Qwen3-Next (GGUF arch `qwen3next`): Gated DeltaNet layers, every Nth layer gated full attention,
routed + shared-expert MoE; Qwen3.5-MoE's parent, with these differences (transformers' modeling_qwen3_next
against modeling_qwen3_5_moe, llama.cpp's qwen3next against qwen35moe; docs/model-formats.md §7):
- the DeltaNet input projections: HF fuses q, k, v, z per K head (`in_proj_qkvz`) and b, a per K head
  (`in_proj_ba`); llama.cpp's files hold `attn_qkv` + `attn_gate` and that `ssm_ba` as it is, with V heads
  in HF's grouped order (stages/layers/deltanet.py, `grouped`), where qwen35moe tiles them;
- plain partial RoPE (`rope.dimension_count`), no multi-section RoPE;
- the router's renormalisation of the top k is a config switch (`norm_topk_prob`: refused off, as llama.cpp's
  qwen3next has no such option);
- transformers can make some layers dense (`mlp_only_layers`, and with `decoder_sparse_step` N only every
  Nth layer has experts): those layers are a dense SwiGLU feed-forward of `intermediate_size`
  (stages/layers/dense_ffn.py). llama.cpp's qwen3next has none; a converted file lists them in the raymoe keys
  `qwen3next.dense_layers` and `qwen3next.dense_feed_forward_length`, which only raymoe reads;
- everything else is Qwen3.5-MoE's: (1 + w) RMSNorm (GGUF bakes the +1 in, but not into the DeltaNet output
  norm), gated attention with q/k norms, the sigmoid-gated shared expert, softmax top-k routing.
`qwen3next_hf.py` maps an HF checkpoint onto llama.cpp's conventions.
"""
from __future__ import annotations

from dataclasses import dataclass

from raymoe.kernels.moe import route_softmax_topk
from raymoe.kernels.rope import inv_frequencies

from raymoe.stages.layers import deltanet
from raymoe.stages.layers.attention import AttentionSpec
from raymoe.stages.layers.deltanet import DeltaNetConfig, DeltaNetSpec
from raymoe.stages.errors import ModelFormatError
from raymoe.stages.families.contract import Family, fields_from_gguf
from raymoe.stages.files.gguf_file import arch_key_reader
from raymoe.stages.layers.dense_ffn import DenseFFNSpec
from raymoe.stages.layers.moe import MoESpec
from raymoe.stages.families.qwen3next_hf import Qwen3NextHFWeights
from raymoe.stages.files.safetensors_dir import hf_key_reader

ARCH = "qwen3next"
TOKENIZER_PRE = "qwen2"


@dataclass
class Qwen3NextConfig(DeltaNetConfig):
    arch: str = ARCH
    dense_layers: tuple[int, ...] = ()     # the layers with a dense feed-forward instead of experts
    dense_ff: int = 0                       # its inner width
    mtp_layers: int = 0                     # multi-token prediction heads after the layers (stages/runtime/mtp.py)

    POSITIVE = DeltaNetConfig.POSITIVE + ("shared_ff",)

    def validate(self, where: str):
        super().validate(where)
        if not all(type(i) is int and 0 <= i < self.n_layers for i in self.dense_layers):
            raise ModelFormatError(f"{where}: dense layers {list(self.dense_layers)!r} must be layer indices "
                                   f"below {self.n_layers}")
        if self.dense_layers and (type(self.dense_ff) is not int or self.dense_ff <= 0):
            raise ModelFormatError(f"{where}: the dense layers' feed-forward width must be a positive integer, "
                                   f"got {self.dense_ff!r}")


def config_from_gguf(meta: dict, where: str) -> Qwen3NextConfig:
    key = arch_key_reader(meta, ARCH, where)
    dense = key("dense_layers", [])
    if not isinstance(dense, list):
        raise ModelFormatError(f"{where}: metadata {ARCH}.dense_layers must be a list of layer indices")
    cfg = Qwen3NextConfig(
        **fields_from_gguf(meta, key), **deltanet.fields_from_gguf(key),
        n_layers=key("block_count") - key("nextn_predict_layers", 0), mtp_layers=key("nextn_predict_layers", 0),
        expert_ff=key("expert_feed_forward_length"), shared_ff=key("expert_shared_feed_forward_length"),
        rope_dim=key("rope.dimension_count"), full_attention_interval=key("full_attention_interval", 4),
        dense_layers=tuple(dense), dense_ff=key("dense_feed_forward_length", 0))
    cfg.validate(where)
    return cfg


def config_from_hf(hf: dict, where: str) -> Qwen3NextConfig:
    key = hf_key_reader(hf, where)
    # transformers v5 writes `rope_parameters`; v4 (the released config.json) the values beside the rest
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ModelFormatError(f"{where}: unsupported rope_type {rope.get('rope_type', rope.get('type'))!r} "
                               f"(supported: default)")
    refused = {"attention_bias": hf.get("attention_bias", False),
               "norm_topk_prob false": not hf.get("norm_topk_prob", True)}
    for what, present in refused.items():
        if present:
            raise ModelFormatError(f"{where}: Qwen3-Next with {what} is not supported (llama.cpp's qwen3next "
                                   f"has no such option)")
    n_layers = key("num_hidden_layers")
    dense = hf_dense_layers(hf, n_layers, where)
    head_dim = hf.get("head_dim") or key("hidden_size") // key("num_attention_heads")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    cfg = Qwen3NextConfig(
        n_layers=n_layers, hidden=key("hidden_size"), vocab=key("vocab_size"), n_head=key("num_attention_heads"),
        n_kv_head=key("num_key_value_heads"), head_dim=head_dim, rms_eps=float(key("rms_norm_eps")),
        rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rope_dim=int(head_dim * partial),
        n_expert=key("num_experts"), n_expert_used=key("num_experts_per_tok"), expert_ff=key("moe_intermediate_size"),
        shared_ff=key("shared_expert_intermediate_size"), **deltanet.fields_from_hf(key),
        full_attention_interval=deltanet.hf_full_attention_interval(hf, n_layers, where),
        dense_layers=dense, dense_ff=key("intermediate_size") if dense else 0,
        context_length=hf.get("max_position_embeddings", 32768), mtp_layers=hf.get("mtp_num_hidden_layers") or 0)
    cfg.validate(where)
    return cfg


def hf_dense_layers(hf: dict, n_layers: int, where: str) -> tuple[int, ...]:
    """The layers transformers builds dense: those in mlp_only_layers, and with decoder_sparse_step N those
    whose number (from 1) N does not divide."""
    only, step = hf.get("mlp_only_layers") or [], hf.get("decoder_sparse_step", 1)
    if not isinstance(only, list) or not all(type(i) is int and 0 <= i < n_layers for i in only):
        raise ModelFormatError(f"{where}: mlp_only_layers must be a list of layer indices below {n_layers}, "
                               f"got {only!r}")
    if type(step) is not int or step < 1:
        raise ModelFormatError(f"{where}: decoder_sparse_step must be a positive integer, got {step!r}")
    return tuple(i for i in range(n_layers) if i in only or (i + 1) % step)


def deltanet_spec(cfg: Qwen3NextConfig) -> DeltaNetSpec:
    return DeltaNetSpec(cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim, cfg.conv_kernel, grouped=True)


def attention_spec(cfg: Qwen3NextConfig) -> AttentionSpec:
    return AttentionSpec(cfg.n_head, cfg.n_kv_head, cfg.head_dim, qk_norm=True, output_gate=True)


def layer_mixer(cfg: Qwen3NextConfig, i: int):
    """Every `full_attention_interval`-th layer gated attention, the others Gated DeltaNet."""
    return attention_spec(cfg) if (i + 1) % cfg.full_attention_interval == 0 else deltanet_spec(cfg)


def rope(cfg: Qwen3NextConfig):
    return inv_frequencies(cfg.rope_base, cfg.rope_dim), 1.0


def layer_ffn(cfg: Qwen3NextConfig, i: int) -> MoESpec | DenseFFNSpec:
    if i in cfg.dense_layers:
        return DenseFFNSpec(cfg.dense_ff)
    return MoESpec(cfg.n_expert, cfg.n_expert_used, cfg.expert_ff, route_softmax_topk, shared_ff=cfg.shared_ff)


def gguf_metadata(cfg: Qwen3NextConfig) -> dict:
    """The `qwen3next.*` GGUF keys for cfg (the inverse of config_from_gguf)."""
    dense = {"dense_layers": list(cfg.dense_layers), "dense_feed_forward_length": cfg.dense_ff} if cfg.dense_layers else {}
    return {**cfg.gguf_metadata(), **deltanet.gguf_metadata(deltanet_spec(cfg)), "rope.dimension_count": cfg.rope_dim,
            "expert_shared_feed_forward_length": cfg.shared_ff, "full_attention_interval": cfg.full_attention_interval,
            **dense}


FAMILY = Family(arch=ARCH, hf_model_types=("qwen3_next",), tokenizer_pre=TOKENIZER_PRE, chat_format="hermes",
                config_from_gguf=config_from_gguf, config_from_hf=config_from_hf, gguf_metadata=gguf_metadata,
                hf_weights=Qwen3NextHFWeights, layer_mixer=layer_mixer, rope=rope, layer_ffn=layer_ffn,
                mtp_mixer=attention_spec)
