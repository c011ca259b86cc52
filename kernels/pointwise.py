"""SiLU, sigmoid and softplus whose every element's bits do not depend on the thread count.

torch splits a pointwise op over more than GRAIN elements evenly among its threads. Each thread's
share runs vectorised (SLEEF) but for its last few elements, which take the scalar formula; for
these three ops the two formulas can differ in the last bit. Where the shares end, and so which
elements take the scalar formula, moves with the thread count (measured: a [2401, 1000] silu at 3
threads differs from 1 thread). Large tensors therefore run here as one share, on one thread: rows
whose width is a multiple of the vector length (every released shape) are then vectorised whole.
Smaller ones already run as one share. A pass over a prefill's activations costs little next to
its products.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .threads import one_torch_thread

GRAIN = 32768      # at::internal::GRAIN_SIZE: pointwise ops up to this many elements run unsplit


def _unsplit(op, x: torch.Tensor) -> torch.Tensor:
    if x.numel() <= GRAIN or x.is_cuda or torch.get_num_threads() == 1:
        return op(x)
    with one_torch_thread():
        return op(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _unsplit(F.silu, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _unsplit(torch.sigmoid, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return _unsplit(F.softplus, x)
