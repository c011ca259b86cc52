"""Qwen3.5-MoE (GGUF arch `qwen35moe`): Gated DeltaNet layers, every Nth layer gated full attention,
routed + shared-expert MoE.

Weights use the GGUF conventions throughout (see docs/model-formats.md §2): tensor names `blk.N.*`, V heads in
tiled order (V head vh reads K head vh % n_k_heads), RMSNorm weights with the +1 baked in,
`ssm_a = -exp(A_log)`. `qwen35moe_hf.py` maps an HF checkpoint onto these conventions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.deltanet import GatedDeltaNet, causal_conv1d, delta_rule_chunked, delta_rule_recurrent
from kernels.linear import linear
from kernels.moe import route_softmax_topk
from kernels.rope import inv_frequencies

from .attention import Attention, AttentionSpec
from .cache import DeltaNetCache, KVCache
from .errors import ModelFormatError
from .family import Block, ModelConfig, fields_from_gguf
from .gguf_file import arch_key_reader
from .moe import MoE, MoESpec
from .qwen35moe_hf import Qwen35MoeHFWeights

ARCH = "qwen35moe"
TOKENIZER_PRE = "qwen35"
CHUNKED_PREFILL_MIN = 16   # chunks at least this long use the chunked delta rule


@dataclass
class Qwen35MoeConfig(ModelConfig):
    rope_dim: int
    rope_sections: list
    shared_ff: int
    conv_kernel: int
    k_head_dim: int
    n_k_heads: int
    n_v_heads: int
    v_head_dim: int
    full_attention_interval: int
    arch: str = ARCH

    POSITIVE = ModelConfig.POSITIVE + ("conv_kernel", "k_head_dim", "n_k_heads", "n_v_heads", "v_head_dim",
                                       "full_attention_interval")

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
        super().validate(where)
        if self.n_v_heads % self.n_k_heads:
            raise ModelFormatError(f"{where}: {self.n_v_heads} DeltaNet value heads do not divide into "
                                   f"{self.n_k_heads} key heads")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ModelFormatError(f"{where}: rope dimension {self.rope_dim} invalid for head_dim {self.head_dim}")


def config_from_gguf(meta: dict, where: str) -> Qwen35MoeConfig:
    key = arch_key_reader(meta, ARCH, where)
    cfg = Qwen35MoeConfig(
        **fields_from_gguf(meta, key), n_layers=key("block_count") - key("nextn_predict_layers", 0),
        expert_ff=key("expert_feed_forward_length"), shared_ff=key("expert_shared_feed_forward_length", 0),
        rope_dim=key("rope.dimension_count"), rope_sections=list(key("rope.dimension_sections", [0, 0, 0, 0])),
        conv_kernel=key("ssm.conv_kernel"), k_head_dim=key("ssm.state_size"), n_k_heads=key("ssm.group_count"),
        n_v_heads=key("ssm.time_step_rank"),
        v_head_dim=key("ssm.inner_size") // key("ssm.time_step_rank", positive=True),
        full_attention_interval=key("full_attention_interval", 4))
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
        n_layers=n_layers, hidden=key("hidden_size"), vocab=key("vocab_size"), n_head=key("num_attention_heads"),
        n_kv_head=key("num_key_value_heads"), head_dim=head_dim, rms_eps=float(key("rms_norm_eps")),
        rope_base=float(theta), rope_dim=int(head_dim * partial), rope_sections=(sections + [0, 0, 0, 0])[:4],
        n_expert=key("num_experts"), n_expert_used=key("num_experts_per_tok"),
        expert_ff=key("moe_intermediate_size"), shared_ff=hf.get("shared_expert_intermediate_size") or 0,
        conv_kernel=key("linear_conv_kernel_dim"), k_head_dim=key("linear_key_head_dim"),
        n_k_heads=key("linear_num_key_heads"), n_v_heads=key("linear_num_value_heads"),
        v_head_dim=key("linear_value_head_dim"), full_attention_interval=interval,
        context_length=hf.get("max_position_embeddings", 32768))
    cfg.validate(where)
    return cfg


def attention_spec(cfg: Qwen35MoeConfig) -> AttentionSpec:
    return AttentionSpec(cfg.n_head, cfg.n_kv_head, cfg.head_dim, qk_norm=True, output_gate=True)


def moe_spec(cfg: Qwen35MoeConfig) -> MoESpec:
    return MoESpec(cfg.n_expert, cfg.n_expert_used, cfg.expert_ff, route_softmax_topk, shared_ff=cfg.shared_ff)


def layer_tensor_shapes(cfg: Qwen35MoeConfig, i: int) -> dict:
    """Every tensor of layer i with its shape in torch order (GGUF ne reversed)."""
    p = f"blk.{i}."
    if cfg.is_full_attention(i):
        mixer = attention_spec(cfg).tensor_shapes(p, cfg.hidden)
    else:
        H, nv = cfg.hidden, cfg.n_v_heads
        mixer = {p + "attn_qkv.weight": (cfg.conv_dim, H), p + "attn_gate.weight": (cfg.value_dim, H),
                 p + "ssm_conv1d.weight": (cfg.conv_dim, cfg.conv_kernel), p + "ssm_dt.bias": (nv,),
                 p + "ssm_a": (nv,), p + "ssm_beta.weight": (nv, H), p + "ssm_alpha.weight": (nv, H),
                 p + "ssm_norm.weight": (cfg.v_head_dim,), p + "ssm_out.weight": (H, cfg.value_dim)}
    return {**Block.norm_shapes(i, cfg.hidden), **mixer, **moe_spec(cfg).tensor_shapes(p, cfg.hidden)}


def layer_cache_bytes(cfg: Qwen35MoeConfig, i: int, length: int | None = None, chunk: int = 512) -> int:
    """The most one sequence's cache of layer i takes: keys and values for a full context (or for a
    sequence never longer than `length`), or the DeltaNet state (whatever the length or step chunk)."""
    if cfg.is_full_attention(i):
        positions = cfg.context_length if length is None else KVCache.capacity_bound(length, cfg.context_length)
        return KVCache.bytes_for(positions, cfg.n_kv_head, cfg.head_dim)
    return DeltaNetCache.bytes_for(cfg.conv_kernel, cfg.conv_dim, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim)


class DeltaNetMixer:
    def __init__(self, cfg: Qwen35MoeConfig, w, p: str):
        self.cfg = cfg
        # The four projections of the input are stacked into one product (fewer, larger products).
        self.inputs = w.matrices([p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight",
                                  p + "ssm_alpha.weight"], 0)
        self.net = GatedDeltaNet(w(p + "ssm_conv1d.weight"), w(p + "ssm_a"), w(p + "ssm_dt.bias"),
                                 w(p + "ssm_norm.weight"), cfg.rms_eps, cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim,
                                 cfg.v_head_dim)
        self.out = w.matrix(p + "ssm_out.weight")

    def new_cache(self):
        c, conv = self.cfg, self.net.conv
        return DeltaNetCache(c.conv_kernel, c.conv_dim, c.n_v_heads, c.k_head_dim, c.v_head_dim, conv.dtype,
                             conv.device)

    def __call__(self, x: torch.Tensor, ctx, layer: int) -> torch.Tensor:
        c, net = self.cfg, self.net
        qkv, z, beta, alpha = self._projections(x)
        y = torch.empty(x.shape[0], c.value_dim, device=x.device)       # the out projection's input
        singles = []
        for sid, rows, _ in ctx.batch.segments():
            cache = ctx.caches[sid][layer]
            if rows.stop - rows.start == 1:
                singles.append((rows.start, cache))
                continue
            mixed, cache.conv = causal_conv1d(qkv[rows], net.conv, cache.conv)
            q, k, v = net.heads(mixed)
            g, b = net.gates(beta[rows], alpha[rows])
            rule = delta_rule_chunked if mixed.shape[0] >= CHUNKED_PREFILL_MIN else delta_rule_recurrent
            out, cache.state = rule(q, k, v, g, b, cache.state)
            y[rows] = net.output(out, z[rows])
        if singles:
            # one token of each of these sequences at once, their caches stacked
            conv, state = self._stacked_caches([cache for _, cache in singles])
            net.decode(qkv, z, beta, alpha, [row for row, _ in singles], conv, state, y)
        return linear(y, self.out)

    def decode_inputs(self, ctx, layer: int):
        """A decode step's host part: the sequences' caches stacked, (conv [n, K-1, C], state [n, H, dk, dv])."""
        return self._stacked_caches([ctx.caches[sid][layer] for sid in ctx.batch.seq_ids])

    def decode(self, x: torch.Tensor, caches) -> torch.Tensor:
        """One token of each sequence (row i is sequence i's); the stacked caches are updated in place."""
        return linear(self.net.decode_all(*self._projections(x), *caches), self.out)

    def decode_done(self, ctx, layer: int) -> None:
        pass

    def _projections(self, x: torch.Tensor):
        """qkv [T, C], z [T, H_v * dv], beta and alpha [T, H_v]: column slices of one product."""
        c = self.cfg
        return linear(x, self.inputs).split([c.conv_dim, c.value_dim, c.n_v_heads, c.n_v_heads], dim=-1)

    @staticmethod
    def _stacked_caches(caches) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches' conv inputs and states as tensors [n, K-1, C] and [n, H, dk, dv] that each cache
        then holds rows of: while the same sequences keep decoding together, later steps find them
        stacked already."""
        first = caches[0].stacked
        def row_of(ch, i):
            s = ch.stacked      # (conv stack, state stack, row, conv row, state row)
            return s is not None and s[0] is first[0] and s[1] is first[1] and s[2] == i and \
                ch.conv is s[3] and ch.state is s[4]
        if first is None or first[0].shape[0] != len(caches) or not all(row_of(ch, i) for i, ch in enumerate(caches)):
            conv, state = torch.stack([ch.conv for ch in caches]), torch.stack([ch.state for ch in caches])
            for i, ch in enumerate(caches):
                ch.conv, ch.state = conv[i], state[i]
                ch.stacked = (conv, state, i, ch.conv, ch.state)
            return conv, state
        return first[0], first[1]


def layer_prefix_bytes(cfg: Qwen35MoeConfig, i: int, block: int) -> tuple[int, int]:
    """(bytes per cached block, bytes per snapshot) of layer i in the prefix cache: a full-attention layer
    keeps the block's keys and values, a DeltaNet layer its conv inputs and state at a block's end."""
    if cfg.is_full_attention(i):
        return KVCache.bytes_for(block, cfg.n_kv_head, cfg.head_dim), 0
    return 0, layer_cache_bytes(cfg, i)


def build_layer(cfg: Qwen35MoeConfig, w, i: int, remote_experts=None) -> Block:
    """Layer i: gated attention or a DeltaNet mixer, and the MoE feed-forward, in the shared pre-norm block."""
    p = f"blk.{i}."
    if cfg.is_full_attention(i):
        # partial RoPE: the multi-section form reduces to it for text, whose position components are all equal
        rope = inv_frequencies(cfg.rope_base, cfg.rope_dim), 1.0
        mixer = Attention(attention_spec(cfg), w, p, cfg.rms_eps, rope, max_len=cfg.context_length)
    else:
        mixer = DeltaNetMixer(cfg, w, p)
    return Block(w, i, cfg.rms_eps, mixer, MoE(moe_spec(cfg), w, i, remote_experts))


hf_weights = Qwen35MoeHFWeights     # (SafetensorsDir, config) -> tensors in this module's conventions


def gguf_metadata(cfg: Qwen35MoeConfig) -> dict:
    """The `qwen35moe.*` GGUF keys for cfg (the inverse of config_from_gguf)."""
    return {
        **cfg.gguf_metadata(),
        "rope.dimension_count": cfg.rope_dim, "rope.dimension_sections": list(cfg.rope_sections),
        "expert_shared_feed_forward_length": cfg.shared_ff,
        "ssm.conv_kernel": cfg.conv_kernel, "ssm.state_size": cfg.k_head_dim, "ssm.group_count": cfg.n_k_heads,
        "ssm.time_step_rank": cfg.n_v_heads, "ssm.inner_size": cfg.value_dim,
        "full_attention_interval": cfg.full_attention_interval,
    }
