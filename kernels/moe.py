"""Mixture-of-experts routing and grouped expert execution.

Tokens are sorted by expert so that each expert runs one matmul over all the tokens
routed to it; results are scaled by their routing weight and scattered back.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def route_softmax_topk(logits: torch.Tensor, k: int, renormalise: bool = True):
    """Softmax over all experts, keep the top k, optionally renormalise them to sum to 1 (Qwen)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def route_topk_softmax(logits: torch.Tensor, k: int):
    """Top k of the raw logits, softmax over those k (gpt-oss)."""
    top, ids = torch.topk(logits.float(), k, dim=-1)
    return torch.softmax(top, dim=-1), ids


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` with gate the first half of the columns."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                experts: range | None = None) -> torch.Tensor:
    """Weighted sum of the selected experts for every token.

    x [T, H]; weights/ids [T, k]; gate_up [E, 2F, H]; down [E, H, F]. `experts` restricts
    the computation to a slice of expert ids (expert parallelism: weights of other experts
    need not be present; gate_up/down are indexed relative to experts.start).
    """
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0] if experts is None else experts.stop).tolist()
    token_of = order // ids.shape[1]
    weight_of = weights.reshape(-1)[order]
    first = 0 if experts is None else experts.start
    start = sum(counts[:first])
    for e in range(first, len(counts) if experts is None else experts.stop):
        n = counts[e]
        if n == 0:
            continue
        rows = token_of[start:start + n]
        local = e - first
        h = F.linear(x[rows], gate_up[local], None if gate_up_bias is None else gate_up_bias[local])
        y = F.linear(activation(h), down[local], None if down_bias is None else down_bias[local])
        out.index_add_(0, rows, y * weight_of[start:start + n, None].to(y.dtype))
        start += n
    return out
