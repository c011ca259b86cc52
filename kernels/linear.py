"""The products model code calls, whatever the weight's format (kernels/weights.py)."""
from __future__ import annotations

import torch

from .grouping import take_rows  # noqa: F401  (re-exported: callers outside kernels/ take it from here)
from .weights import as_weight


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T (+ bias)`: x [T, K] float32, w a weight [N, K] -> [T, N], written into `out` when given
    (otherwise one custom op per product, kernels/weights.py, which torch.compile traces)."""
    w = as_weight(w)
    y = w.product(x) if out is None else w.linear(x, out)
    return y if bias is None else y.add_(bias)


def grouped_linear(x: torch.Tensor, weights, groups: list[tuple[int, int, int]],
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Rows a:b of x through weights[g] (and bias[g]) for each (g, a, b) in groups, into one
    output: e.g. the tokens of each expert. x [T, K], weights [G, N, K]."""
    weights = as_weight(weights)
    out = weights.grouped(x, groups, x.new_empty(x.shape[0], weights.shape[-2]))
    if bias is not None:
        rows = torch.tensor([g for g, a, b in groups for _ in range(b - a)], dtype=torch.long, device=x.device)
        out += bias.index_select(0, rows)
    return out


def slot_linear(x: torch.Tensor, weights, ids: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row t*k+j: x[t] through weights[ids[t, j]] (and its bias), for x [T, K] and ids [T, k] left a tensor
    (no plan on the host in a traced step) -> [T*k, N]."""
    out = as_weight(weights).slot_product(x, ids)
    return out if bias is None else out.add_(bias.index_select(0, ids.reshape(-1)))


def lookup_rows(table, ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows of a weight table as float32."""
    return as_weight(table).rows(ids)
