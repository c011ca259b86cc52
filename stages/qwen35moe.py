"""Qwen3.5-MoE (GGUF arch `qwen35moe`): Gated DeltaNet layers, every Nth layer gated full attention,
routed + shared-expert MoE.

Weights use the GGUF conventions throughout (see docs/model-formats.md §2): tensor names `blk.N.*`, V heads in
tiled order (V head vh reads K head vh % n_k_heads), RMSNorm weights with the +1 baked in,
`ssm_a = -exp(A_log)`. `qwen35moe_hf.py` maps an HF checkpoint onto these conventions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention import attention
from kernels.deltanet import causal_conv1d, delta_rule_chunked, delta_rule_recurrent, delta_rule_step
from kernels.linear import linear
from kernels.weights import cat_weights
from kernels.moe import combine_slots, expert_slot_outputs, route_softmax_topk, swiglu
from kernels.norms import gated_rms_norm, rms_norm
from kernels.rope import apply_rope, inv_frequencies, rope_cos_sin

from .block import Block
from .cache import DeltaNetCache, KVCache
from .errors import ModelFormatError
from .gguf_file import arch_key_reader

ARCH = "qwen35moe"
TOKENIZER_PRE = "qwen35"
CHUNKED_PREFILL_MIN = 16   # chunks at least this long use the chunked delta rule


@dataclass
class Qwen35MoeConfig:
    n_layers: int
    hidden: int
    vocab: int
    n_head: int
    n_kv_head: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rope_sections: list
    rms_eps: float
    n_expert: int
    n_expert_used: int
    expert_ff: int
    shared_ff: int
    conv_kernel: int
    k_head_dim: int
    n_k_heads: int
    n_v_heads: int
    v_head_dim: int
    full_attention_interval: int
    context_length: int
    arch: str = ARCH

    def is_full_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval == 0

    @property
    def key_dim(self) -> int:
        return self.k_head_dim * self.n_k_heads

    @property
    def value_dim(self) -> int:
        return self.v_head_dim * self.n_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def validate(self, where: str):
        positive = ["n_layers", "hidden", "vocab", "n_head", "n_kv_head", "head_dim", "n_expert", "n_expert_used",
                    "expert_ff", "conv_kernel", "k_head_dim", "n_k_heads", "n_v_heads", "v_head_dim",
                    "full_attention_interval", "context_length"]
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ModelFormatError(f"{where}: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_head % self.n_kv_head or self.n_v_heads % self.n_k_heads:
            raise ModelFormatError(f"{where}: head counts do not divide ({self.n_head}/{self.n_kv_head} attention, "
                                   f"{self.n_v_heads}/{self.n_k_heads} DeltaNet)")
        if self.n_expert_used > self.n_expert:
            raise ModelFormatError(f"{where}: expert_used_count {self.n_expert_used} > expert_count {self.n_expert}")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ModelFormatError(f"{where}: rope dimension {self.rope_dim} invalid for head_dim {self.head_dim}")


def config_from_gguf(meta: dict, where: str) -> Qwen35MoeConfig:
    key = arch_key_reader(meta, ARCH, where)
    n_embd = key("embedding_length")
    n_head = key("attention.head_count", positive=True)
    tokens = meta.get("tokenizer.ggml.tokens")
    cfg = Qwen35MoeConfig(
        n_layers=key("block_count") - key("nextn_predict_layers", 0),
        hidden=n_embd,
        vocab=key("vocab_size", len(tokens) if tokens else None),
        n_head=n_head,
        n_kv_head=key("attention.head_count_kv"),
        head_dim=key("attention.key_length", n_embd // n_head),
        rope_dim=key("rope.dimension_count"),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_sections=list(key("rope.dimension_sections", [0, 0, 0, 0])),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        n_expert=key("expert_count"),
        n_expert_used=key("expert_used_count"),
        expert_ff=key("expert_feed_forward_length"),
        shared_ff=key("expert_shared_feed_forward_length", 0),
        conv_kernel=key("ssm.conv_kernel"),
        k_head_dim=key("ssm.state_size"),
        n_k_heads=key("ssm.group_count"),
        n_v_heads=key("ssm.time_step_rank"),
        v_head_dim=key("ssm.inner_size") // key("ssm.time_step_rank", positive=True),
        full_attention_interval=key("full_attention_interval", 4),
        context_length=key("context_length"),
    )
    cfg.validate(where)
    return cfg


def config_from_hf(hf: dict, where: str) -> Qwen35MoeConfig:
    if hf.get("model_type") == "qwen3_5_moe":
        hf = hf.get("text_config") or {}
    def key(name, default=None):
        value = hf.get(name, default)
        if value is None:
            raise ModelFormatError(f"{where}: config.json has no {name}")
        return value

    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    n_layers = key("num_hidden_layers")
    head_dim = hf.get("head_dim") or key("hidden_size") // key("num_attention_heads")
    layer_types = hf.get("layer_types")
    interval = hf.get("full_attention_interval", 4)
    if layer_types:
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        interval = full[0] + 1 if full else n_layers + 1
        expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        if list(layer_types) != expected:
            raise ModelFormatError(f"{where}: layer_types is not a regular full-attention interval")
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    cfg = Qwen35MoeConfig(
        n_layers=n_layers,
        hidden=key("hidden_size"),
        vocab=key("vocab_size"),
        n_head=key("num_attention_heads"),
        n_kv_head=key("num_key_value_heads"),
        head_dim=head_dim,
        rope_dim=int(head_dim * partial),
        rope_base=float(theta),
        rope_sections=(sections + [0, 0, 0, 0])[:4],
        rms_eps=float(key("rms_norm_eps")),
        n_expert=key("num_experts"),
        n_expert_used=key("num_experts_per_tok"),
        expert_ff=key("moe_intermediate_size"),
        shared_ff=hf.get("shared_expert_intermediate_size") or 0,
        conv_kernel=key("linear_conv_kernel_dim"),
        k_head_dim=key("linear_key_head_dim"),
        n_k_heads=key("linear_num_key_heads"),
        n_v_heads=key("linear_num_value_heads"),
        v_head_dim=key("linear_value_head_dim"),
        full_attention_interval=interval,
        context_length=hf.get("max_position_embeddings", 32768),
    )
    cfg.validate(where)
    return cfg


def layer_tensor_shapes(cfg: Qwen35MoeConfig, i: int) -> dict:
    """Every tensor of layer i with its shape in torch order (GGUF ne reversed)."""
    p, H, E, Fe = f"blk.{i}.", cfg.hidden, cfg.n_expert, cfg.expert_ff
    shapes = {p + "attn_norm.weight": (H,), p + "post_attention_norm.weight": (H,)}
    if cfg.is_full_attention(i):
        qd, kvd = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        shapes.update({p + "attn_q.weight": (2 * qd, H), p + "attn_k.weight": (kvd, H), p + "attn_v.weight": (kvd, H),
                       p + "attn_q_norm.weight": (cfg.head_dim,), p + "attn_k_norm.weight": (cfg.head_dim,),
                       p + "attn_output.weight": (H, qd)})
    else:
        nv = cfg.n_v_heads
        shapes.update({p + "attn_qkv.weight": (cfg.conv_dim, H), p + "attn_gate.weight": (cfg.value_dim, H),
                       p + "ssm_conv1d.weight": (cfg.conv_dim, cfg.conv_kernel), p + "ssm_dt.bias": (nv,),
                       p + "ssm_a": (nv,), p + "ssm_beta.weight": (nv, H), p + "ssm_alpha.weight": (nv, H),
                       p + "ssm_norm.weight": (cfg.v_head_dim,), p + "ssm_out.weight": (H, cfg.value_dim)})
    shapes.update({p + "ffn_gate_inp.weight": (E, H), p + "ffn_gate_exps.weight": (E, Fe, H),
                   p + "ffn_up_exps.weight": (E, Fe, H), p + "ffn_down_exps.weight": (E, H, Fe)})
    if cfg.shared_ff:
        S = cfg.shared_ff
        shapes.update({p + "ffn_gate_inp_shexp.weight": (H,), p + "ffn_gate_shexp.weight": (S, H),
                       p + "ffn_up_shexp.weight": (S, H), p + "ffn_down_shexp.weight": (H, S)})
    return shapes


def layer_cache_bytes(cfg: Qwen35MoeConfig, i: int) -> int:
    """The most one sequence's cache of layer i takes: a full context of keys and values, or the
    DeltaNet state (whatever the length)."""
    if cfg.is_full_attention(i):
        return KVCache.bytes_for(cfg.context_length, cfg.n_kv_head, cfg.head_dim)
    return DeltaNetCache.bytes_for(cfg.conv_kernel, cfg.conv_dim, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim)


def global_tensor_shapes(cfg: Qwen35MoeConfig) -> dict:
    return {"token_embd.weight": (cfg.vocab, cfg.hidden), "output_norm.weight": (cfg.hidden,),
            "output.weight": (cfg.vocab, cfg.hidden)}


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class DeltaNetMixer:
    def __init__(self, cfg: Qwen35MoeConfig, w, p: str):
        self.cfg = cfg
        # The four projections of the input are stacked into one product (fewer, larger products).
        self.inputs = w.matrices([p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight",
                                  p + "ssm_alpha.weight"], 0)
        self.conv = w(p + "ssm_conv1d.weight")
        self.dt_bias = w(p + "ssm_dt.bias")
        self.a = w(p + "ssm_a")
        self.norm = w(p + "ssm_norm.weight")
        self.out = w.matrix(p + "ssm_out.weight")

    def new_cache(self):
        c = self.cfg
        return DeltaNetCache(c.conv_kernel, c.conv_dim, c.n_v_heads, c.k_head_dim, c.v_head_dim, self.conv.dtype)

    def _heads(self, mixed: torch.Tensor):
        """Split conv output [n, conv_dim] into L2-normalised q, k [n, H_v, dk] and v [n, H_v, dv]."""
        c, n = self.cfg, mixed.shape[0]
        q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        # Tiled V-head order: V head vh reads K head vh % n_k_heads, i.e. repeat (not interleave).
        repeat = c.n_v_heads // c.n_k_heads
        q = _l2norm(q.reshape(n, c.n_k_heads, c.k_head_dim)).repeat(1, repeat, 1)
        k = _l2norm(k.reshape(n, c.n_k_heads, c.k_head_dim)).repeat(1, repeat, 1)
        return q, k, v.reshape(n, c.n_v_heads, c.v_head_dim)

    def __call__(self, x: torch.Tensor, ctx, layer: int) -> torch.Tensor:
        c = self.cfg
        qkv, z, beta, alpha = linear(x, self.inputs).split([c.conv_dim, c.value_dim, c.n_v_heads, c.n_v_heads], dim=-1)
        beta, alpha = torch.sigmoid(beta.float()), alpha.float()
        g = self.a * F.softplus(alpha + self.dt_bias)
        y = torch.empty(x.shape[0], c.n_v_heads, c.v_head_dim)
        singles = []
        for sid, rows, _ in ctx.batch.segments():
            cache = ctx.caches[sid][layer]
            if rows.stop - rows.start == 1:
                singles.append((rows.start, cache))
                continue
            mixed, cache.conv = causal_conv1d(qkv[rows], self.conv, cache.conv)
            q, k, v = self._heads(mixed)
            rule = delta_rule_chunked if mixed.shape[0] >= CHUNKED_PREFILL_MIN else delta_rule_recurrent
            y[rows], cache.state = rule(q, k, v, g[rows], beta[rows], cache.state)
        if singles:
            self._decode_step(qkv, g, beta, singles, y)
        y = gated_rms_norm(y.to(x.dtype), z.reshape(y.shape), self.norm, c.rms_eps)
        return linear(y.reshape(x.shape[0], c.value_dim), self.out)

    def _decode_step(self, qkv, g, beta, singles, y):
        """One token for each of several sequences at once, their states stacked."""
        idx = torch.tensor([row for row, _ in singles])
        caches = [cache for _, cache in singles]
        mixed, conv = causal_conv1d(qkv[idx][:, None], self.conv, torch.stack([ch.conv for ch in caches]))
        q, k, v = self._heads(mixed[:, 0])
        y[idx] = delta_rule_step(q * self.cfg.k_head_dim ** -0.5, k, v.float(), g[idx], beta[idx],
                                 self._stacked_states(caches))
        for i, ch in enumerate(caches):
            ch.conv = conv[i]

    @staticmethod
    def _stacked_states(caches) -> torch.Tensor:
        """The caches' states as one tensor [n, H, dk, dv] that each cache then holds a view of:
        while the same sequences keep decoding together, later steps find them stacked already."""
        stacked = caches[0].stacked
        if stacked is None or stacked.shape[0] != len(caches) or \
                any(ch.stacked is not stacked or ch.state is not ch.stacked_view or ch.stacked_index != i
                    for i, ch in enumerate(caches)):
            stacked = torch.stack([ch.state for ch in caches])
            for i, ch in enumerate(caches):
                ch.state = ch.stacked_view = stacked[i]
                ch.stacked, ch.stacked_index = stacked, i
        return stacked


class GatedAttentionMixer:
    def __init__(self, cfg: Qwen35MoeConfig, w, p: str):
        self.cfg = cfg
        self.qkv = w.matrices([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], 0)
        self.q_norm = w(p + "attn_q_norm.weight")
        self.k_norm = w(p + "attn_k_norm.weight")
        self.o = w.matrix(p + "attn_output.weight")
        self.inv_freq = inv_frequencies(cfg.rope_base, cfg.rope_dim)

    def new_cache(self):
        return KVCache(max_len=self.cfg.context_length)

    def __call__(self, x: torch.Tensor, ctx, layer: int) -> torch.Tensor:
        c, T = self.cfg, x.shape[0]
        kv_dim = c.n_kv_head * c.head_dim
        qg, k, v = linear(x, self.qkv).split([2 * c.n_head * c.head_dim, kv_dim, kv_dim], dim=-1)
        qg = qg.reshape(T, c.n_head, 2 * c.head_dim)
        q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:].reshape(T, -1)
        k, v = k.reshape(T, c.n_kv_head, c.head_dim), v.reshape(T, c.n_kv_head, c.head_dim)
        q, k = rms_norm(q, self.q_norm, c.rms_eps), rms_norm(k, self.k_norm, c.rms_eps)
        if "rope" not in ctx.memo:
            ctx.memo["rope"] = rope_cos_sin(ctx.positions, self.inv_freq)
        cos, sin = ctx.memo["rope"]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = torch.empty_like(q)
        for sid, rows, _ in ctx.batch.segments():
            keys, values, k_pos = ctx.caches[sid][layer].extend(k[rows], v[rows], ctx.positions[rows])
            out[rows] = attention(q[rows], keys, values, ctx.positions[rows], k_pos, c.head_dim ** -0.5)
        out = out.reshape(T, -1) * torch.sigmoid(gate)
        return linear(out, self.o)


def load_experts(cfg: Qwen35MoeConfig, w, layer: int, experts: range | None = None):
    """The routed experts of one layer (a slice of them for expert parallelism) as a function
    (x, ids) -> (slots, rows); see kernels.moe.expert_slot_outputs."""
    p = f"blk.{layer}."
    gate_up = w.matrices([p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"], 1, experts)
    down = w.matrix(p + "ffn_down_exps.weight", experts)
    return lambda x, ids: expert_slot_outputs(x, ids, gate_up, down, experts=experts)


class MoEFeedForward:
    def __init__(self, cfg: Qwen35MoeConfig, w, layer: int, remote_experts=None):
        p = f"blk.{layer}."
        self.cfg = cfg
        # Routed experts run here, or in expert actors behind `remote_experts(layer, x, ids)`.
        if remote_experts is None:
            self.experts = load_experts(cfg, w, layer)
        else:
            self.experts = lambda x, ids: remote_experts(layer, x, ids)
        # One product gives the router logits and, with a shared expert, its gate and gate/up.
        inputs = [w.matrix(p + "ffn_gate_inp.weight")]
        if cfg.shared_ff:
            inputs += [w(p + "ffn_gate_inp_shexp.weight").view(1, -1), w.matrix(p + "ffn_gate_shexp.weight"),
                       w.matrix(p + "ffn_up_shexp.weight")]
            self.shared_down = w.matrix(p + "ffn_down_shexp.weight")
        self.inputs = cat_weights(inputs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        sizes = [c.n_expert, 1, 2 * c.shared_ff] if c.shared_ff else [c.n_expert, 0, 0]
        logits, shared_gate, shared_gate_up = linear(x, self.inputs).split(sizes, dim=-1)
        weights, ids = route_softmax_topk(logits, c.n_expert_used)
        y = combine_slots(*self.experts(x, ids), weights)
        if c.shared_ff:
            y = y + torch.sigmoid(shared_gate) * linear(swiglu(shared_gate_up), self.shared_down)
        return y


def Layer(cfg, w, i: int, remote_experts=None) -> Block:
    """Layer i: its mixer and MoE feed-forward in the shared pre-norm block."""
    return Block(w, i, cfg.rms_eps, (GatedAttentionMixer if cfg.is_full_attention(i) else DeltaNetMixer)(cfg, w, f"blk.{i}."), MoEFeedForward(cfg, w, i, remote_experts))


def hf_weights(files, cfg: Qwen35MoeConfig):
    from .qwen35moe_hf import Qwen35MoeHFWeights
    return Qwen35MoeHFWeights(files, cfg)


def gguf_metadata(cfg: Qwen35MoeConfig) -> dict:
    """The `qwen35moe.*` GGUF keys for cfg (the inverse of config_from_gguf)."""
    return {
        "block_count": cfg.n_layers, "context_length": cfg.context_length, "embedding_length": cfg.hidden,
        "feed_forward_length": cfg.expert_ff, "vocab_size": cfg.vocab,
        "attention.head_count": cfg.n_head, "attention.head_count_kv": cfg.n_kv_head,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "attention.layer_norm_rms_epsilon": cfg.rms_eps, "rope.freq_base": cfg.rope_base,
        "rope.dimension_count": cfg.rope_dim, "rope.dimension_sections": list(cfg.rope_sections),
        "expert_count": cfg.n_expert, "expert_used_count": cfg.n_expert_used,
        "expert_feed_forward_length": cfg.expert_ff, "expert_shared_feed_forward_length": cfg.shared_ff,
        "ssm.conv_kernel": cfg.conv_kernel, "ssm.state_size": cfg.k_head_dim, "ssm.group_count": cfg.n_k_heads,
        "ssm.time_step_rank": cfg.n_v_heads, "ssm.inner_size": cfg.value_dim,
        "full_attention_interval": cfg.full_attention_interval,
    }
