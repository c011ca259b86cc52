"""MoE routing on the GPU (kernels/moe.py): per token, the top k experts and their weights, for both
families' normalisations. One program per token; the k picks are k passes of argmax (k is small),
which also gives torch.topk's order (largest first)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_device


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALISE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    scores = tl.load(logits_ptr + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    if SOFTMAX_FIRST:        # Qwen: softmax over all experts, then the top k
        p = tl.exp(scores - tl.max(scores, 0))
        scores = tl.where(e < E, p / tl.sum(p, 0), float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    picked = tl.full((BLOCK_K,), float("-inf"), tl.float32)
    picked_ids = tl.zeros((BLOCK_K,), tl.int64)
    for i in tl.static_range(K):
        best = tl.argmax(scores, 0)
        picked = tl.where(slot == i, tl.max(scores, 0), picked)
        picked_ids = tl.where(slot == i, best.to(tl.int64), picked_ids)
        scores = tl.where(e == best, float("-inf"), scores)
    if SOFTMAX_FIRST:
        weights = tl.where(slot < K, picked, 0.0)
        if RENORMALISE:
            weights = weights / tl.sum(weights, 0)
    else:                    # gpt-oss: softmax over the k picked logits
        p = tl.exp(picked - tl.max(picked, 0))
        weights = p / tl.sum(p, 0)
    tl.store(weights_ptr + t * K + slot, weights, mask=slot < K)
    tl.store(ids_ptr + t * K + slot, picked_ids, mask=slot < K)


def _route(logits: torch.Tensor, k: int, softmax_first: bool, renormalise: bool):
    if logits.dim() != 2 or not 0 < k <= logits.shape[1]:
        raise ValueError(f"routing needs logits [T, E] and 0 < k <= E, got {tuple(logits.shape)} and k={k}")
    check_device(logits)
    t, e = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, weights, ids, e, K=k, BLOCK_E=triton.next_power_of_2(e),
                            BLOCK_K=triton.next_power_of_2(k), SOFTMAX_FIRST=softmax_first, RENORMALISE=renormalise)
    return weights, ids


def route_softmax_topk(logits: torch.Tensor, k: int, renormalise: bool = True):
    """Softmax over all experts, keep the top k, optionally renormalise them to sum to 1 (Qwen)."""
    return _route(logits, k, True, renormalise)


def route_topk_softmax(logits: torch.Tensor, k: int):
    """Top k of the raw logits, softmax over those k (gpt-oss)."""
    return _route(logits, k, False, False)
