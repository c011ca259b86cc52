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
import ctypes

import numpy as np
import torch
import torch.nn.functional as F

from .int8 import Int8Weight, int8_linear
from .native import blas_has_own_threads, few_rows

GEMV_MAX_ROWS = 4
NATIVE_MAX_ROWS = 16       # measured: past ~16 rows BLAS (float32) and _weight_int8pack_mm (int8) win


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K], w [N, K] -> [T, N], written into `out` when given."""
    if x.dim() == 2 and 0 < x.shape[0] <= NATIVE_MAX_ROWS:
        y = out if out is not None else x.new_empty(x.shape[0], w.shape[0])
        if _few_rows_grouped(x, w, [(0, 0, x.shape[0])], y, single=True):
            return y if bias is None else y.add_(bias)
    if isinstance(w, Int8Weight):
        return int8_linear(x, w, bias, out)
    if x.dtype != torch.float32 or w.dtype != torch.float32 or x.dim() != 2 or x.shape[0] == 0:
        y = F.linear(x, w, bias)
        return y if out is None else out.copy_(y)
    out = torch.empty(x.shape[0], w.shape[0]) if out is None else out
    lib = few_rows()
    if not blas_has_own_threads() and x.stride(-1) == 1 and w.is_contiguous() and out.stride(-1) == 1:
        lib.raymoe_f32_gemm(lib.sgemm, x.data_ptr(), x.shape[0], x.stride(0), w.data_ptr(), w.shape[0],
                            w.shape[1], out.data_ptr(), out.stride(0))
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
    """Rows a:b of x through weights[g] (and bias[g]) for each (g, a, b) in groups, into one
    output: e.g. the tokens of each expert. x [T, K], weights [G, N, K]. Groups of a few rows go
    to the compiled kernel in one call, longer ones one product each."""
    out = x.new_empty(x.shape[0], weights.shape[1])
    few = [g for g in groups if g[2] - g[1] <= NATIVE_MAX_ROWS]
    if few and _few_rows_grouped(x, weights, few, out):
        groups_left = [g for g in groups if g[2] - g[1] > NATIVE_MAX_ROWS]
    else:
        groups_left = groups
    for g, a, b in groups_left:
        linear(x[a:b], weights[g], out=out[a:b])
    if bias is not None:
        counts = torch.tensor([b - a for _, a, b in groups])
        out += bias[torch.tensor([g for g, _, _ in groups]).repeat_interleave(counts)]
    return out


def _few_rows_grouped(x: torch.Tensor, weights, groups: list[tuple[int, int, int]], out: torch.Tensor,
                      single: bool = False) -> bool:
    """Run groups through kernels/csrc/few_rows.c into `out` (weights [G, N, K], or one [N, K]
    weight when single); False where that library or these tensors' layout can't."""
    lib = few_rows()
    if lib is None or x.dtype != torch.float32 or x.stride(-1) != 1 or out.stride(-1) != 1:
        return False
    n, k = weights.shape[-2:]
    stride = 0 if single else n * k
    table = (ctypes.c_int64 * (3 * len(groups)))(*(v for group in groups for v in group))
    if isinstance(weights, Int8Weight):
        if not weights.q.is_contiguous():
            return False
        if lib.raymoe_i8_grouped(x.data_ptr(), x.shape[0], x.stride(0), weights.q.data_ptr(),
                                 weights.scale.data_ptr(), stride, table, len(groups), n, k, out.data_ptr(),
                                 out.stride(0)):
            raise MemoryError("int8 product: out of memory")
        return True
    if weights.dtype != torch.float32 or not weights.is_contiguous() or blas_has_own_threads():
        return False
    lib.raymoe_f32_grouped(x.data_ptr(), x.stride(0), weights.data_ptr(), stride, table,
                           len(groups), n, k, out.data_ptr(), out.stride(0))
    return True


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
