"""Causal grouped-query attention of one sequence's new tokens over its KV cache.

Positions are explicit so that the same code serves full caches, sliding windows and
ring buffers. Optional per-head sinks add one unscaled logit column that takes part in
the softmax and is then dropped (gpt-oss).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from . import native
from .gpu_ops import use_triton
from .ops import custom_op

# Up to this many query rows (decode), one call of the compiled kernel replaces the dozen torch
# operations below; more rows (prefill) go to torch's matrix products.
FEW_QUERIES = 4
SOURCE = Path(__file__).parent / "csrc" / "attention.c"


@lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = native.load_source(SOURCE, fallback="decode attention runs as torch operations")
    if lib is not None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.raymoe_attention_rows.argtypes = [p, i, i, i, p, p, i, i, i, p, p, ctypes.c_float, i, p, p]
        lib.raymoe_attention_rows.restype = ctypes.c_int
    return lib


def _few_rows(q, k, v, q_pos, k_pos, scale, window, sinks) -> torch.Tensor | None:
    """The compiled kernel's result, or None when it does not apply (no library, other dtypes)."""
    lib = _library()
    if lib is None or q.shape[0] > FEW_QUERIES or q.is_cuda or \
            any(t.dtype != torch.float32 for t in (q, k, v)) or q.shape[1] % k.shape[1]:
        return None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_pos, k_pos = q_pos.to(torch.int64).contiguous(), k_pos.to(torch.int64).contiguous()
    sinks = None if sinks is None else sinks.float().contiguous()
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    if lib.raymoe_attention_rows(q.data_ptr(), q.shape[0], q.shape[1], q.shape[2], k.data_ptr(), v.data_ptr(),
                                 k.shape[0], k.shape[1], v.shape[-1], q_pos.data_ptr(), k_pos.data_ptr(), scale,
                                 window or 0, None if sinks is None else sinks.data_ptr(), out.data_ptr()):
        raise MemoryError("attention: could not allocate the score buffers")
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D], q_pos [Tq], k_pos [Tk] -> [Tq, Hq, D].

    Query head h reads KV head h // (Hq / Hkv). A key is visible when k_pos <= q_pos and,
    with a window, k_pos > q_pos - window. On CUDA the Triton kernel (kernels/gpu_ops.py) takes head sizes
    its tiles fit (a power of two, at least 16). That kernel, and the CPU's for a few query rows, run as
    the custom op raymoe::attention (attention_op below), which torch.compile traces as one call.
    """
    d = q.shape[-1]
    triton = use_triton("attention", q) and q.dtype == torch.float32 and d >= 16 and d & (d - 1) == 0
    if triton or (not q.is_cuda and q.shape[0] <= FEW_QUERIES):
        return attention_op(q, k, v, q_pos, k_pos, scale, window, sinks)
    return torch_attention(q, k, v, q_pos, k_pos, scale, window, sinks)


def cpu_attention(q, k, v, q_pos, k_pos, scale, window=None, sinks=None) -> torch.Tensor:
    """The CPU's: the compiled kernel for a few query rows, torch's products otherwise."""
    few = _few_rows(q, k, v, q_pos, k_pos, scale, window, sinks)
    return few if few is not None else torch_attention(q, k, v, q_pos, k_pos, scale, window, sinks)


@custom_op("attention")
def attention_op(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float, window: Optional[int],
                 sinks: Optional[Tensor]) -> Tensor:
    """`attention` as a custom op (kernels/ops.py): q [Tq, Hq, D] over k/v [Tk, Hkv, D] at positions q_pos [Tq],
    k_pos [Tk] -> [Tq, Hq, D]."""
    return cpu_attention(q, k, v, q_pos, k_pos, scale, window, sinks)


@attention_op.register_kernel("cuda")
def _(q, k, v, q_pos, k_pos, scale, window, sinks):
    from .triton.attention import attention as run     # on first use: triton is optional where only the CPU runs
    return run(q, k, v, q_pos, k_pos, scale, window, sinks)


@attention_op.register_fake
def _(q, k, v, q_pos, k_pos, scale, window, sinks):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


def torch_attention(q, k, v, q_pos, k_pos, scale, window=None, sinks=None) -> torch.Tensor:
    tq, hq, d = q.shape
    tk, hkv, dv = v.shape
    group = hq // hkv
    # [Hkv, group*Tq, D] @ [Hkv, D, Tk]: GQA without materialising repeated keys.
    qg = q.reshape(tq, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * tq, d)
    scores = torch.matmul(qg, k.permute(1, 2, 0)).float() * scale
    scores = scores.view(hkv, group, tq, tk)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(hkv, group, 1, 1).expand(hkv, group, tq, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :tk]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype).view(hkv, group * tq, tk), v.permute(1, 0, 2))
    return out.view(hkv, group, tq, dv).permute(2, 0, 1, 3).reshape(tq, hq, dv)
