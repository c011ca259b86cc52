"""`y = x W^T (+ b)`, routed to the fastest kernel for the weight: float32, bfloat16 or int8 rows.

float32 products: up to NATIVE_MAX_ROWS rows go to the compiled few-row kernel, longer ones to
numpy's OpenBLAS run from OpenMP threads (kernels/native.py). Measured here (2 threads, weights
out of cache): 16 rows times the 32768x1024 LM head take 5.3 ms there against 21 ms through
OpenBLAS, and a 512-row product runs at ~430 GFLOP/s where torch's float32 `F.linear` reaches
~170. Without the library, float32 goes to OpenBLAS on its own threads (its matrix-vector
product reads weights at ~50 GB/s against torch's ~18) and torch's OpenMP workers must sleep
between ops (OMP_WAIT_POLICY=PASSIVE). All of it is plain float32 arithmetic; only the
summation order differs. bfloat16 stays with torch, int8 weights go to kernels/int8.py.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from .int8 import NATIVE_MAX_ROWS, Int8Weight, int8_linear
from .native import blas_has_own_threads, few_rows

GEMV_MAX_ROWS = 4


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K], w [N, K] -> [T, N], written into `out` when given."""
    if isinstance(w, Int8Weight):
        return int8_linear(x, w, bias, out)
    if x.dtype != torch.float32 or w.dtype != torch.float32 or x.dim() != 2 or x.shape[0] == 0:
        y = F.linear(x, w, bias)
        return y if out is None else out.copy_(y)
    out = torch.empty(x.shape[0], w.shape[0]) if out is None else out
    lib = few_rows()
    if not blas_has_own_threads() and x.stride(-1) == 1 and w.is_contiguous() and out.stride(-1) == 1:
        args = (x.data_ptr(), x.shape[0], x.stride(0), w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr(),
                out.stride(0))
        if x.shape[0] <= NATIVE_MAX_ROWS:
            lib.raymoe_f32_rows(*args)
        else:
            lib.raymoe_f32_gemm(lib.sgemm, *args)
        return out if bias is None else out.add_(bias)
    wn, xn, on = w.numpy(), x.numpy(), out.numpy()
    if x.shape[0] <= GEMV_MAX_ROWS:
        # a few matrix-vector products beat OpenBLAS's matrix product for a few rows (measured:
        # 2 rows x a 1024x512 weight, 0.07 against 0.15 ms)
        for row, o in zip(xn, on):
            np.matmul(wn, row, out=o)
    else:
        np.matmul(xn, wn.T, out=on)
    return out if bias is None else out.add_(bias)


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, groups: list[tuple[int, int, int]],
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Rows a:b of x through weights[g] (and bias[g]) for each (g, a, b) in groups: one product
    per group into one output, e.g. the tokens of each expert. x [T, K], weights [G, N, K]."""
    out = x.new_empty(x.shape[0], weights.shape[1])
    for g, a, b in groups:
        linear(x[a:b], weights[g], None if bias is None else bias[g], out=out[a:b])
    return out


@contextlib.contextmanager
def torch_threads_for(openblas_products: bool, n_rows: int):
    """Run a step of n_rows tokens with fewer torch threads where that is faster: when the
    products (float32 weights) of a few rows go to OpenBLAS's own threads (no compiled library),
    torch's other ops are too small to share out, so one torch thread keeps its workers from
    waking to compete with OpenBLAS (measured: batch-1 decode ~5-12% faster). The choice depends
    only on the step, never on timing, so outputs stay reproducible."""
    threads = torch.get_num_threads()
    if not openblas_products or not blas_has_own_threads() or n_rows > GEMV_MAX_ROWS or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
