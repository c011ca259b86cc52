"""Products straight from GGML blocks on the GPU: the weight stays in the bytes the GGUF file stores
(uint8 [..., N, row_bytes], as kernels/blocks.py takes it) and each 32-value piece of a row is decoded
in registers, then multiplied with float32 activations and summed in float32 (the exact mode of
kernels/blocks.py; there is no 8-bit-activation mode here).

    grouped_product     for each (g, a, b): out[a:b] = x[a:b] @ deq(raw[g]).T  (decode's few rows and the
                        experts' groups of tokens: a multiply-and-sum over the tile; groups of more than
                        FEW_ROWS rows go through tensor-core tiles, tl.dot in IEEE float32)
    linear              out = x @ deq(raw).T, the one-group case
    dequantize_rows     raw rows (optionally picked by id: embeddings) -> float32, bit for bit as gguf-py

The decoders follow kernels/dequant.py operation for operation (scales to float32 first, then the same
multiplies and subtractions, no fused multiply-add) so that dequantisation is bit-exact.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from .launch import check_device

TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
         T.MXFP4)
FEW_ROWS = 16          # groups up to this many rows multiply-and-sum; longer ones use tl.dot tiles
PIECE = 32             # values decoded per step: one legacy block, one K-quant sub-block (or two halves)


@triton.jit
def _byte(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, mask):
    """The little-endian float16 at p (two bytes), as float32."""
    bits = _byte(p, mask) | (_byte(p + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(s, sub, mask):
    """Q4_K/Q5_K: scale and min of sub-block `sub` (0..7) from the 12 scale bytes at s (see dequant.py)."""
    if sub < 4:
        sc = _byte(s + sub, mask) & 63
        mn = _byte(s + 4 + sub, mask) & 63
    else:
        packed = _byte(s + 4 + sub, mask)
        sc = (packed & 15) | ((_byte(s + sub - 4, mask) >> 2) & 0x30)
        mn = (packed >> 4) | ((_byte(s + sub, mask) >> 2) & 0x30)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _decode(blk, sub, mask, limit, TYPE: tl.constexpr):
    """Values 32*sub .. 32*sub+31 of the block starting at byte pointers blk [R, 1] -> float32 [R, 32]
    (rows where mask [R, 1] is off read nothing). For F32/F16/BF16 a block is one value: blk points at
    the first of the 32, of which only the first `limit` are read (a row need not be whole pieces)."""
    j = tl.arange(0, 32)[None, :]
    m = mask & (j < limit)
    if TYPE == 0:      # F32
        bits = (_byte(blk + 4 * j, m) | (_byte(blk + 4 * j + 1, m) << 8) | (_byte(blk + 4 * j + 2, m) << 16)
                | (_byte(blk + 4 * j + 3, m) << 24))
        x = bits.to(tl.float32, bitcast=True)
    elif TYPE == 1:    # F16
        x = _f16(blk + 2 * j, m)
    elif TYPE == 30:   # BF16: the top half of a float32
        bits = (_byte(blk + 2 * j, m) << 16) | (_byte(blk + 2 * j + 1, m) << 24)
        x = bits.to(tl.float32, bitcast=True)
    elif TYPE == 8:    # Q8_0: d | qs[32] int8
        q = _byte(blk + 2 + j, m).to(tl.int8).to(tl.float32)
        x = q * _f16(blk, mask)
    elif TYPE == 2:    # Q4_0: d | qs[16] nibbles (low: values 0..15)
        q = (_byte(blk + 2 + j % 16, m) >> (4 * (j // 16))) & 15
        x = (q.to(tl.float32) - 8) * _f16(blk, mask)
    elif TYPE == 3:    # Q4_1: d | m | qs[16]
        q = (_byte(blk + 4 + j % 16, m) >> (4 * (j // 16))) & 15
        x = q.to(tl.float32) * _f16(blk, mask) + _f16(blk + 2, mask)
    elif TYPE == 6:    # Q5_0: d | qh[4] (bit j: value j's 5th bit) | qs[16]
        q = (_byte(blk + 6 + j % 16, m) >> (4 * (j // 16))) & 15
        q = q | (((_byte(blk + 2 + j // 8, m) >> (j % 8)) & 1) << 4)
        x = (q.to(tl.float32) - 16) * _f16(blk, mask)
    elif TYPE == 7:    # Q5_1: d | m | qh[4] | qs[16]
        q = (_byte(blk + 8 + j % 16, m) >> (4 * (j // 16))) & 15
        q = q | (((_byte(blk + 4 + j // 8, m) >> (j % 8)) & 1) << 4)
        x = q.to(tl.float32) * _f16(blk, mask) + _f16(blk + 2, mask)
    elif TYPE == 10:   # Q2_K: scales[16] | qs[64] | d | dmin; value e: byte 16+32*(e//128)+e%32, bits 2*((e%128)//32)
        e = 32 * sub + j
        q = (_byte(blk + 16 + 32 * (e // 128) + e % 32, m) >> (2 * ((e % 128) // 32))) & 3
        scales = _byte(blk + e // 16, m)
        dl = _f16(blk + 80, mask) * (scales & 15).to(tl.float32)
        ml = _f16(blk + 82, mask) * (scales >> 4).to(tl.float32)
        x = q.to(tl.float32) * dl - ml
    elif TYPE == 11:   # Q3_K: hmask[32] | qs[64] | scales[12] | d
        e = 32 * sub + j
        s = e // 16
        lo = (_byte(blk + 96 + s % 8, m) >> (4 * (s // 8))) & 15
        hi = (_byte(blk + 104 + s % 4, m) >> (2 * (s // 4))) & 3
        dl = _f16(blk + 108, mask) * ((lo | (hi << 4)).to(tl.float32) - 32)
        ql = (_byte(blk + 32 + 32 * (e // 128) + e % 32, m) >> (2 * ((e % 128) // 32))) & 3
        hbit = (_byte(blk + e % 32, m) >> (e // 32)) & 1
        x = (ql.to(tl.float32) - ((hbit ^ 1) << 2).to(tl.float32)) * dl
    elif TYPE == 12:   # Q4_K: d | dmin | scales[12] | qs[128]; sub-block `sub` is one piece
        sc, mn = _k_scale_min(blk + 4, sub, mask)
        q = (_byte(blk + 16 + 32 * (sub // 2) + j, m) >> (4 * (sub % 2))) & 15
        x = q.to(tl.float32) * (_f16(blk, mask) * sc) - _f16(blk + 2, mask) * mn
    elif TYPE == 13:   # Q5_K: d | dmin | scales[12] | qh[32] (bit sub of byte j) | qs[128]
        sc, mn = _k_scale_min(blk + 4, sub, mask)
        q = (_byte(blk + 48 + 32 * (sub // 2) + j, m) >> (4 * (sub % 2))) & 15
        q = q | (((_byte(blk + 16 + j, m) >> sub) & 1) << 4)
        x = q.to(tl.float32) * (_f16(blk, mask) * sc) - _f16(blk + 2, mask) * mn
    elif TYPE == 14:   # Q6_K: ql[128] | qh[64] | scales[16] int8 | d; per 128-value half h, value r
        e = 32 * sub + j
        h, r = e // 128, e % 128
        lo = (_byte(blk + 64 * h + r % 64, m) >> (4 * (r // 64))) & 15
        hi = (_byte(blk + 128 + 32 * h + r % 32, m) >> (2 * (r // 32))) & 3
        sc = _byte(blk + 192 + e // 16, m).to(tl.int8).to(tl.float32)
        x = ((lo | (hi << 4)).to(tl.float32) - 32) * (_f16(blk + 208, mask) * sc)
    else:              # MXFP4 (39): e8m0 | qs[16] e2m1 nibbles; values doubled, scale halved
        nib = (_byte(blk + 1 + j % 16, m) >> (4 * (j // 16))) & 15
        mag, exp = nib & 1, (nib >> 1) & 3
        doubled = tl.where(exp == 0, mag, (2 + mag) << tl.maximum(exp - 1, 0))
        value = tl.where(nib >= 8, -doubled, doubled).to(tl.float32)
        e8 = _byte(blk, mask)
        d = tl.where(e8 < 2, 0x00200000 << e8, (e8 - 1) << 23).to(tl.float32, bitcast=True)
        x = value * d
    return x


@triton.jit
def _product_kernel(x_ptr, x_stride, raw_ptr, raw_stride, row_bytes, table_ptr, out_ptr, out_stride, N, K,
                    TYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """Program (n tile, group, m tile): rows BLOCK_M of the group times BLOCK_N weight rows."""
    g = tl.load(table_ptr + 3 * tl.program_id(1)).to(tl.int64)
    a = tl.load(table_ptr + 3 * tl.program_id(1) + 1)
    b = tl.load(table_ptr + 3 * tl.program_id(1) + 2)
    rows = a + tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < b, cols < N
    if a + tl.program_id(2) * BLOCK_M < b:
        weight_rows = raw_ptr + g * raw_stride + cols.to(tl.int64)[:, None] * row_bytes      # [BLOCK_N, 1]
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride                                # [BLOCK_M, 1]
        j = tl.arange(0, 32)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, 32):
            w = _decode(weight_rows + (k0 // QK) * TYPE_SIZE, (k0 % QK) // 32, col_mask[:, None], K - k0, TYPE)
            xs = tl.load(x_rows + k0 + j, mask=row_mask[:, None] & (k0 + j < K), other=0.0)
            if DOT:
                acc += tl.dot(xs, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.sum(xs[:, None, :] * w[None, :, :], axis=2)
        out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
        tl.store(out, acc, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _dequantize_kernel(raw_ptr, row_bytes, ids_ptr, out_ptr, n, K,
                       TYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (row tile, piece): 32 values of BLOCK_R rows."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = r < n
    ids = tl.load(ids_ptr + r, mask=row_mask, other=0)
    k0 = tl.program_id(1) * 32
    blk = raw_ptr + ids[:, None] * row_bytes + (k0 // QK) * TYPE_SIZE
    x = _decode(blk, (k0 % QK) // 32, row_mask[:, None], K - k0, TYPE)
    j = tl.arange(0, 32)[None, :]
    tl.store(out_ptr + r.to(tl.int64)[:, None] * K + k0 + j, x, mask=row_mask[:, None] & (k0 + j < K))


def row_bytes(ggml_type: int, k: int) -> int:
    if int(ggml_type) not in map(int, TYPES):
        raise ValueError(f"unsupported GGML type {ggml_type}")
    elems, size = GGML_QUANT_SIZES[T(ggml_type)]
    if k <= 0 or k % elems:
        raise ValueError(f"{T(ggml_type).name} rows need a positive multiple of {elems} values, got {k}")
    return k // elems * size


def _check_raw(raw: torch.Tensor, ggml_type: int, k: int, dims: int) -> None:
    if raw.dtype != torch.uint8 or raw.dim() != dims or not raw.is_contiguous():
        raise ValueError(f"raw must be a contiguous {dims}-d uint8 tensor, got {raw.dtype} {tuple(raw.shape)}")
    if raw.shape[-1] != row_bytes(ggml_type, k):
        raise ValueError(f"raw rows of {raw.shape[-1]} bytes, expected {row_bytes(ggml_type, k)} for "
                         f"{T(ggml_type).name} with k={k}")


def _check_matrix(t: torch.Tensor, name: str, rows: int | None, cols: int) -> None:
    if (t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != cols or (rows is not None and t.shape[0] != rows)
            or (cols > 1 and t.stride(1) != 1)):
        raise ValueError(f"{name} must be float32 [{rows if rows is not None else 'M'}, {cols}] with a contiguous "
                         f"last dimension, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


def grouped_product(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int,
                    groups: list[tuple[int, int, int]], out: torch.Tensor) -> torch.Tensor:
    """For each (g, a, b): out[a:b] = x[a:b] @ deq(raw[g]).T. x float32 [M, k], raw uint8 [G, N, row_bytes],
    out float32 [M, N] (last dimensions contiguous). Rows outside every group are left alone."""
    _check_raw(raw, ggml_type, k, 3)
    _check_matrix(x, "x", None, k)
    g_count, n, m = raw.shape[0], raw.shape[1], x.shape[0]
    _check_matrix(out, "out", m, n)
    check_device(x, raw, out)
    for g, a, b in groups:
        if not (0 <= g < g_count and 0 <= a <= b <= m):
            raise ValueError(f"group {(g, a, b)} out of range for {g_count} weights and {m} rows")
    few = [grp for grp in groups if 0 < grp[2] - grp[1] <= FEW_ROWS]
    many = [grp for grp in groups if grp[2] - grp[1] > FEW_ROWS]
    if few and n:
        longest = max(b - a for _, a, b in few)
        block_m = triton.next_power_of_2(longest)
        # the multiply-and-sum tile is block_m x block_n x 32 values: keep it within a few thousand registers
        _launch(x, raw, ggml_type, k, few, out, block_m, 32 if block_m <= 4 else 16, dot=False)
    if many and n:
        _launch(x, raw, ggml_type, k, many, out, 32, 32, dot=True)
    return out


def linear(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, out: torch.Tensor) -> torch.Tensor:
    """out = x @ deq(raw).T: x float32 [M, k], raw uint8 [N, row_bytes], out float32 [M, N]."""
    _check_raw(raw, ggml_type, k, 2)
    return grouped_product(x, raw[None], ggml_type, k, [(0, 0, x.shape[0])], out)


def slot_product(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, experts: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """out[i] = x[i] @ deq(raw[experts[i]]).T for every row i: experts int64 [M] stays on the device, so
    routed tokens need no sorting on the host (no synchronisation: decode's few tokens). Ids must be
    in range (the router's top-k are)."""
    _check_raw(raw, ggml_type, k, 3)
    _check_matrix(x, "x", None, k)
    m, n = x.shape[0], raw.shape[1]
    _check_matrix(out, "out", m, n)
    check_device(x, raw, out, experts)
    if m and n:
        rows = torch.arange(m, device=x.device)
        table = torch.stack((experts.reshape(-1).to(torch.int64), rows, rows + 1), 1).contiguous()
        qk, type_size = GGML_QUANT_SIZES[T(ggml_type)]
        _product_kernel[(triton.cdiv(n, 32), m, 1)](
            x, x.stride(0), raw, raw.stride(0), raw.shape[2], table, out, out.stride(0), n, k, TYPE=int(ggml_type),
            QK=qk, TYPE_SIZE=type_size, BLOCK_M=1, BLOCK_N=32, DOT=False)
    return out


def _launch(x, raw, ggml_type, k, groups, out, block_m, block_n, dot):
    qk, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    table = torch.tensor(groups, dtype=torch.int64, device=x.device)
    m_tiles = triton.cdiv(max(b - a for _, a, b in groups), block_m)
    grid = (triton.cdiv(raw.shape[1], block_n), len(groups), m_tiles)
    _product_kernel[grid](x, x.stride(0), raw, raw.stride(0), raw.shape[2], table, out, out.stride(0), raw.shape[1], k,
                          TYPE=int(ggml_type), QK=qk, TYPE_SIZE=type_size, BLOCK_M=block_m, BLOCK_N=block_n,
                          DOT=dot)


def dequantize_rows(raw: torch.Tensor, ggml_type: int, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """raw uint8 [N, row_bytes] -> float32 [len(ids) or N, k], bit-exact against gguf.quants.dequantize
    (the GPU build turns off fused multiply-adds for this)."""
    _check_raw(raw, ggml_type, k, 2)
    if ids is None:
        ids = torch.arange(raw.shape[0], device=raw.device)
    if ids.dim() != 1:
        raise ValueError(f"row ids must be 1-d, got shape {tuple(ids.shape)}")
    ids = ids.to(torch.int64).contiguous()
    check_device(raw, ids)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= raw.shape[0]):
        raise ValueError(f"row ids out of range for {raw.shape[0]} rows")
    out = torch.empty(ids.numel(), k, dtype=torch.float32, device=raw.device)
    if ids.numel():
        qk, type_size = GGML_QUANT_SIZES[T(ggml_type)]
        grid = (triton.cdiv(ids.numel(), 16), triton.cdiv(k, 32))
        _dequantize_kernel[grid](raw, raw.shape[1], ids, out, ids.numel(), k, TYPE=int(ggml_type), QK=qk,
                                 TYPE_SIZE=type_size, BLOCK_R=16, enable_fp_fusion=False)
    return out
