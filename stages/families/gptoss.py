"""gpt-oss (GGUF arch `gpt-oss`): attention with per-head sinks, every other layer a sliding window,
YaRN RoPE, and a top-k MoE of clamped-SwiGLU experts with biases (MXFP4 in the released checkpoints).

Weights use llama.cpp's GGUF conventions (docs/model-formats.md §4): tensor names `blk.N.*`; the experts' fused,
interleaved gate/up projection of HF is split into `ffn_gate_exps` (HF's even rows) and `ffn_up_exps`
(odd rows), each `[E, I, H]`, with their biases split the same way; `ffn_down_exps` is `[E, H, I]`.
`gptoss_hf.py` maps an HF checkpoint onto these conventions.

GGUF metadata beyond llama.cpp's (all optional when reading, written by `deploy.convert`):
`gpt-oss.rope.scaling.yarn_truncate` (bool; absent means false, as every released gpt-oss config
says), `gpt-oss.rope.scaling.attn_factor` (the cos/sin multiplier, only when the HF config overrides
YaRN's default `0.1·ln(factor) + 1`), `gpt-oss.attention.sliding_window_pattern` (bool per layer;
absent means llama.cpp's gpt-oss rule: even layers slide), `gpt-oss.swiglu_limit`, `gpt-oss.swiglu_alpha`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from raymoe.kernels.moe import clamped_swiglu, route_topk_softmax
from raymoe.kernels.rope import inv_frequencies, yarn_inv_frequencies

from raymoe.stages.layers.attention import AttentionSpec
from raymoe.stages.errors import ModelFormatError
from raymoe.stages.families.contract import Family, ModelConfig, fields_from_gguf
from raymoe.stages.files.gguf_file import arch_key_reader
from raymoe.stages.families.gptoss_hf import GptOssHFWeights
from raymoe.stages.layers.moe import MoESpec

ARCH = "gpt-oss"
TOKENIZER_PRE = "gpt-4o"
DEFAULT_ROPE_THETA = 150000.0           # transformers' GptOssConfig.default_theta
# transformers' GptOssConfig fills in this block when a config names no RoPE parameters at all.
HF_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                   "original_max_position_embeddings": 4096}


@dataclass
class GptOssConfig(ModelConfig):
    sliding_window: int | None          # None: no layer slides
    sliding_layers: list                # bool per layer
    rope_scaling: str = "none"          # "none" (plain RoPE) or "yarn"
    rope_factor: float = 1.0
    rope_original_context: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = False
    rope_attn_factor: float | None = None   # None: YaRN's default 0.1·ln(factor) + 1
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    arch: str = ARCH

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and bool(self.sliding_layers[layer])

    def rope_tables(self) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [head_dim/2], cos/sin multiplier)."""
        if self.rope_scaling == "yarn":
            return yarn_inv_frequencies(self.rope_base, self.head_dim, self.rope_factor, self.rope_original_context,
                                        self.rope_beta_fast, self.rope_beta_slow, self.rope_truncate,
                                        self.rope_attn_factor)
        return inv_frequencies(self.rope_base, self.head_dim), 1.0

    def validate(self, where: str):
        super().validate(where)
        if self.head_dim % 2:
            raise ModelFormatError(f"{where}: head_dim {self.head_dim} must be even for RoPE")
        if len(self.sliding_layers) != self.n_layers:
            raise ModelFormatError(f"{where}: {len(self.sliding_layers)} sliding-window flags for {self.n_layers} layers")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ModelFormatError(f"{where}: sliding_window must be a positive integer, got {self.sliding_window!r}")
        if self.rope_scaling not in ("none", "yarn"):
            raise ModelFormatError(f"{where}: unsupported RoPE scaling {self.rope_scaling!r} (supported: none, yarn)")
        if self.rope_scaling == "yarn" and (self.rope_factor <= 0 or self.rope_original_context <= 0):
            raise ModelFormatError(f"{where}: YaRN needs a positive factor and original context length")
        yarn = (self.rope_base, self.rope_factor, self.rope_beta_fast, self.rope_beta_slow)
        # the correction range takes logarithms of these and divides by log(base)
        if self.rope_scaling == "yarn" and not (all(map(math.isfinite, yarn)) and self.rope_base > 1
                                                and self.rope_beta_fast > 0 and self.rope_beta_slow > 0):
            raise ModelFormatError(f"{where}: YaRN needs finite values, rope base > 1 and positive betas, got "
                                   f"base {self.rope_base}, factor {self.rope_factor}, betas {self.rope_beta_fast}, "
                                   f"{self.rope_beta_slow}")


def llama_cpp_sliding_layers(n_layers: int, pattern: int = 2) -> list:
    """llama.cpp's `set_swa_pattern(n)`: layer i slides iff i % n < n - 1 (gpt-oss: n = 2, even layers)."""
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]


def config_from_gguf(meta: dict, where: str) -> GptOssConfig:
    key = arch_key_reader(meta, ARCH, where)
    n_layers = key("block_count")
    pattern = meta.get(f"{ARCH}.attention.sliding_window_pattern", 2)
    sliding = llama_cpp_sliding_layers(n_layers, pattern) if isinstance(pattern, int) else [bool(p) for p in pattern]
    scaling = meta.get(f"{ARCH}.rope.scaling.type", "none")
    cfg = GptOssConfig(
        **fields_from_gguf(meta, key), n_layers=n_layers, sliding_layers=sliding, rope_scaling=scaling,
        expert_ff=key("expert_feed_forward_length", meta.get(f"{ARCH}.feed_forward_length")),
        sliding_window=meta.get(f"{ARCH}.attention.sliding_window"))
    if scaling == "yarn":
        attn = meta.get(f"{ARCH}.rope.scaling.attn_factor")
        cfg.rope_factor = float(key("rope.scaling.factor"))
        cfg.rope_original_context = int(key("rope.scaling.original_context_length"))
        cfg.rope_beta_fast = float(key("rope.scaling.yarn_beta_fast", 32.0))
        cfg.rope_beta_slow = float(key("rope.scaling.yarn_beta_slow", 1.0))
        cfg.rope_truncate = bool(key("rope.scaling.yarn_truncate", False))
        cfg.rope_attn_factor = None if attn is None else float(attn)
    cfg.swiglu_limit = float(key("swiglu_limit", 7.0))
    cfg.swiglu_alpha = float(key("swiglu_alpha", 1.702))
    cfg.validate(where)
    return cfg


def _yarn_attention_factor(rope: dict, factor: float) -> float | None:
    """transformers' rule: an explicit attention_factor, else mscale/mscale_all_dim, else the default (None)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return None


def config_from_hf(hf: dict, where: str) -> GptOssConfig:
    def key(name, *alternatives, default=None):
        for n in (name, *alternatives):
            if hf.get(n) is not None:
                return hf[n]
        if default is None:
            raise ModelFormatError(f"{where}: config.json has no {name}")
        return default

    if hf.get("attention_bias") is False:
        raise ModelFormatError(f"{where}: gpt-oss without attention biases is not supported")
    n_layers = key("num_hidden_layers")
    hidden = key("hidden_size")
    n_head = key("num_attention_heads")
    layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                            for i in range(n_layers)]
    if len(layer_types) != n_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ModelFormatError(f"{where}: layer_types must name sliding_attention/full_attention for each of "
                               f"{n_layers} layers")
    # transformers reads `rope_parameters` (v5) or `rope_scaling` (v4, theta beside it), and falls back
    # to gpt-oss's own YaRN block when the config names none.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or HF_DEFAULT_ROPE)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelFormatError(f"{where}: gpt-oss rotates whole heads (partial_rotary_factor must be 1)")
    cfg = GptOssConfig(
        n_layers=n_layers, hidden=hidden, vocab=key("vocab_size"), n_head=n_head,
        n_kv_head=key("num_key_value_heads", default=n_head), head_dim=key("head_dim", default=hidden // n_head),
        rms_eps=float(key("rms_norm_eps", default=1e-5)), n_expert=key("num_local_experts", "num_experts"),
        n_expert_used=key("num_experts_per_tok", "experts_per_token"), expert_ff=key("intermediate_size"),
        context_length=key("max_position_embeddings", default=131072), sliding_window=hf.get("sliding_window", 128),
        sliding_layers=[t == "sliding_attention" for t in layer_types],
        rope_base=float(rope.get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA))),
        swiglu_limit=float(key("swiglu_limit", default=7.0)), swiglu_alpha=float(key("swiglu_alpha", default=1.702)))
    if rope_type == "yarn":
        original = rope.get("original_max_position_embeddings")
        if original is None:
            raise ModelFormatError(f"{where}: YaRN rope parameters have no original_max_position_embeddings")
        factor = rope.get("factor")
        factor = float(factor if factor is not None else cfg.context_length / original)
        cfg.rope_scaling = "yarn"
        cfg.rope_factor = factor
        cfg.rope_original_context = int(original)
        cfg.rope_beta_fast = float(rope.get("beta_fast") or 32.0)
        cfg.rope_beta_slow = float(rope.get("beta_slow") or 1.0)
        cfg.rope_truncate = bool(rope.get("truncate", True))      # transformers' default when absent
        cfg.rope_attn_factor = _yarn_attention_factor(rope, factor)
    elif rope_type != "default":
        raise ModelFormatError(f"{where}: unsupported rope_type {rope_type!r} (supported: default, yarn)")
    cfg.validate(where)
    return cfg


def layer_mixer(cfg: GptOssConfig, i: int) -> AttentionSpec:
    """Attention with sinks and biases, over a sliding window on the layers that slide."""
    window = cfg.sliding_window if cfg.is_sliding(i) else None
    return AttentionSpec(cfg.n_head, cfg.n_kv_head, cfg.head_dim, bias=True, sinks=True, window=window)


def rope(cfg: GptOssConfig):
    return cfg.rope_tables()


def layer_ffn(cfg: GptOssConfig, i: int) -> MoESpec:
    # router: top-k of the biased logits, softmax over those k
    activation = partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    return MoESpec(cfg.n_expert, cfg.n_expert_used, cfg.expert_ff, route_topk_softmax, activation, bias=True)


def gguf_metadata(cfg: GptOssConfig) -> dict:
    """The `gpt-oss.*` GGUF keys for cfg (the inverse of config_from_gguf)."""
    meta = {
        **cfg.gguf_metadata(),
        "rope.dimension_count": cfg.head_dim,
        "attention.sliding_window_pattern": [bool(s) for s in cfg.sliding_layers],
        "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha,
    }
    if cfg.sliding_window is not None:
        meta["attention.sliding_window"] = cfg.sliding_window
    if cfg.rope_scaling == "yarn":
        meta.update({"rope.scaling.type": "yarn", "rope.scaling.factor": cfg.rope_factor,
                     "rope.scaling.original_context_length": cfg.rope_original_context,
                     "rope.scaling.yarn_beta_fast": cfg.rope_beta_fast, "rope.scaling.yarn_beta_slow": cfg.rope_beta_slow,
                     "rope.scaling.yarn_truncate": cfg.rope_truncate})
        if cfg.rope_attn_factor is not None:
            meta["rope.scaling.attn_factor"] = cfg.rope_attn_factor
    return meta


FAMILY = Family(arch=ARCH, hf_model_types=("gpt_oss",), tokenizer_pre=TOKENIZER_PRE, chat_format="harmony",
                config_from_gguf=config_from_gguf, config_from_hf=config_from_hf, gguf_metadata=gguf_metadata,
                hf_weights=GptOssHFWeights, layer_mixer=layer_mixer, rope=rope, layer_ffn=layer_ffn)
