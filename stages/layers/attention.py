"""The attention layer of every family: grouped-query attention of each sequence's new tokens over its KV
cache, with the options a family's `AttentionSpec` turns on."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raymoe.kernels import attention as kernels_attention, rope as kernels_rope, token_calls
from raymoe.kernels.attention import attention
from raymoe.kernels.linear import linear
from raymoe.kernels.norms import rms_norm
from raymoe.kernels.pointwise import sigmoid
from raymoe.kernels.rope import apply_rope, rope_cos_sin

from raymoe.stages.layers.cache import KVCache


@dataclass(frozen=True)
class AttentionSpec:
    n_head: int
    n_kv_head: int
    head_dim: int
    bias: bool = False          # biases on q, k, v and the output (gpt-oss)
    qk_norm: bool = False       # per-head RMSNorm of q and k (Qwen)
    output_gate: bool = False   # each q head is followed by a gate head; the output is scaled by its sigmoid (Qwen)
    sinks: bool = False         # one learned logit per head takes part in the softmax (gpt-oss)
    window: int | None = None   # a sliding window of this many positions (None: the whole context)

    def tensor_shapes(self, p: str, hidden: int) -> dict:
        qd, kvd = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        shapes = {p + "attn_q.weight": ((2 if self.output_gate else 1) * qd, hidden),
                  p + "attn_k.weight": (kvd, hidden), p + "attn_v.weight": (kvd, hidden),
                  p + "attn_output.weight": (hidden, qd)}
        if self.bias:
            shapes.update({p + "attn_q.bias": (qd,), p + "attn_k.bias": (kvd,), p + "attn_v.bias": (kvd,),
                           p + "attn_output.bias": (hidden,)})
        if self.qk_norm:
            shapes.update({p + "attn_q_norm.weight": (self.head_dim,), p + "attn_k_norm.weight": (self.head_dim,)})
        if self.sinks:
            shapes[p + "attn_sinks.weight"] = (self.n_head,)
        return shapes

    def cache_bytes(self, positions: int, chunk: int) -> int:
        """One sequence's keys and values when it holds at most `positions`; a sliding layer holds at most
        twice the window plus a step's chunk (before it trims, KVCache.trim)."""
        if self.window is not None:
            positions = min(positions, 2 * self.window + chunk)
        return KVCache.bytes_for(positions, self.n_kv_head, self.head_dim)

    def prefix_bytes(self, block: int) -> tuple[int, int]:
        """(per cached block, per snapshot) in the prefix cache: a full layer keeps each block's keys and
        values, a sliding layer its whole cache at a block's end (at most twice the window after a trim)."""
        if self.window is not None:
            return 0, KVCache.bytes_for(max(2 * self.window, 16), self.n_kv_head, self.head_dim)
        return KVCache.bytes_for(block, self.n_kv_head, self.head_dim), 0

    def build(self, w, p: str, eps: float, rope: tuple[torch.Tensor, float], max_len: int) -> "Attention":
        return Attention(self, w, p, eps, rope, max_len)


class Attention:
    """The attention of the layer whose tensors start with `p`. rope: (inverse frequencies, cos/sin
    multiplier); fewer frequencies than head_dim / 2 rotate only the leading part of each head.
    max_len: the most positions a cache holds."""

    def __init__(self, spec: AttentionSpec, w, p: str, eps: float, rope: tuple[torch.Tensor, float],
                 max_len: int | None = None):
        self.spec, self.eps, self.rope, self.window, self.max_len = spec, eps, rope, spec.window, max_len
        # q, k and v in one product (one pass over the activations)
        self.qkv = w.matrices([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], 0)
        self.o = w.matrix(p + "attn_output.weight")
        self.qkv_bias = torch.cat([w(p + f"attn_{t}.bias") for t in "qkv"]) if spec.bias else None
        self.o_bias = w(p + "attn_output.bias") if spec.bias else None
        self.q_norm = w(p + "attn_q_norm.weight") if spec.qk_norm else None
        self.k_norm = w(p + "attn_k_norm.weight") if spec.qk_norm else None
        self.sinks = w(p + "attn_sinks.weight") if spec.sinks else None

    def new_cache(self):
        return KVCache(window=self.window, max_len=self.max_len)

    def __call__(self, x: torch.Tensor, ctx, layer: int) -> torch.Tensor:
        q, k, v, gate = self._heads(x, *self._rope(ctx.positions, ctx.memo))
        out = torch.empty_like(q)
        for i, (sid, rows, start) in enumerate(ctx.batch.segments()):
            cache = ctx.caches[sid][layer]
            if ctx.batch.verifies(i):       # row by row, as decode steps (stages/layers/cache.py)
                cache.begin_verify(start)
                chunks = [slice(r, r + 1) for r in range(rows.start, rows.stop)]
            else:
                chunks = [rows]
            for rows in chunks:
                keys, values, k_pos = cache.extend(k[rows], v[rows], ctx.positions[rows])
                out[rows] = attention(q[rows], keys, values, ctx.positions[rows], k_pos, self.spec.head_dim ** -0.5,
                                      window=self.window, sinks=self.sinks)
                cache.trim()       # sliding layers keep at most twice the `window` positions
        return self._output(out, gate)

    def decode_inputs(self, ctx, layer: int):
        """A decode step's host part: the positions, the RoPE table, and each sequence's keys, values and
        positions with a row more (decode writes it: its last)."""
        kv = [(*held, None) for _, held in self._reserve(ctx, layer)]
        return ctx.positions, *self._rope(ctx.positions, ctx.memo), kv

    def graph_state(self, ctx, layer: int):
        """The host part of a decode step replayed as a CUDA graph (stages/runtime/decode_graph.py): each sequence's
        cache grown by a row; returns their whole storage (keys, values, positions: addresses that stay while
        the storage does) and the row each writes."""
        caches = [cache for cache, _ in self._reserve(ctx, layer)]
        return [(c.k, c.v, c.pos) for c in caches], [c.length - 1 for c in caches]

    def _reserve(self, ctx, layer: int) -> list:
        """(cache, what it holds with the new row) of each sequence, a row reserved for this step's token."""
        s, device = self.spec, ctx.positions.device
        caches = [ctx.caches[sid][layer] for sid in ctx.batch.seq_ids]
        return [(c, c.reserve(1, (s.n_kv_head, s.head_dim), torch.float32, device)) for c in caches]

    def graph_inputs(self, storage, rows: torch.Tensor, positions: torch.Tensor, memo: dict):
        """decode's inputs from graph_state's storage, the rows as a tensor [n]: attention reads every row of
        the storage (the empty ones have EMPTY_POSITION: masked)."""
        kv = [(*tensors, rows[i:i + 1]) for i, tensors in enumerate(storage)]
        return positions, *self._rope(positions, memo), kv

    def decode(self, x: torch.Tensor, inputs) -> torch.Tensor:
        """One token of each sequence (row i is sequence i's), inputs from decode_inputs (or graph_inputs)."""
        positions, cos, sin, kv = inputs
        q, k, v, gate = self._heads(x, cos, sin)
        out = []
        for i, (keys, values, k_pos, row) in enumerate(kv):
            if row is None:
                keys[-1], values[-1], k_pos[-1] = k[i], v[i], positions[i]
            else:       # a row given as a tensor: the same step for every row a graph replays it at
                keys.index_copy_(0, row, k[i:i + 1])
                values.index_copy_(0, row, v[i:i + 1])
                k_pos.index_copy_(0, row, positions[i:i + 1])
            out.append(attention(q[i:i + 1], keys, values, positions[i:i + 1], k_pos, self.spec.head_dim ** -0.5,
                                 window=self.window, sinks=self.sinks))
        return self._output(out[0] if len(out) == 1 else torch.cat(out), gate)

    def decode_done(self, ctx, layer: int) -> None:
        for sid in ctx.batch.seq_ids:
            ctx.caches[sid][layer].trim()

    def token_call(self, norm: torch.Tensor, eps: float) -> token_calls.TokenAttention | None:
        """`x + self.decode(rms_norm(x, norm, eps), inputs)` for a few decode tokens as one C call with the same bits
        (kernels/token_calls.py), where this layer's calls allow it: the compiled RoPE and attention kernels, float32
        norms, biases and sinks, products that token_calls.row_weights takes, Qwen's output gate where the library
        computes torch's sigmoid. None otherwise."""
        s = self.spec
        small = [t for t in (norm, self.q_norm, self.k_norm, self.qkv_bias, self.o_bias, self.sinks) if t is not None]
        if token_calls.library() is None or kernels_attention._library() is None or kernels_rope._library() is None \
                or not all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in small) \
                or (s.output_gate and not token_calls.gate_matches()):
            return None
        h = norm.shape[0]
        qkv, out = token_calls.row_weights(self.qkv, h), token_calls.row_weights(self.o, s.n_head * s.head_dim)
        if qkv is None or out is None or len(out) != 1:
            return None
        return token_calls.TokenAttention(self, norm, eps, qkv, out, h, keep=(self.qkv, self.o))

    def _rope(self, positions: torch.Tensor, memo: dict) -> tuple[torch.Tensor, torch.Tensor]:
        # one table per step, shared by every layer (the parameters are the model's, not the layer's)
        if "rope" not in memo:
            inv_freq, scale = self.rope
            if inv_freq.device != positions.device:     # moved once: a CUDA graph cannot copy from the host
                self.rope = inv_freq, scale = inv_freq.to(positions.device), scale
            memo["rope"] = rope_cos_sin(positions, inv_freq, scale)
        return memo["rope"]

    def _heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [T, H, D] and k, v [T, Hkv, D] after the norms and RoPE, and the output gate (or None)."""
        s, T = self.spec, x.shape[0]
        q_dim, kv_dim = (2 if s.output_gate else 1) * s.n_head * s.head_dim, s.n_kv_head * s.head_dim
        q, k, v = linear(x, self.qkv, self.qkv_bias).split([q_dim, kv_dim, kv_dim], dim=-1)
        k, v = k.reshape(T, s.n_kv_head, s.head_dim), v.reshape(T, s.n_kv_head, s.head_dim)
        gate = None
        if s.output_gate:
            q = q.reshape(T, s.n_head, 2 * s.head_dim)
            q, gate = q[..., :s.head_dim], q[..., s.head_dim:].reshape(T, -1)
        else:
            q = q.reshape(T, s.n_head, s.head_dim)
        if s.qk_norm:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        out = out.reshape(out.shape[0], -1)
        if gate is not None:
            out = out * sigmoid(gate)
        return linear(out, self.o, self.o_bias)
