"""The Gated DeltaNet mixer of every hybrid family: its tensors, its cache, and the layer itself; a family's
`DeltaNetSpec` says its sizes and how its GGUF lays out the V heads (docs/model-formats.md §2, §7).

The numerics (kernels/deltanet.py) take V heads in tiled order: V head vh reads K head vh % n_k_heads.
llama.cpp's `qwen35moe` files store them so. Its `qwen3next` files keep HF's grouped order (V head vh
reads K head vh // (n_v_heads / n_k_heads)) and beta/alpha in one `ssm_ba`, interleaved per K head:
there the mixer reorders the input product's columns into the tiled layout and its output back, and
the small per-head tensors at load (weights keep their file's bytes, whatever their type).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from raymoe.kernels import deltanet as kernels_deltanet, token_calls
from raymoe.kernels.deltanet import GatedDeltaNet, causal_conv1d, delta_rule_chunked, delta_rule_recurrent
from raymoe.kernels.linear import linear

from raymoe.stages.layers.cache import DeltaNetCache, DeltaNetStack
from raymoe.stages.errors import ModelFormatError
from raymoe.stages.families.contract import ModelConfig

CHUNKED_PREFILL_MIN = 16   # chunks at least this long use the chunked delta rule


@dataclass(frozen=True)
class DeltaNetSpec:
    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    grouped: bool = False       # llama.cpp's qwen3next layout (grouped V heads, one interleaved ssm_ba)

    @property
    def key_dim(self) -> int:
        return self.k_head_dim * self.n_k_heads

    @property
    def value_dim(self) -> int:
        return self.v_head_dim * self.n_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def tensor_shapes(self, p: str, hidden: int) -> dict:
        H, nv = hidden, self.n_v_heads
        gates = ({p + "ssm_ba.weight": (2 * nv, H)} if self.grouped else
                 {p + "ssm_beta.weight": (nv, H), p + "ssm_alpha.weight": (nv, H)})
        return {p + "attn_qkv.weight": (self.conv_dim, H), p + "attn_gate.weight": (self.value_dim, H), **gates,
                p + "ssm_conv1d.weight": (self.conv_dim, self.conv_kernel), p + "ssm_dt.bias": (nv,),
                p + "ssm_a": (nv,), p + "ssm_norm.weight": (self.v_head_dim,),
                p + "ssm_out.weight": (H, self.value_dim)}

    def cache_bytes(self, positions: int, chunk: int) -> int:
        """One sequence's conv inputs and state, whatever its length."""
        return DeltaNetCache.bytes_for(self.conv_kernel, self.conv_dim, self.n_v_heads, self.k_head_dim,
                                       self.v_head_dim)

    def prefix_bytes(self, block: int) -> tuple[int, int]:
        """(per cached block, per snapshot): the prefix cache keeps the state at a block's end."""
        return 0, self.cache_bytes(0, 0)

    def build(self, w, p: str, eps: float, rope, max_len: int) -> "DeltaNet":
        return DeltaNet(self, w, p, eps)

    def input_order(self) -> torch.Tensor | None:
        """For the grouped layout, the input product's column for each column the kernels read
        ([q | k | v | z | beta | alpha], V heads tiled); None when the file's order is that already."""
        if not self.grouped:
            return None
        nk, r = self.n_k_heads, self.n_v_heads // self.n_k_heads
        ba = torch.arange(2 * self.n_v_heads).view(nk, 2, r)        # per K head: r betas, then r alphas
        v = tiled_from_grouped(nk, r, self.v_head_dim)
        return torch.cat((torch.arange(2 * self.key_dim), 2 * self.key_dim + v, self.conv_dim + v,
                          self.conv_dim + self.value_dim + ba[:, 0].T.reshape(-1),
                          self.conv_dim + self.value_dim + ba[:, 1].T.reshape(-1)))

    def validate(self, where: str):
        if self.n_v_heads % self.n_k_heads:
            raise ModelFormatError(f"{where}: {self.n_v_heads} DeltaNet value heads do not divide into "
                                   f"{self.n_k_heads} key heads")


@dataclass
class DeltaNetConfig(ModelConfig):
    """What a family with Gated DeltaNet layers between gated full-attention ones (Qwen3.5-MoE, Qwen3-Next) adds
    to ModelConfig: the DeltaNet sizes, the rotary dimension, the shared expert, the attention interval."""
    rope_dim: int
    shared_ff: int
    conv_kernel: int
    k_head_dim: int
    n_k_heads: int
    n_v_heads: int
    v_head_dim: int
    full_attention_interval: int

    POSITIVE = ModelConfig.POSITIVE + ("conv_kernel", "k_head_dim", "n_k_heads", "n_v_heads", "v_head_dim",
                                       "full_attention_interval")

    def validate(self, where: str):
        super().validate(where)
        DeltaNetSpec(self.n_k_heads, self.n_v_heads, self.k_head_dim, self.v_head_dim, self.conv_kernel).validate(where)
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ModelFormatError(f"{where}: rope dimension {self.rope_dim} invalid for head_dim {self.head_dim}")


def tiled_from_grouped(n_k: int, r: int, d: int) -> torch.Tensor:
    """Indices that take n_k * r heads of d elements from grouped order (K head major) to tiled order."""
    return torch.arange(n_k * r * d).view(n_k, r, d).transpose(0, 1).reshape(-1)


def fields_from_gguf(key) -> dict:
    """The DeltaNet sizes of a config from llama.cpp's `<arch>.ssm.*` keys."""
    return dict(conv_kernel=key("ssm.conv_kernel"), k_head_dim=key("ssm.state_size"), n_k_heads=key("ssm.group_count"),
                n_v_heads=key("ssm.time_step_rank"),
                v_head_dim=key("ssm.inner_size") // key("ssm.time_step_rank", positive=True))


def fields_from_hf(key) -> dict:
    """The DeltaNet sizes of a config from transformers' `linear_*` keys."""
    return dict(conv_kernel=key("linear_conv_kernel_dim"), k_head_dim=key("linear_key_head_dim"),
                n_k_heads=key("linear_num_key_heads"), n_v_heads=key("linear_num_value_heads"),
                v_head_dim=key("linear_value_head_dim"))


def gguf_metadata(spec: DeltaNetSpec) -> dict:
    """The `<arch>.ssm.*` keys (the inverse of fields_from_gguf)."""
    return {"ssm.conv_kernel": spec.conv_kernel, "ssm.state_size": spec.k_head_dim, "ssm.group_count": spec.n_k_heads,
            "ssm.time_step_rank": spec.n_v_heads, "ssm.inner_size": spec.value_dim}


def hf_full_attention_interval(hf: dict, n_layers: int, where: str) -> int:
    """The interval of transformers' `layer_types` (every Nth layer full attention, the rest DeltaNet), or of
    its `full_attention_interval` (default 4): llama.cpp's GGUF says only the interval."""
    layer_types = hf.get("layer_types")
    if not layer_types:
        return hf.get("full_attention_interval", 4)
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    interval = full[0] + 1 if full else n_layers + 1
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if list(layer_types) != expected:
        raise ModelFormatError(f"{where}: layer_types is not a regular full-attention interval")
    return interval


class DeltaNet:
    """The Gated DeltaNet mixer of the layer whose tensors start with `p`."""

    def __init__(self, spec: DeltaNetSpec, w, p: str, eps: float):
        self.spec = spec
        gates = [p + "ssm_ba.weight"] if spec.grouped else [p + "ssm_beta.weight", p + "ssm_alpha.weight"]
        # the input projections are stacked into one product (fewer, larger products)
        self.inputs = w.matrices([p + "attn_qkv.weight", p + "attn_gate.weight", *gates], 0)
        self.order = spec.input_order()
        conv, a, dt = w(p + "ssm_conv1d.weight"), w(p + "ssm_a"), w(p + "ssm_dt.bias")
        self.back = None            # the out projection's input columns, tiled -> the file's order
        if spec.grouped:
            nk, r, device = spec.n_k_heads, spec.n_v_heads // spec.n_k_heads, conv.device
            self.order = self.order.to(device)
            heads = tiled_from_grouped(nk, r, 1).to(device)
            conv, a, dt = conv[self.order[:spec.conv_dim]].contiguous(), a[heads], dt[heads]
            self.back = torch.argsort(tiled_from_grouped(nk, r, spec.v_head_dim)).to(device)
        self.net = GatedDeltaNet(conv, a, dt, w(p + "ssm_norm.weight"), eps, spec.n_k_heads, spec.n_v_heads,
                                 spec.k_head_dim, spec.v_head_dim)
        self.out = w.matrix(p + "ssm_out.weight")

    def new_cache(self):
        s, conv = self.spec, self.net.conv
        return DeltaNetCache(s.conv_kernel, s.conv_dim, s.n_v_heads, s.k_head_dim, s.v_head_dim, conv.dtype,
                             conv.device)

    def __call__(self, x: torch.Tensor, ctx, layer: int) -> torch.Tensor:
        s, net = self.spec, self.net
        qkv, z, beta, alpha = self._projections(x)
        y = torch.empty(x.shape[0], s.value_dim, device=x.device)       # the out projection's input
        singles = []
        for i, (sid, rows, start) in enumerate(ctx.batch.segments()):
            cache = ctx.caches[sid][layer]
            if ctx.batch.verifies(i):       # row by row, as decode steps (stages/layers/cache.py)
                step, rows = partial(self._verify_row, qkv, z, beta, alpha, y), range(rows.start, rows.stop)
                cache.begin_verify(start, step, rows)
                conv, state = cache.alone()
                for row in rows:
                    step(conv, state, row)
                continue
            if rows.stop - rows.start == 1:
                singles.append((rows.start, cache))
                continue
            mixed, conv = causal_conv1d(qkv[rows], net.conv, cache.conv)
            q, k, v = net.heads(mixed)
            g, b = net.gates(beta[rows], alpha[rows])
            rule = delta_rule_chunked if mixed.shape[0] >= CHUNKED_PREFILL_MIN else delta_rule_recurrent
            out, state = rule(q, k, v, g, b, cache.state)
            cache.hold(conv, state)
            y[rows] = net.output(out, z[rows])
        if singles:
            # one token of each of these sequences at once, their caches stacked
            stack = DeltaNetStack.of([cache for _, cache in singles])
            net.decode(qkv, z, beta, alpha, [row for row, _ in singles], stack.conv, stack.state, y)
        return self._output(y)

    def _verify_row(self, qkv, z, beta, alpha, y, conv, state, row: int):
        """The decode step of projection row `row` on a one-sequence stack, its output in y[row]."""
        self.net.decode(qkv, z, beta, alpha, [row], conv, state, y)

    def decode_inputs(self, ctx, layer: int):
        """A decode step's host part: the sequences' caches stacked, (conv [n, K-1, C], state [n, H, dk, dv])."""
        stack = DeltaNetStack.of([ctx.caches[sid][layer] for sid in ctx.batch.seq_ids])
        return stack.conv, stack.state

    def graph_state(self, ctx, layer: int):
        """The host part of a decode step replayed as a CUDA graph: the stacked caches, no rows."""
        return self.decode_inputs(ctx, layer), []

    def graph_inputs(self, storage, rows, positions, memo):
        return storage

    def decode(self, x: torch.Tensor, caches) -> torch.Tensor:
        """One token of each sequence (row i is sequence i's); the stacked caches are updated in place."""
        return self._output(self.net.decode_all(*self._projections(x), *caches))

    def decode_done(self, ctx, layer: int) -> None:
        pass

    def token_call(self, norm: torch.Tensor, eps: float) -> token_calls.TokenDeltaNet | None:
        """`x + self.decode(rms_norm(x, norm, eps), caches)` for a few decode tokens as one C call with the same bits
        (kernels/token_calls.py), where this layer's calls allow it: the file's V-head order, the compiled decode
        step, projections that token_calls.row_weights takes. None otherwise."""
        net = self.net
        if self.order is not None or token_calls.library() is None or kernels_deltanet.library() is None or \
                not all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()
                        for t in (norm, net.taps, net.a, net.dt_bias, net.norm)):
            return None
        h = norm.shape[0]
        inputs, out = token_calls.row_weights(self.inputs, h), token_calls.row_weights(self.out, self.spec.value_dim)
        if inputs is None or out is None or len(out) != 1:
            return None
        return token_calls.TokenDeltaNet(net, norm, eps, inputs, out, h, keep=(self.inputs, self.out))

    def _projections(self, x: torch.Tensor):
        """qkv [T, C], z [T, H_v * dv], beta and alpha [T, H_v]: column slices of one product, V heads tiled."""
        s = self.spec
        y = linear(x, self.inputs)
        if self.order is not None:
            y = y.index_select(1, self.order)
        return y.split([s.conv_dim, s.value_dim, s.n_v_heads, s.n_v_heads], dim=-1)

    def _output(self, y: torch.Tensor) -> torch.Tensor:
        return linear(y if self.back is None else y.index_select(1, self.back), self.out)
