"""(token, expert) slots grouped by expert: the plan that sorts them so that each expert's weights are read once,
and the slot products on it that the custom ops of kernels/weights.py and int8.py run on the CPU."""
from __future__ import annotations

import numpy as np
import torch

# Up to this many (token, expert) slots (a decode step's), the plan is made in plain Python: numpy's
# per-call cost is larger than the work there.
SMALL_PLAN = 64


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x's rows `rows`, in that order; x itself when they are all of its rows in order (no copy, and no index to
    send to a GPU)."""
    if rows == list(range(x.shape[0])):
        return x
    return x.index_select(0, torch.tensor(rows, dtype=torch.long, device=x.device))


def plan(ids: torch.Tensor, experts: range) -> tuple[list[int], list[tuple[int, int, int]]]:
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


def slot_products(weight, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row t*k+j = x[t] through expert ids[t, j] of `weight` (a stack with `grouped`, kernels/weights.py), on the
    CPU (the ids are a CPU tensor: reading them is no synchronisation): one grouped product, as the eager path's.
    Slots of distinct experts (one token's) are each a group, in slot order; otherwise the slots are sorted by
    expert, so that each expert's weights are read once, and put back in slot order. A row's bits depend only on
    its own activations and weight."""
    T, k = ids.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    flat = ids.reshape(-1).tolist()
    if len(set(flat)) == len(flat):
        tokens = per_slot(x, ids)
        return weight.grouped(tokens, [(e, s, s + 1) for s, e in enumerate(flat)], x.new_empty(T * k, weight.shape[-2]))
    order, groups = plan(ids, range(weight.shape[0]))
    tokens = take_rows(x, [s // k for s in order])
    products = weight.grouped(tokens, groups, x.new_empty(len(order), weight.shape[-2]))
    return x.new_empty(T * k, weight.shape[-2]).index_copy_(0, torch.tensor(order), products)


def per_slot(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row t*k+j = x[t]."""
    return x if ids.shape[1] == 1 else x.repeat_interleave(ids.shape[1], 0)


def empty_slots(x: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """A slot product's output [T*k, n], uninitialised (the slot ops' fake implementations)."""
    return x.new_empty(ids.shape[0] * ids.shape[1], n)
