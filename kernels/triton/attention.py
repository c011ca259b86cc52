"""Causal grouped-query attention of one sequence's new tokens over its KV cache on the GPU
(kernels/attention.py): explicit positions, optional sliding window, per-head sinks (one extra logit
that joins the softmax and is dropped) and the output gate of Qwen's gated attention
(out * sigmoid(gate)). Online softmax over key tiles (flash attention): nothing of size Tq x Tk is
stored. One program per (query tile, query head); tiles are at least 16 wide for tl.dot.

One query (decode) takes two other kernels instead (flash decoding): one program per (query head, split
of SPLIT keys) with products as sums rather than tl.dot (a 16-row tile would be 15 rows of padding, and a
head's programs too few to fill the GPU), then one program per head merges its splits in order. Splits
start at multiples of SPLIT, so keys past the last one a query sees (a CUDA graph reads a cache's whole
storage, stages/runtime/decode_graph.py) change no bit of the result: their splits and tiles add exact zeros."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_device, power_of_two

BLOCK_M = 16
BLOCK_N = 32
SPLIT = 64          # keys a decode program reads
SPLIT_BLOCK = 16    # keys it loads at a time


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


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, q_pos_ptr, k_pos_ptr, m_ptr, l_ptr, acc_ptr, Tk, Hkv, n_splits, scale,
                         window, D: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                         WINDOW: tl.constexpr):
    h, split = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + h * D + d)
    q_pos = tl.load(q_pos_ptr)
    kv_head = h // GROUP
    m_i = tl.full((1,), -1.0e30, tl.float32)      # finite: exp(m_old - m_new) stays defined when nothing is seen
    l_i = tl.zeros((1,), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for start in range(split * SPLIT, split * SPLIT + SPLIT, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < Tk
        k_pos = tl.load(k_pos_ptr + cols, mask=col_mask, other=0)
        visible = col_mask & (k_pos <= q_pos)
        if WINDOW:
            visible = visible & (k_pos > q_pos - window)
        kv_off = (cols.to(tl.int64)[:, None] * Hkv + kv_head) * D + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=col_mask[:, None], other=0.0)
        s = tl.where(visible, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(v_ptr + kv_off, mask=col_mask[:, None], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    at = h * n_splits + split
    one = tl.arange(0, 1)
    tl.store(m_ptr + at + one, m_i)
    tl.store(l_ptr + at + one, l_i)
    tl.store(acc_ptr + at * D + d, acc)


@triton.jit
def _decode_merge_kernel(m_ptr, l_ptr, acc_ptr, sinks_ptr, gate_ptr, out_ptr, n_splits, D: tl.constexpr,
                         SINKS: tl.constexpr, GATE: tl.constexpr):
    h = tl.program_id(0)
    d = tl.arange(0, D)
    one = tl.arange(0, 1)
    if SINKS:    # the sink starts the softmax: max = sink, sum = exp(sink - sink)
        m_i = tl.load(sinks_ptr + h + one).to(tl.float32)
        l_i = tl.full((1,), 1.0, tl.float32)
    else:
        m_i = tl.full((1,), -1.0e30, tl.float32)
        l_i = tl.zeros((1,), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for split in range(0, n_splits):     # in order: the same sums however many empty splits follow
        at = h * n_splits + split
        m_s = tl.load(m_ptr + at + one)
        m_new = tl.maximum(m_i, m_s)
        alpha, beta = tl.exp(m_i - m_new), tl.exp(m_s - m_new)
        l_i = l_i * alpha + tl.load(l_ptr + at + one) * beta
        acc = acc * alpha + tl.load(acc_ptr + at * D + d) * beta
        m_i = m_new
    out = acc / l_i
    if GATE:
        out = out * tl.sigmoid(tl.load(gate_ptr + h * D + d))
    tl.store(out_ptr + h * D + d, out)


def _decode(q, k, v, q_pos, k_pos, scale, window, sinks, gate, out) -> None:
    """One query row: the split kernel, then the merge (flash decoding)."""
    tk, hkv = k.shape[0], k.shape[1]
    hq, d = q.shape[1], q.shape[2]
    n_splits = max(1, triton.cdiv(tk, SPLIT))
    m, l = q.new_empty(hq, n_splits), q.new_empty(hq, n_splits)
    acc = q.new_empty(hq, n_splits, d)
    _decode_split_kernel[(hq, n_splits)](q, k, v, q_pos, k_pos, m, l, acc, tk, hkv, n_splits, scale, window or 0,
                                         D=d, GROUP=hq // hkv, SPLIT=SPLIT, BLOCK_N=SPLIT_BLOCK,
                                         WINDOW=window is not None)
    _decode_merge_kernel[(hq,)](m, l, acc, sinks.float().contiguous() if sinks is not None else q,
                                gate.contiguous() if gate is not None else q, out, n_splits, D=d,
                                SINKS=sinks is not None, GATE=gate is not None)


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
    if tq == 1 and hq:
        _decode(q, k, v, q_pos.to(torch.int64).contiguous(), k_pos.to(torch.int64).contiguous(), scale, window, sinks,
                gate, out)
    elif tq and hq:
        q_pos, k_pos = q_pos.to(torch.int64).contiguous(), k_pos.to(torch.int64).contiguous()
        _attention_kernel[(triton.cdiv(tq, BLOCK_M), hq)](
            q, k, v, q_pos, k_pos, sinks.float().contiguous() if sinks is not None else q,
            gate.contiguous() if gate is not None else q, out, tq, tk, hq, hkv, scale, window or 0,
            D=d, GROUP=hq // hkv, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, WINDOW=window is not None,
            SINKS=sinks is not None, GATE=gate is not None)
    return out
