"""The mixture-of-experts feed-forward of every family: a router picks k experts per token, the routed
experts run here or in expert actors, and a shared expert may add its gated output; a family's `MoESpec`
says which router, activation and options."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from raymoe.kernels import blocks, token_calls
from raymoe.kernels.linear import linear
from raymoe.kernels.moe import (CPU_SLOT_PRODUCTS, GPU_DECODE_SLOT_PRODUCTS, activation_code, combine_slots,
                                expert_slot_outputs, moe_token_op, route_code, swiglu)
from raymoe.kernels.weights import BlockWeight, ConcatWeight


@dataclass(frozen=True)
class MoESpec:
    n_expert: int
    n_used: int
    expert_ff: int
    route: Callable             # (logits, k) -> (weights, ids), e.g. kernels.moe.route_softmax_topk
    activation: Callable = swiglu   # of each expert's [gate | up] (the shared expert's too)
    bias: bool = False          # biases on the router and the experts (gpt-oss; not with a shared expert)
    shared_ff: int = 0          # the shared expert's width, 0 for none; its output is scaled by a sigmoid gate

    def tensor_shapes(self, p: str, hidden: int) -> dict:
        E, F, H = self.n_expert, self.expert_ff, hidden
        shapes = {p + "ffn_gate_inp.weight": (E, H), p + "ffn_gate_exps.weight": (E, F, H),
                  p + "ffn_up_exps.weight": (E, F, H), p + "ffn_down_exps.weight": (E, H, F)}
        if self.bias:
            shapes.update({p + "ffn_gate_inp.bias": (E,), p + "ffn_gate_exps.bias": (E, F),
                           p + "ffn_up_exps.bias": (E, F), p + "ffn_down_exps.bias": (E, H)})
        if self.shared_ff:
            S = self.shared_ff
            shapes.update({p + "ffn_gate_inp_shexp.weight": (H,), p + "ffn_gate_shexp.weight": (S, H),
                           p + "ffn_up_shexp.weight": (S, H), p + "ffn_down_shexp.weight": (H, S)})
        return shapes

    def build(self, w, layer: int, remote_experts=None) -> MoE:
        """Layer `layer`'s feed-forward (its routed experts in expert actors when remote_experts is given)."""
        return MoE(self, w, layer, remote_experts)

    def load_experts(self, w, layer: int, experts: range | None = None):
        """The routed experts of one layer (a slice of them for expert parallelism) as a function
        (x, ids) -> (slots, rows); see kernels.moe.expert_slot_outputs."""
        p = f"blk.{layer}."
        gate_up = w.matrices([p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"], 1, experts)
        down = w.matrix(p + "ffn_down_exps.weight", experts)
        gate_up_bias = down_bias = None
        if self.bias:
            gate_up_bias = torch.cat((w(p + "ffn_gate_exps.bias", experts), w(p + "ffn_up_exps.bias", experts)), 1)
            down_bias = w(p + "ffn_down_exps.bias", experts)
        return LocalExperts(gate_up, down, self.activation, gate_up_bias, down_bias, experts)


def _cpu_block(weight) -> bool:
    return isinstance(weight, BlockWeight) and weight.raw.is_cpu


def _cpu_blocks(weight) -> tuple | None:
    """(raw, raw2, type, quantize) of GGML-block weights on the CPU: one BlockWeight, or a pair of one format
    (a GGUF file's gate and up experts); None for any other weight."""
    if isinstance(weight, ConcatWeight) and weight.pair:
        first, second = weight.parts
        return first.raw, second.raw, first.type, first.quantize_activations
    if _cpu_block(weight):
        return weight.raw, None, weight.type, weight.quantize_activations
    return None


@dataclass(frozen=True)
class LocalExperts:
    """The routed experts a process holds (all of a layer's, or an expert actor's slice), as a function
    (x, ids) -> (slots, rows): see kernels.moe.expert_slot_outputs."""
    gate_up: object
    down: object
    activation: Callable
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    experts: range | None

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, decoding: bool = False):
        return expert_slot_outputs(x, ids, self.gate_up, self.down, self.activation, self.gate_up_bias,
                                   self.down_bias, experts=self.experts, decoding=decoding)


class MoE:
    """The feed-forward of layer `layer`. remote_experts(layer, x, ids) -> (slots, rows), when the routed
    experts live in expert actors."""

    def __init__(self, spec: MoESpec, w, layer: int, remote_experts=None):
        p = f"blk.{layer}."
        self.spec = spec
        self.experts = spec.load_experts(w, layer) if remote_experts is None else partial(remote_experts, layer)
        self.local = remote_experts is None     # all of the layer's experts here (LocalExperts)
        # One product gives the router logits and, with a shared expert, its gate and gate/up.
        inputs = [w.matrix(p + "ffn_gate_inp.weight")]
        self.router_bias = w(p + "ffn_gate_inp.bias") if spec.bias else None
        self.shared_down = None
        if spec.shared_ff:
            inputs += [w(p + "ffn_gate_inp_shexp.weight").view(1, -1), w.matrix(p + "ffn_gate_shexp.weight"),
                       w.matrix(p + "ffn_up_shexp.weight")]
            self.shared_down = w.matrix(p + "ffn_down_shexp.weight")
        self.inputs = w.join(inputs)
        self.token_call = self._token_call()
        # the same call made eagerly, its weights described once (h: the experts' down rows)
        self.token_moe = None if self.token_call is None else blocks.TokenMoE(
            self.experts.down.shape[-2], *self.token_call, spec.shared_ff)

    def _token_call(self) -> tuple | None:
        """moe_token_op's arguments that do not change from call to call, as blocks.moe_token takes them:
        (gate_up, down, activation, shared_down), the last None without a shared expert; where one token's MoE
        after its router can be one call: on the CPU with the block kernels, all of the layer's experts here,
        GGML-block weights, an activation the library computes with this torch's bits (blocks.activation_exp), at
        widths that torch computes by its vector formula throughout (multiples of 32 values). None otherwise."""
        experts, shared, s = self.experts, self.shared_down, self.spec
        if not (self.local and s.n_used <= CPU_SLOT_PRODUCTS and blocks.library() is not None):
            return None
        gate_up, down, code = _cpu_blocks(experts.gate_up), experts.down, activation_code(s.activation)
        if (gate_up is None or not _cpu_block(down) or code is None or s.expert_ff % 32 or s.shared_ff % 32
                or (shared is not None and not _cpu_block(shared))
                or any(b is not None and not b.is_contiguous() for b in (experts.gate_up_bias, experts.down_bias))):
            return None
        exp_kind = blocks.activation_exp(s.activation, *code)
        if exp_kind is None:
            return None
        kind, alpha, limit = code
        return ((*gate_up, experts.gate_up_bias), (down.raw, down.type, down.quantize_activations, experts.down_bias),
                (kind, exp_kind, alpha, limit),
                None if shared is None else (shared.raw, shared.type, shared.quantize_activations))

    def token_ffn(self, norm: torch.Tensor, eps: float) -> token_calls.TokenFFN | None:
        """`x + self(rms_norm(x, norm, eps))` for a few decode tokens as one C call with the same bits
        (kernels/token_calls.py), where this layer's calls allow it: the one-call MoE above (token_call), a router
        that token_calls.row_weights takes, a routing the library computes with this torch's bits. None otherwise."""
        s = self.spec
        code = route_code(s.route)
        if self.token_moe is None or code is None or token_calls.library() is None or norm.dtype != torch.float32:
            return None
        router = token_calls.row_weights(self.inputs, self.token_moe.h)
        kind = token_calls.ROUTES[code]
        lanes = None if router is None else token_calls.route_lanes(kind, s.n_expert, s.n_used)
        if lanes is None:
            return None
        return token_calls.TokenFFN(self.token_moe, norm.contiguous(), eps, router, self.router_bias, kind, lanes,
                                    s.n_expert, s.n_used, keep=self.inputs)

    def host_free(self, n: int) -> bool:
        """Whether n tokens on a GPU run here without the host reading the routing (what a CUDA graph can
        hold): the experts in this process, few enough slots for slot products (kernels/moe.py)."""
        return self.local and n * self.spec.n_used <= GPU_DECODE_SLOT_PRODUCTS

    def __call__(self, x: torch.Tensor, decoding: bool = False) -> torch.Tensor:
        """x: tokens [T, H]; decoding: a decode step's (one token per sequence)."""
        s = self.spec
        logits = linear(x, self.inputs, self.router_bias)
        shared_gate = shared_gate_up = None
        if s.shared_ff:
            logits, shared_gate, shared_gate_up = logits.split([s.n_expert, 1, 2 * s.shared_ff], dim=-1)
        weights, ids = s.route(logits, s.n_used)
        if self.token_call is not None and x.shape[0] == 1:   # a decode step's token: the bits below, one call
            if not torch.compiler.is_compiling():   # eager: the op's CPU call, its weights described once
                return self.token_moe(x, ids.reshape(-1).tolist(), weights, shared_gate_up, shared_gate)
            gate_up, down, activation, shared = self.token_call
            return moe_token_op(x, ids, weights, *gate_up, *down, *activation, shared_gate_up,
                                *(shared or (None, 0, False)), shared_gate)
        shared = linear(s.activation(shared_gate_up), self.shared_down) if s.shared_ff else None
        slots = self.experts(x, ids, decoding) if self.local else self.experts(x, ids)
        return combine_slots(*slots, weights, shared_gate, shared)
