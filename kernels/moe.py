"""Mixture-of-experts routing and grouped expert execution.

Tokens are sorted by expert so that each expert runs one matmul over all the tokens
routed to it; results are scaled by their routing weight and scattered back. A decode step's few
(token, expert) slots instead go to one custom op per product that takes the expert ids as a tensor
(kernels/weights.py: no plan on the host in the traced step, the same bits). The custom ops of routing and
of the MoE's end (route, moe_combine, moe_token: kernels/ops.py) are defined here.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
from torch import Tensor

from . import blocks
from .gpu_ops import use_triton
from .grouping import plan, take_rows
from .linear import grouped_linear, slot_linear
from .ops import custom_op
from .pointwise import sigmoid, silu

# On a GPU, up to this many (token, expert) slots run one product each with the expert ids left on the
# device (no host synchronisation; an expert chosen by several of them is read once per slot); more are
# sorted by expert on the host so that each expert's weights are read once. A decode step's slots may be
# more (GPU_DECODE_SLOT_PRODUCTS), so that a CUDA graph can hold the step: measured on an H200
# (tests/gpu/run.py, 64 sequences decoding, 2026-12-04), steps as graphs with slot products gave 221 tok/s
# (gpt-oss-20b) and 206 (Qwen3.5-35B-A3B), eager steps sorting on the host 174 and 167. A prompt's chunk
# stays sorted: its many tokens choose every expert many times.
GPU_SLOT_PRODUCTS = 16
GPU_DECODE_SLOT_PRODUCTS = 1024
# On the CPU, up to this many (a decode step's) also run as slot products: the op sorts them by expert
# itself (a CPU tensor: no synchronisation), as grouping.plan does, so the results are the same bits.
CPU_SLOT_PRODUCTS = 64


def route_softmax_topk(logits: torch.Tensor, k: int, renormalise: bool = True):
    """Softmax over all experts, keep the top k, optionally renormalise them to sum to 1 (Qwen)."""
    if use_triton("routing", logits):
        return route_op(logits.float(), k, True, renormalise)
    return torch_route(logits, k, True, renormalise)


def route_topk_softmax(logits: torch.Tensor, k: int):
    """Top k of the raw logits, softmax over those k (gpt-oss)."""
    if use_triton("routing", logits):
        return route_op(logits.float(), k, False, False)
    return torch_route(logits, k, False, False)


def torch_route(logits: torch.Tensor, k: int, softmax_first: bool, renormalise: bool):
    """Both routers in torch operations (they trace as they are)."""
    if not softmax_first:
        top, ids = torch.topk(logits.float(), k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` with gate the first half of the columns."""
    gate, up = gate_up.chunk(2, dim=-1)
    return silu(gate) * up


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on `[gate | up]` (halves, as in GGUF):
    `(clamp(up, -limit, limit) + 1) · g · sigmoid(alpha · g)` with `g = min(gate, limit)`."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * sigmoid(gate * alpha))


def activation_code(activation: Callable) -> tuple[int, float, float] | None:
    """(kind, alpha, limit) of an expert activation as the C library computes it (blocks.c's
    raymoe_moe_activation: 0 swiglu, 1 clamped_swiglu), or None for any other function."""
    if activation is swiglu:
        return 0, 0.0, 0.0
    if isinstance(activation, partial) and activation.func is clamped_swiglu and not activation.args:
        return 1, float(activation.keywords["alpha"]), float(activation.keywords["limit"])
    return None


def route_code(route: Callable) -> tuple[bool, bool] | None:
    """(softmax first, renormalise) of a router as torch_route takes them, or None for any other function."""
    return {route_softmax_topk: (True, True), route_topk_softmax: (False, False)}.get(route)


def slot_limit(x: torch.Tensor, decoding: bool) -> int:
    """The most slots of x's tokens that run as slot products (above)."""
    if not x.is_cuda:
        return CPU_SLOT_PRODUCTS
    return GPU_DECODE_SLOT_PRODUCTS if decoding else GPU_SLOT_PRODUCTS


def expert_slot_outputs(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                        activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
                        gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                        experts: range | None = None, decoding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Unweighted expert outputs for every (token, slot) routed to an expert in `experts`.

    x [T, H]; ids [T, k]; gate_up [E', 2F, H]; down [E', H, F] hold experts `experts`
    (all E when None), indexed relative to experts.start. Returns (slots, rows): flat slot
    indices t*k + j and their outputs [n, H]. Slots are sorted by expert, so each expert
    runs one product over its tokens, and the activation runs once over all of them.

    A decode step's slots (all experts here, few slots) run as slot products (kernels/weights.py), the
    ids left a tensor: then slots is None and rows are every slot's, in slot order. decoding: x is a
    decode step's (one token per sequence), which a GPU takes as slot products in larger numbers.
    """
    if experts is None and ids.numel() <= slot_limit(x, decoding):
        h = slot_linear(x, gate_up, ids, gate_up_bias)
        return None, slot_linear(activation(h), down, ids.reshape(-1, 1), down_bias)
    experts = experts if experts is not None else range(gate_up.shape[0])
    order, groups = plan(ids, experts)
    if not order:
        return torch.empty(0, dtype=torch.long, device=x.device), x.new_empty(0, x.shape[1])
    k = ids.shape[1]
    slots = torch.tensor(order, device=x.device)
    rows = [s // k for s in order]      # each slot's token (sorted slots: a copy even when k is 1)
    tokens = take_rows(x, rows)
    h = grouped_linear(tokens, gate_up, groups, gate_up_bias)
    return slots, grouped_linear(activation(h), down, groups, down_bias)


def combine_slots(slots: torch.Tensor | None, rows: torch.Tensor, weights: torch.Tensor,
                  shared_gate: torch.Tensor | None = None, shared: torch.Tensor | None = None) -> torch.Tensor:
    """Routing-weighted sum over each token's k slots, always in slot order: the result does not
    depend on which process computed which expert. slots None: rows holds every slot, in order.
    With a shared expert: plus sigmoid(shared_gate [T, 1]) * shared [T, H] (moe_combine_op)."""
    T, k = weights.shape
    if slots is not None:
        # slots are distinct: when every slot has a row, each one is written and none needs zeroing
        y = rows.new_empty(T * k, rows.shape[-1]) if len(slots) == T * k else rows.new_zeros(T * k, rows.shape[-1])
        rows = y.index_copy_(0, slots, rows)
    return moe_combine_op(rows, weights, shared_gate, shared)


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum of the selected experts for every token: x [T, H]; weights/ids [T, k]."""
    slots, rows = expert_slot_outputs(x, ids, gate_up, down, activation, gate_up_bias, down_bias)
    return combine_slots(slots, rows, weights)


# ---- the custom ops (kernels/ops.py) ------------------------------------------------------------------

@custom_op("route")
def route_op(logits: Tensor, k: int, softmax_first: bool, renormalise: bool) -> tuple[Tensor, Tensor]:
    """(weights, ids) [T, k] from router logits [T, E]: softmax then top k (optionally renormalised), or
    top k then softmax (torch_route)."""
    return torch_route(logits, k, softmax_first, renormalise)


@route_op.register_kernel("cuda")
def _(logits, k, softmax_first, renormalise):
    from .triton import moe as gpu      # on first use: triton is optional where only the CPU runs
    return gpu._route(logits.float(), k, softmax_first, renormalise)


@route_op.register_fake
def _(logits, k, softmax_first, renormalise):
    shape = (*logits.shape[:-1], k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


@custom_op("moe_combine")
def moe_combine_op(rows: Tensor, weights: Tensor, gate: Optional[Tensor], shared: Optional[Tensor]) -> Tensor:
    """Row t = sum over j of weights[t, j] * rows[t*k + j] (j in order), plus sigmoid(gate[t]) * shared[t]
    where gate [T, 1] and shared [T, H] are given: rows [T*k, H] -> [T, H], float32. On the CPU one call
    of kernels/csrc/blocks.c (moe_token's end: the same bits), else torch's operations."""
    lib = blocks.library()
    if lib is None:
        return _torch_combine(rows, weights, gate, shared)
    T, k = weights.shape
    rows, weights = rows.contiguous(), weights.float().contiguous()
    shared = None if shared is None else shared.contiguous()
    out = rows.new_empty(T, rows.shape[-1])
    if T:
        blocks.moe_combine(lib, rows, weights, gate, shared, out)
    return out


@moe_combine_op.register_kernel("cuda")
def _(rows, weights, gate, shared):
    return _torch_combine(rows, weights, gate, shared)


@moe_combine_op.register_fake
def _(rows, weights, gate, shared):
    return rows.new_empty(weights.shape[0], rows.shape[-1])


def _torch_combine(rows, weights, gate, shared):
    T, k = weights.shape
    y = rows.reshape(T, k, -1).mul(weights[..., None].to(rows.dtype)).sum(1)
    return y if gate is None else y + torch.sigmoid(gate) * shared


@custom_op("moe_token")
def moe_token_op(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, gate_up2: Optional[Tensor],
                 gate_up_type: int, gate_up_quantize: bool, gate_up_bias: Optional[Tensor], down: Tensor,
                 down_type: int, down_quantize: bool, down_bias: Optional[Tensor], activation: int, exp_kind: int,
                 alpha: float, limit: float, shared_gate_up: Optional[Tensor], shared_down: Optional[Tensor],
                 shared_type: int, shared_quantize: bool, gate: Optional[Tensor]) -> Tensor:
    """One token's MoE layer after its router, CPU only, in one call: x [1, H] through the gate/up experts
    ids[0, j] of gate_up [E, N, row bytes] (| gate_up2's rows; plus gate_up_bias [E, 2F]), the activation
    (0: swiglu, 1: gpt-oss's clamped swiglu with alpha and limit; its exp as blocks.activation_exp says), the
    down experts of down [E, H, row bytes] (plus down_bias [E, H]); the shared expert's activation of
    shared_gate_up [1, 2S] and its down product (shared_down [H, row bytes]) when given; then moe_combine
    with gate [1, 1] -> [1, H]. The same bits as block_slots, the activation, block_linear and moe_combine
    called one after another (blocks.c's raymoe_moe_token)."""
    return blocks.moe_token(x, ids.reshape(-1).tolist(), weights,
                            (gate_up, gate_up2, gate_up_type, gate_up_quantize, gate_up_bias),
                            (down, down_type, down_quantize, down_bias), (activation, exp_kind, alpha, limit),
                            shared_gate_up, None if shared_down is None else (shared_down, shared_type, shared_quantize),
                            gate)


@moe_token_op.register_fake
def _(x, ids, weights, gate_up, gate_up2, gate_up_type, gate_up_quantize, gate_up_bias, down, down_type,
      down_quantize, down_bias, activation, exp_kind, alpha, limit, shared_gate_up, shared_down, shared_type,
      shared_quantize, gate):
    return x.new_empty(1, down.shape[-2])
