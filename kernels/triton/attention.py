"""Causal grouped-query attention of one sequence's new tokens over its KV cache on the GPU
(kernels/attention.py): explicit positions, optional sliding window, per-head sinks (one extra logit
that joins the softmax and is dropped) and the output gate of Qwen's gated attention
(out * sigmoid(gate)). Online softmax over key tiles (flash attention): nothing of size Tq x Tk is
stored. One program per (query tile, query head); tiles are at least 16 wide for tl.dot."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_device, power_of_two

BLOCK_M = 16
BLOCK_N = 32


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, q_pos_ptr, k_pos_ptr, sinks_ptr, gate_ptr, out_ptr,
                      Tq, Tk, Hq, Hkv, scale, window,
                      D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      WINDOW: tl.constexpr, SINKS: tl.constexpr, GATE: tl.constexpr):
    h = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < Tq
    d = tl.arange(0, D)
    q_off = (rows.to(tl.int64)[:, None] * Hq + h) * D + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_mask[:, None], other=0.0)
    q_pos = tl.load(q_pos_ptr + rows, mask=row_mask, other=0)
    if SINKS:    # the sink starts the running softmax: max = sink, sum = exp(sink - sink)
        m_i = tl.zeros((BLOCK_M,), tl.float32) + tl.load(sinks_ptr + h).to(tl.float32)
        l_i = tl.full((BLOCK_M,), 1.0, tl.float32)
    else:        # a finite start keeps exp(m_old - m_new) defined for rows that see nothing (padding)
        m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    kv_head = h // GROUP
    for start in range(0, Tk, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < Tk
        k_pos = tl.load(k_pos_ptr + cols, mask=col_mask, other=0)
        visible = col_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        kv_off = (cols.to(tl.int64)[:, None] * Hkv + kv_head) * D + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=col_mask[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=col_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    if GATE:
        gate = tl.load(gate_ptr + q_off, mask=row_mask[:, None], other=0.0)
        out = out * tl.sigmoid(gate)
    tl.store(out_ptr + q_off, out, mask=row_mask[:, None])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
              gate: torch.Tensor | None = None) -> torch.Tensor:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] float32, q_pos [Tq], k_pos [Tk] -> [Tq, Hq, D], as
    kernels.attention.attention, then times sigmoid(gate) (gate [Tq, Hq, D]) when given."""
    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    if (k.shape != (tk, hkv, d) or v.shape != k.shape or hq % hkv or q_pos.shape != (tq,) or k_pos.shape != (tk,)
            or any(t.dtype != torch.float32 for t in (q, k, v)) or (gate is not None and gate.shape != q.shape)
            or (sinks is not None and sinks.shape != (hq,))):
        raise ValueError(f"attention shapes do not fit: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"q_pos {tuple(q_pos.shape)} k_pos {tuple(k_pos.shape)}")
    power_of_two(d, "head size")
    if d < 16:
        raise ValueError(f"head size must be at least 16 (tl.dot tiles), got {d}")
    check_device(q, k, v, q_pos, k_pos, sinks, gate)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    if tq and hq:
        q_pos, k_pos = q_pos.to(torch.int64).contiguous(), k_pos.to(torch.int64).contiguous()
        _attention_kernel[(triton.cdiv(tq, BLOCK_M), hq)](
            q, k, v, q_pos, k_pos, sinks.float().contiguous() if sinks is not None else q,
            gate.contiguous() if gate is not None else q, out, tq, tk, hq, hkv, scale, window or 0,
            D=d, GROUP=hq // hkv, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, WINDOW=window is not None,
            SINKS=sinks is not None, GATE=gate is not None)
    return out
