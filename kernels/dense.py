"""Products with float32 weights: `y = x W^T`, for few rows, many rows and groups of rows.

Up to FEW_ROWS rows go to the compiled few-row kernel, longer ones to numpy's OpenBLAS run from
OpenMP threads (kernels/native.py). Measured here (2 threads, weights out of cache): 16 rows
times the 32768x1024 LM head take 5.3 ms there against 21 ms through OpenBLAS, and a 512-row
product runs at ~430 GFLOP/s where torch's float32 `F.linear` reaches ~170. Without the
library, float32 goes to OpenBLAS on its own threads (its matrix-vector product reads weights
at ~50 GB/s against torch's ~18) and torch's OpenMP workers must sleep between ops
(OMP_WAIT_POLICY=PASSIVE). All of it is plain float32 arithmetic; only the summation order differs.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch
import torch.nn.functional as F

from .native import blas_has_own_threads, f32_gemm, few_rows

GEMV_MAX_ROWS = 4
FEW_ROWS = 16       # measured: past ~16 rows BLAS (float32) and _weight_int8pack_mm (int8) win


def group_table(groups: list[tuple[int, int, int]]):
    """(g, a, b) triples as the flat int64 array the compiled kernels take."""
    return (ctypes.c_int64 * (3 * len(groups)))(*(v for group in groups for v in group))


def dense_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x [T, K] float32, w [N, K] float32 -> out [T, N]."""
    if x.is_cuda:       # cuBLAS (float32: torch leaves TF32 off for matrix products by default)
        return out.copy_(F.linear(x, w))
    if 0 < x.shape[0] <= FEW_ROWS and _few_rows_f32(x, w, [(0, 0, x.shape[0])], out, single=True):
        return out
    if x.shape[0] == 0:
        return out
    lib = f32_gemm()      # also the few rows the kernel above did not take (a CPU without AVX-512 VNNI)
    if lib is not None and x.stride(-1) == 1 and w.is_contiguous() and out.stride(-1) == 1:
        lib.raymoe_f32_gemm(lib.sgemm, x.data_ptr(), x.shape[0], x.stride(0), w.data_ptr(), w.shape[0],
                            w.shape[1], out.data_ptr(), out.stride(0))
        return out
    if out.stride(-1) != 1 or not w.is_contiguous():
        return out.copy_(F.linear(x, w))
    wn, xn, on = w.numpy(), x.numpy(), out.numpy()
    if x.shape[0] <= GEMV_MAX_ROWS:
        # a few matrix-vector products beat OpenBLAS's matrix product for a few rows (measured:
        # 2 rows x a 1024x512 weight, 0.07 against 0.15 ms)
        for row, o in zip(xn, on):
            np.matmul(wn, row, out=o)
    else:
        np.matmul(xn, wn.T, out=on)
    return out


def dense_grouped(x: torch.Tensor, weights: torch.Tensor, groups: list[tuple[int, int, int]],
                  out: torch.Tensor) -> torch.Tensor:
    """Rows a:b of x through weights[g] for each (g, a, b), into out. Groups of a few rows go to
    the compiled kernel in one call, longer ones one product each."""
    if x.is_cuda:
        for g, a, b in groups:
            out[a:b] = F.linear(x[a:b], weights[g])
        return out
    few = [g for g in groups if g[2] - g[1] <= FEW_ROWS]
    if few and _few_rows_f32(x, weights, few, out):
        groups = [g for g in groups if g[2] - g[1] > FEW_ROWS]
    for g, a, b in groups:
        dense_linear(x[a:b], weights[g], out[a:b])
    return out


def _few_rows_f32(x: torch.Tensor, weights: torch.Tensor, groups, out: torch.Tensor, single: bool = False) -> bool:
    """Run groups through kernels/csrc/few_rows.c into `out` (weights [G, N, K], or one [N, K]
    weight when single); False where that library or these tensors' layout can't."""
    lib = few_rows()
    if lib is None or blas_has_own_threads() or x.dtype != torch.float32 or x.stride(-1) != 1 \
            or out.stride(-1) != 1 or weights.dtype != torch.float32 or not weights.is_contiguous():
        return False
    n, k = weights.shape[-2:]
    lib.raymoe_f32_grouped(x.data_ptr(), x.stride(0), weights.data_ptr(), 0 if single else n * k,
                           group_table(groups), len(groups), n, k, out.data_ptr(), out.stride(0))
    return True
