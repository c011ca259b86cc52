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

import torch

from kernels.attention import attention
from kernels.linear import linear
from kernels.moe import combine_slots, expert_slot_outputs, route_topk_softmax
from kernels.rope import apply_rope, inv_frequencies, rope_cos_sin, yarn_inv_frequencies

from .block import Block
from .cache import KVCache
from .errors import ModelFormatError
from .gguf_file import arch_key_reader

ARCH = "gpt-oss"
PREFILL_CHUNK_MAX = 512    # the most tokens of one sequence a step holds (the default max_batch_tokens)
TOKENIZER_PRE = "gpt-4o"
DEFAULT_ROPE_THETA = 150000.0           # transformers' GptOssConfig.default_theta
# transformers' GptOssConfig fills in this block when a config names no RoPE parameters at all.
HF_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                   "original_max_position_embeddings": 4096}


@dataclass
class GptOssConfig:
    n_layers: int
    hidden: int
    vocab: int
    n_head: int
    n_kv_head: int
    head_dim: int
    rms_eps: float
    n_expert: int
    n_expert_used: int
    expert_ff: int
    context_length: int
    sliding_window: int | None          # None: no layer slides
    sliding_layers: list                # bool per layer
    rope_base: float
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
        positive = ["n_layers", "hidden", "vocab", "n_head", "n_kv_head", "head_dim", "n_expert", "n_expert_used",
                    "expert_ff", "context_length"]
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ModelFormatError(f"{where}: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_head % self.n_kv_head:
            raise ModelFormatError(f"{where}: {self.n_head} attention heads do not divide into {self.n_kv_head} KV heads")
        if self.n_expert_used > self.n_expert:
            raise ModelFormatError(f"{where}: expert_used_count {self.n_expert_used} > expert_count {self.n_expert}")
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
    n_embd = key("embedding_length")
    n_head = key("attention.head_count", positive=True)
    tokens = meta.get("tokenizer.ggml.tokens")
    pattern = meta.get(f"{ARCH}.attention.sliding_window_pattern", 2)
    sliding = llama_cpp_sliding_layers(n_layers, pattern) if isinstance(pattern, int) else [bool(p) for p in pattern]
    scaling = meta.get(f"{ARCH}.rope.scaling.type", "none")
    cfg = GptOssConfig(
        n_layers=n_layers,
        hidden=n_embd,
        vocab=key("vocab_size", len(tokens) if tokens else None),
        n_head=n_head,
        n_kv_head=key("attention.head_count_kv"),
        head_dim=key("attention.key_length", n_embd // n_head),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        n_expert=key("expert_count"),
        n_expert_used=key("expert_used_count"),
        expert_ff=key("expert_feed_forward_length", meta.get(f"{ARCH}.feed_forward_length")),
        context_length=key("context_length"),
        sliding_window=meta.get(f"{ARCH}.attention.sliding_window"),
        sliding_layers=sliding,
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
    )
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
        n_layers=n_layers,
        hidden=hidden,
        vocab=key("vocab_size"),
        n_head=n_head,
        n_kv_head=key("num_key_value_heads", default=n_head),
        head_dim=key("head_dim", default=hidden // n_head),
        rms_eps=float(key("rms_norm_eps", default=1e-5)),
        n_expert=key("num_local_experts", "num_experts"),
        n_expert_used=key("num_experts_per_tok", "experts_per_token"),
        expert_ff=key("intermediate_size"),
        context_length=key("max_position_embeddings", default=131072),
        sliding_window=hf.get("sliding_window", 128),
        sliding_layers=[t == "sliding_attention" for t in layer_types],
        rope_base=float(rope.get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA))),
        swiglu_limit=float(key("swiglu_limit", default=7.0)),
        swiglu_alpha=float(key("swiglu_alpha", default=1.702)),
    )
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


def layer_tensor_shapes(cfg: GptOssConfig, i: int) -> dict:
    """Every tensor of layer i with its shape in torch order (GGUF ne reversed)."""
    p, H, E, I = f"blk.{i}.", cfg.hidden, cfg.n_expert, cfg.expert_ff
    qd, kvd = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    return {
        p + "attn_norm.weight": (H,), p + "post_attention_norm.weight": (H,),
        p + "attn_q.weight": (qd, H), p + "attn_q.bias": (qd,),
        p + "attn_k.weight": (kvd, H), p + "attn_k.bias": (kvd,),
        p + "attn_v.weight": (kvd, H), p + "attn_v.bias": (kvd,),
        p + "attn_output.weight": (H, qd), p + "attn_output.bias": (H,),
        p + "attn_sinks.weight": (cfg.n_head,),
        p + "ffn_gate_inp.weight": (E, H), p + "ffn_gate_inp.bias": (E,),
        p + "ffn_gate_exps.weight": (E, I, H), p + "ffn_gate_exps.bias": (E, I),
        p + "ffn_up_exps.weight": (E, I, H), p + "ffn_up_exps.bias": (E, I),
        p + "ffn_down_exps.weight": (E, H, I), p + "ffn_down_exps.bias": (E, H),
    }


def layer_cache_bytes(cfg: GptOssConfig, i: int) -> int:
    """The most one sequence's cache of layer i takes: a full context of keys and values, or on a
    sliding layer twice the window plus a prefill chunk (what it holds before trimming)."""
    positions = cfg.context_length
    if cfg.is_sliding(i):
        positions = min(positions, 2 * cfg.sliding_window + PREFILL_CHUNK_MAX)
    return KVCache.bytes_for(positions, cfg.n_kv_head, cfg.head_dim)


def global_tensor_shapes(cfg: GptOssConfig) -> dict:
    return {"token_embd.weight": (cfg.vocab, cfg.hidden), "output_norm.weight": (cfg.hidden,),
            "output.weight": (cfg.vocab, cfg.hidden)}


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on `[gate | up]` (halves, as in GGUF):
    `(clamp(up, -limit, limit) + 1) · g · sigmoid(alpha · g)` with `g = min(gate, limit)`."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Attention:
    def __init__(self, cfg: GptOssConfig, w, p: str, i: int):
        self.cfg = cfg
        # q, k and v in one product (one pass over the activations)
        self.qkv = w.matrices([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], 0)
        self.qkv_bias = torch.cat([w(p + "attn_q.bias"), w(p + "attn_k.bias"), w(p + "attn_v.bias")])
        self.o, self.o_bias = w.matrix(p + "attn_output.weight"), w(p + "attn_output.bias")
        self.sinks = w(p + "attn_sinks.weight")
        self.window = cfg.sliding_window if cfg.is_sliding(i) else None

    def new_cache(self):
        return KVCache(window=self.window, max_len=self.cfg.context_length)

    def _rope(self, ctx):
        # one table per step, shared by every layer (the parameters are the model's, not the layer's)
        memo_key = (ARCH, "rope")
        if memo_key not in ctx.memo:
            inv_freq, scale = self.cfg.rope_tables()
            ctx.memo[memo_key] = rope_cos_sin(ctx.positions, inv_freq, scale)
        return ctx.memo[memo_key]

    def __call__(self, x: torch.Tensor, ctx, layer: int) -> torch.Tensor:
        c, T = self.cfg, x.shape[0]
        kv_dim = c.n_kv_head * c.head_dim
        q, k, v = linear(x, self.qkv, self.qkv_bias).split([c.n_head * c.head_dim, kv_dim, kv_dim], dim=-1)
        q, k, v = (t.reshape(T, -1, c.head_dim) for t in (q, k, v))
        cos, sin = self._rope(ctx)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = torch.empty_like(q)
        for sid, rows, _ in ctx.batch.segments():
            cache = ctx.caches[sid][layer]
            keys, values, k_pos = cache.extend(k[rows], v[rows], ctx.positions[rows])
            out[rows] = attention(q[rows], keys, values, ctx.positions[rows], k_pos, c.head_dim ** -0.5,
                                  window=self.window, sinks=self.sinks)
            cache.trim()       # sliding layers keep only the last `window` positions
        return linear(out.reshape(T, -1), self.o, self.o_bias)


def load_experts(cfg: GptOssConfig, w, layer: int, experts: range | None = None):
    """The routed experts of one layer (a slice of them for expert parallelism) as a function
    (x, ids) -> (slots, rows); see kernels.moe.expert_slot_outputs."""
    p = f"blk.{layer}."
    gate_up = w.matrices([p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"], 1, experts)
    gate_up_bias = torch.cat((w(p + "ffn_gate_exps.bias", experts), w(p + "ffn_up_exps.bias", experts)), dim=1)
    down, down_bias = w.matrix(p + "ffn_down_exps.weight", experts), w(p + "ffn_down_exps.bias", experts)

    def activation(h):
        return clamped_swiglu(h, cfg.swiglu_alpha, cfg.swiglu_limit)

    return lambda x, ids: expert_slot_outputs(x, ids, gate_up, down, activation, gate_up_bias, down_bias,
                                              experts=experts)


class MoEFeedForward:
    def __init__(self, cfg: GptOssConfig, w, layer: int, remote_experts=None):
        p = f"blk.{layer}."
        self.cfg = cfg
        self.router, self.router_bias = w.matrix(p + "ffn_gate_inp.weight"), w(p + "ffn_gate_inp.bias")
        # Routed experts run here, or in expert actors behind `remote_experts(layer, x, ids)`.
        if remote_experts is None:
            self.experts = load_experts(cfg, w, layer)
        else:
            self.experts = lambda x, ids: remote_experts(layer, x, ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # router: top-k of the biased logits, softmax over those k
        weights, ids = route_topk_softmax(linear(x, self.router, self.router_bias), self.cfg.n_expert_used)
        return combine_slots(*self.experts(x, ids), weights)


def Layer(cfg, w, i: int, remote_experts=None) -> Block:
    """Layer i: its mixer and MoE feed-forward in the shared pre-norm block."""
    return Block(w, i, cfg.rms_eps, Attention(cfg, w, f"blk.{i}.", i), MoEFeedForward(cfg, w, i, remote_experts))


def hf_weights(files, cfg: GptOssConfig):
    from .gptoss_hf import GptOssHFWeights
    return GptOssHFWeights(files, cfg)


def gguf_metadata(cfg: GptOssConfig) -> dict:
    """The `gpt-oss.*` GGUF keys for cfg (the inverse of config_from_gguf)."""
    meta = {
        "block_count": cfg.n_layers, "context_length": cfg.context_length, "embedding_length": cfg.hidden,
        "feed_forward_length": cfg.expert_ff, "expert_feed_forward_length": cfg.expert_ff, "vocab_size": cfg.vocab,
        "attention.head_count": cfg.n_head, "attention.head_count_kv": cfg.n_kv_head,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "attention.layer_norm_rms_epsilon": cfg.rms_eps, "rope.freq_base": cfg.rope_base,
        "rope.dimension_count": cfg.head_dim,
        "expert_count": cfg.n_expert, "expert_used_count": cfg.n_expert_used,
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
