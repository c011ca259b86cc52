"""Mixture-of-experts routing and grouped expert execution.

Tokens are sorted by expert so that each expert runs one matmul over all the tokens
routed to it; results are scaled by their routing weight and scattered back. A decode step's few
(token, expert) slots instead go to one custom op per product that takes the expert ids as a tensor
(kernels/ops.py: no plan on the host in the traced step, the same bits).
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np
import torch

from . import ops
from .gpu_ops import use_triton
from .linear import grouped_linear, slot_linear, take_rows
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
# itself (a CPU tensor: no synchronisation), as the plan below does, so the results are the same bits.
CPU_SLOT_PRODUCTS = 64


def route_softmax_topk(logits: torch.Tensor, k: int, renormalise: bool = True):
    """Softmax over all experts, keep the top k, optionally renormalise them to sum to 1 (Qwen)."""
    if use_triton("routing", logits):
        return ops.route(logits.float(), k, True, renormalise)
    return torch_route(logits, k, True, renormalise)


def route_topk_softmax(logits: torch.Tensor, k: int):
    """Top k of the raw logits, softmax over those k (gpt-oss)."""
    if use_triton("routing", logits):
        return ops.route(logits.float(), k, False, False)
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

    A decode step's slots (all experts here, few slots) run as slot products (kernels/ops.py), the
    ids left a tensor: then slots is None and rows are every slot's, in slot order. decoding: x is a
    decode step's (one token per sequence), which a GPU takes as slot products in larger numbers.
    """
    if experts is None and ids.numel() <= slot_limit(x, decoding):
        h = slot_linear(x, gate_up, ids, gate_up_bias)
        return None, slot_linear(activation(h), down, ids.reshape(-1, 1), down_bias)
    experts = experts if experts is not None else range(gate_up.shape[0])
    order, groups = _plan(ids, experts)
    if not order:
        return torch.empty(0, dtype=torch.long, device=x.device), x.new_empty(0, x.shape[1])
    k = ids.shape[1]
    slots = torch.tensor(order, device=x.device)
    rows = [s // k for s in order]      # each slot's token (sorted slots: a copy even when k is 1)
    tokens = take_rows(x, rows)
    h = grouped_linear(tokens, gate_up, groups, gate_up_bias)
    return slots, grouped_linear(activation(h), down, groups, down_bias)


# Up to this many (token, expert) slots (a decode step's), the plan is made in plain Python: numpy's
# per-call cost is larger than the work there.
SMALL_PLAN = 64


def _plan(ids: torch.Tensor, experts: range) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The slots routed to `experts`, sorted (stably) by expert, and the groups (local expert,
    first, end) of the sorted list: one product per expert over its tokens."""
    if ids.numel() <= SMALL_PLAN:
        flat = ids.reshape(-1).tolist()     # the grouping is planned on the host (a sync on a GPU)
        order = [s for s in sorted(range(len(flat)), key=flat.__getitem__) if flat[s] in experts]
        local = [flat[s] - experts.start for s in order]
    else:
        flat = ids.reshape(-1).cpu().numpy()
        order = np.argsort(flat, kind="stable")
        order = order[(flat[order] >= experts.start) & (flat[order] < experts.stop)]
        local = (flat[order] - experts.start).tolist()
        order = order.tolist()
    groups, start = [], 0
    for i in range(1, len(local) + 1):
        if i == len(local) or local[i] != local[start]:
            groups.append((local[start], start, i))
            start = i
    return order, groups


def combine_slots(slots: torch.Tensor | None, rows: torch.Tensor, weights: torch.Tensor,
                  shared_gate: torch.Tensor | None = None, shared: torch.Tensor | None = None) -> torch.Tensor:
    """Routing-weighted sum over each token's k slots, always in slot order: the result does not
    depend on which process computed which expert. slots None: rows holds every slot, in order.
    With a shared expert: plus sigmoid(shared_gate [T, 1]) * shared [T, H] (ops.moe_combine)."""
    T, k = weights.shape
    if slots is not None:
        # slots are distinct: when every slot has a row, each one is written and none needs zeroing
        y = rows.new_empty(T * k, rows.shape[-1]) if len(slots) == T * k else rows.new_zeros(T * k, rows.shape[-1])
        rows = y.index_copy_(0, slots, rows)
    return ops.moe_combine(rows, weights, shared_gate, shared)


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum of the selected experts for every token: x [T, H]; weights/ids [T, k]."""
    slots, rows = expert_slot_outputs(x, ids, gate_up, down, activation, gate_up_bias, down_bias)
    return combine_slots(slots, rows, weights)
