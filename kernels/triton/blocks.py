"""Products straight from GGML blocks on the GPU: the weight stays in the bytes the GGUF file stores
(uint8 [..., N, row_bytes], as kernels/blocks.py takes it) and each 16-value half-piece of a row is
decoded in registers, then multiplied with float32 activations and summed in float32 (the exact mode of
kernels/blocks.py; there is no 8-bit-activation mode here).

    grouped_product     for each (g, a, b): out[a:b] = x[a:b] @ deq(raw[g]).T  (decode's few rows and the
                        experts' groups of tokens: a multiply-and-sum over the tile; groups of more than
                        FEW_ROWS rows go through tensor-core tiles, tl.dot in IEEE float32)
    linear              out = x @ deq(raw).T, the one-group case
    dequantize_rows     raw rows (optionally picked by id: embeddings) -> float32, bit for bit as gguf-py

The decoders follow kernels/dequant.py operation for operation (scales to float32 first, then the same
multiplies and subtractions, no fused multiply-add: every kernel here is compiled with fusion off) so
that dequantisation is bit-exact, in the products too; the products accumulate with explicit tl.fma.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from raymoe.kernels.blocks import check_raw, row_bytes as file_row_bytes

from .launch import check_device

TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
         T.MXFP4)
FEW_ROWS = 16          # groups up to this many rows multiply-and-sum; longer ones use tl.dot tiles
# slot products of more rows than this sort them by expert on the device (slot_product) rather than read
# an expert once for each row that chose it: gpt-oss-20b at 64 sequences on an H200, 419.5 against 274.2
# tok/s (2026-12-04)
SORTED_SLOTS = 16
# few-row tiles by the group's rows rounded up to a power of two: (weight rows a program, 16-value
# half-pieces a step, warps, steps unrolled). Rows x weight rows x step = 2048 float32 accumulators. At one
# row: 4 weight rows a program (a 4096-row weight makes 1024 programs, several per SM), 512 values of each
# a step (two K-quant super-blocks, sixteen legacy blocks), four steps' weight bytes in flight at once, and
# 4 warps, so 16 values a thread: for every format the per-half-piece scales then share the values' layout
# (compiled for sm_90: no shared-memory shuffle in the loop, no spills). Chosen on an H200 (tests/gpu/run.py,
# 2026-12-04, 4096 x 4096 weights) from 8 tiles: the fastest or within 12% of it for every format timed, and
# against the earlier (4, 32, 8, 2) 1.04-1.30x (Q4_K 553 -> 717 GB/s, Q3_K 260 -> 305, split MXFP4 503 -> 540,
# split Q8_0 1397 -> 1488). A product is bound by the bytes in flight: wide formats read more a value, so
# BF16 reaches 2.4 TB/s and Q3_K 0.3. tests/triton_cases.py's error bound holds for any K while half-pieces
# <= 32.
FEW_TILES = {1: (4, 32, 4, 4), 2: (4, 16, 8, 2), 4: (4, 8, 4, 1), 8: (4, 4, 4, 1), 16: (4, 2, 4, 1)}
# Q8_0 and MXFP4 on a GPU, "split": each row holds its blocks' quant bytes (all blocks, in order), then their
# scales, then zeros up to a multiple of 16 bytes (split_blocks; 0.4% more at gpt-oss-20b's rows). The file's
# 34- and 17-byte blocks leave a block's quants 2- and 1-byte aligned, so the kernels read them 2 bytes or 1
# byte at a time; split, a thread reads its 8 quant bytes in one load. The kernels take a split weight's type
# as SPLIT + its ggml type, and decode its values with the same operations, to the same bits.
SPLIT = 1000
SPLIT_QUANT_BYTES = {T.Q8_0: 32, T.MXFP4: 16}       # a block's quant bytes; its scale (2 and 1 bytes) comes first


@triton.jit
def _byte(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, mask):
    """The little-endian float16 at p (two bytes, always at an even offset), as float32 (exact)."""
    return tl.load(p.to(tl.pointer_type(tl.float16)), mask=mask, other=0).to(tl.float32)


@triton.jit
def _u32(p, mask):
    """The four bytes at p, little-endian, as one int32 (Q5_0/Q5_1's 32 fifth bits)."""
    return _byte(p, mask) | (_byte(p + 1, mask) << 8) | (_byte(p + 2, mask) << 16) | (_byte(p + 3, mask) << 24)


@triton.jit
def _small(q, offset: tl.constexpr):
    """float(q - offset) for ints 0 <= q < 2**23, exactly: q's bits under the float 2**23's exponent make
    2**23 + q, and subtracting 2**23 + offset is exact. Two full-rate operations where a conversion
    instruction (of the narrow integers the compiler turns bytes into) runs at a quarter of the rate."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _k_scale_min(s, sub, mask):
    """Q4_K/Q5_K: scale and min of sub-block `sub` (0..7) from the 12 scale bytes at s (see dequant.py)."""
    first = sub < 4
    b_sub = _byte(s + sub, mask)               # sub < 4: 6-bit scale; else the min's top 2 bits
    b_next = _byte(s + 4 + sub, mask)          # sub < 4: 6-bit min; else scale and min low nibbles
    b_prev = _byte(s + (sub + 4) % 8, mask)    # sub >= 4: byte sub - 4, the scale's top 2 bits
    sc = tl.where(first, b_sub & 63, (b_next & 15) | ((b_prev >> 2) & 0x30))
    mn = tl.where(first, b_next & 63, (b_next >> 4) | ((b_sub >> 2) & 0x30))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _decode(blk, sub, h, i, mask, TYPE: tl.constexpr):
    """Decode half-pieces of 16 values -> float32 [R, H, 16]: half-piece q is values 16h+0..15 of piece
    `sub` (32 values) of the block at byte pointers blk (for F32/F16/BF16, whose block is one value:
    blk points at the half-piece's first value). blk [R, H, 1], sub and h [1, H, 1], i = arange(16) on
    the last axis; mask [R, H, 1] (or [R, H, 16] for float rows that are not whole half-pieces).
    Bytes a half-piece shares (scales, fifth bits) are read once per half-piece on [R, H, 1] tiles; the
    quant bytes are contiguous along i, so the compiler loads them as wide words where they are aligned."""
    j = 16 * h + i                                  # value within the piece
    if TYPE == 0:      # F32
        x = tl.load(blk.to(tl.pointer_type(tl.float32)) + i, mask=mask, other=0)
    elif TYPE == 1:    # F16
        x = tl.load(blk.to(tl.pointer_type(tl.float16)) + i, mask=mask, other=0).to(tl.float32)
    elif TYPE == 30:   # BF16: the top half of a float32
        bits = tl.load(blk.to(tl.pointer_type(tl.uint16)) + i, mask=mask, other=0).to(tl.int32) << 16
        x = bits.to(tl.float32, bitcast=True)
    elif TYPE == 8:    # Q8_0: d | qs[32] int8
        x = _q8_0(blk + 2 + j, blk, mask)
    elif TYPE == 2:    # Q4_0: d | qs[16] nibbles (low: values 0..15)
        q = (_byte(blk + 2 + i, mask) >> (4 * h)) & 15
        x = _small(q, 8) * _f16(blk, mask)
    elif TYPE == 3:    # Q4_1: d | m | qs[16]
        q = (_byte(blk + 4 + i, mask) >> (4 * h)) & 15
        x = _small(q, 0) * _f16(blk, mask) + _f16(blk + 2, mask)
    elif TYPE == 6:    # Q5_0: d | qh[4] (bit j: value j's 5th bit) | qs[16]
        q = (_byte(blk + 6 + i, mask) >> (4 * h)) & 15
        q = q | (((_u32(blk + 2, mask) >> j) & 1) << 4)
        x = _small(q, 16) * _f16(blk, mask)
    elif TYPE == 7:    # Q5_1: d | m | qh[4] | qs[16]
        q = (_byte(blk + 8 + i, mask) >> (4 * h)) & 15
        q = q | (((_u32(blk + 4, mask) >> j) & 1) << 4)
        x = _small(q, 0) * _f16(blk, mask) + _f16(blk + 2, mask)
    elif TYPE == 10:   # Q2_K: scales[16] | qs[64] | d | dmin; piece sub: qs[32*(sub//4) + j] >> 2*(sub%4)
        q = (_byte(blk + 16 + 32 * (sub // 4) + j, mask) >> (2 * (sub % 4))) & 3
        scales = _byte(blk + 2 * sub + h, mask)     # one per 16 values: low nibble scale, high min
        dl = _f16(blk + 80, mask) * (scales & 15).to(tl.float32)
        ml = _f16(blk + 82, mask) * (scales >> 4).to(tl.float32)
        x = _small(q, 0) * dl - ml
    elif TYPE == 11:   # Q3_K: hmask[32] | qs[64] | scales[12] | d; 16-value group s: 6-bit scale
        s = 2 * sub + h
        lo = (_byte(blk + 96 + s % 8, mask) >> (4 * (s // 8))) & 15
        hi = (_byte(blk + 104 + s % 4, mask) >> (2 * (s // 4))) & 3
        dl = _f16(blk + 108, mask) * ((lo | (hi << 4)).to(tl.float32) - 32)
        ql = (_byte(blk + 32 + 32 * (sub // 4) + j, mask) >> (2 * (sub % 4))) & 3
        hbit = (_byte(blk + j, mask) >> sub) & 1
        x = _small(ql + (hbit << 2), 4) * dl          # ql - 4 where the high bit is clear
    elif TYPE == 12:   # Q4_K: d | dmin | scales[12] | qs[128]; piece sub is sub-block sub
        sc, mn = _k_scale_min(blk + 4, sub, mask)
        q = (_byte(blk + 16 + 32 * (sub // 2) + j, mask) >> (4 * (sub % 2))) & 15
        x = _small(q, 0) * (_f16(blk, mask) * sc) - _f16(blk + 2, mask) * mn
    elif TYPE == 13:   # Q5_K: d | dmin | scales[12] | qh[32] (bit sub of byte j) | qs[128]
        sc, mn = _k_scale_min(blk + 4, sub, mask)
        q = (_byte(blk + 48 + 32 * (sub // 2) + j, mask) >> (4 * (sub % 2))) & 15
        q = q | (((_byte(blk + 16 + j, mask) >> sub) & 1) << 4)
        x = _small(q, 0) * (_f16(blk, mask) * sc) - _f16(blk + 2, mask) * mn
    elif TYPE == 14:   # Q6_K: ql[128] | qh[64] | scales[16] int8 | d; value e = 32*sub + j = 128*(sub//4) + r
        r = 32 * (sub % 4) + j
        lo = (_byte(blk + 64 * (sub // 4) + r % 64, mask) >> (4 * (r // 64))) & 15
        hi = (_byte(blk + 128 + 32 * (sub // 4) + j, mask) >> (2 * (sub % 4))) & 3
        sc = _byte(blk + 192 + 2 * sub + h, mask).to(tl.int8).to(tl.float32)
        x = _small(lo | (hi << 4), 32) * (_f16(blk + 208, mask) * sc)
    else:              # MXFP4 (39): e8m0 | qs[16] e2m1 nibbles
        x = _mxfp4(blk + 1 + i, h, blk, mask)
    return x


@triton.jit
def _q8_0(q, d, mask):
    """Q8_0 values: the int8 quants at q times the float16 scale at d."""
    return _small(tl.load(q, mask=mask, other=0).to(tl.int32) ^ 0x80, 128) * _f16(d, mask)    # int8 + 128


@triton.jit
def _mxfp4(q, h, e, mask):
    """MXFP4 values: nibble h of the bytes at q (e2m1) times the e8m0 scale at e; values doubled, scale
    halved."""
    nib = (_byte(q, mask) >> (4 * h)) & 15
    # the doubled value's float32 bits: 0 and 1 for magnitudes 0, 1; from 2 on, exponent and mantissa
    # bit follow the e2m1 bits (2 -> 2.0 = 256 << 22, 3 -> 3.0, 4 -> 4.0, ... 7 -> 12.0)
    mag = nib & 7
    bits = tl.where(mag < 2, mag * 0x3F800000, (mag + 254) << 22)
    value = tl.where(nib > 8, bits | -0x80000000, bits).to(tl.float32, bitcast=True)   # 8: +0
    e8 = _byte(e, mask)
    d = tl.where(e8 < 2, 0x00200000 << e8, (e8 - 1) << 23).to(tl.float32, bitcast=True)
    return value * d


@triton.jit
def _decode_split(q, s, h, i, mask, TYPE: tl.constexpr):
    """_decode's half-pieces of a split block (Q8_0 or MXFP4): q points at the block's quant bytes, s at
    its scale."""
    if TYPE == 8:
        return _q8_0(q + 16 * h + i, s, mask)
    return _mxfp4(q + i, h, s, mask)


@triton.jit
def _half_pieces(row_ptrs, k0, starts, i, K, QK: tl.constexpr, TYPE_SIZE: tl.constexpr, TYPE: tl.constexpr,
                 STEP: tl.constexpr, VALUE_MASK: tl.constexpr, QUANT_BYTES: tl.constexpr):
    """Weight values k0+starts+i (starts: multiples of 16 below STEP; i: arange(16) on the last axis) of
    each row -> float32, zero past K. k0 is a multiple of STEP; when the step spans whole blocks every
    index below but k0 // QK is the same at every step (computed once, outside the loop). The mask is per
    half-piece unless rows end inside one (VALUE_MASK: float rows only), so that it never splits a wide
    load. QUANT_BYTES: a split weight's (see SPLIT), 0 for the file's blocks."""
    on = (k0 + starts + i < K) if VALUE_MASK else (k0 + starts < K)
    if STEP < QK:
        offset = k0 % QK + starts          # the step is part of one block
    else:
        offset = starts                    # the step is whole blocks: k0 is a block's first value
    if QUANT_BYTES:                        # split rows (Q8_0, MXFP4: QK is 32, K a multiple of it)
        q = row_ptrs + (k0 // QK) * QUANT_BYTES + (offset // QK) * QUANT_BYTES
        scale_bytes: tl.constexpr = TYPE_SIZE - QUANT_BYTES
        s = row_ptrs + (K // QK) * QUANT_BYTES + (k0 // QK) * scale_bytes + (offset // QK) * scale_bytes
        return _decode_split(q, s, (starts // 16) % 2, i, on, TYPE)
    blk = row_ptrs + (k0 // QK) * TYPE_SIZE + (offset // QK) * TYPE_SIZE
    return _decode(blk, (offset % QK) // 32, (starts // 16) % 2, i, on, TYPE)


@triton.jit
def _few_rows_kernel(x_ptr, x_stride, raw_ptr, raw_stride, row_bytes, table_ptr, out_ptr, out_stride, N, K,
                     TYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, HALVES: tl.constexpr, UNROLL: tl.constexpr, VALUE_MASK: tl.constexpr,
                     QUANT_BYTES: tl.constexpr):
    """Program (n tile, group): all rows of a group of at most BLOCK_M times BLOCK_N weight rows
    (_few_rows_tile)."""
    g = tl.load(table_ptr + 3 * tl.program_id(1)).to(tl.int64)
    a = tl.load(table_ptr + 3 * tl.program_id(1) + 1)
    b = tl.load(table_ptr + 3 * tl.program_id(1) + 2)
    _few_rows_tile(x_ptr, x_stride, raw_ptr, raw_stride, row_bytes, g, a, b, out_ptr, out_stride, N, K,
                   TYPE, QK, TYPE_SIZE, BLOCK_M, BLOCK_N, HALVES, UNROLL, VALUE_MASK, QUANT_BYTES)


@triton.jit
def _expert_rows_kernel(x_ptr, x_stride, raw_ptr, raw_stride, row_bytes, table_ptr, out_ptr, out_stride, N, K,
                        TYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, HALVES: tl.constexpr, UNROLL: tl.constexpr,
                        VALUE_MASK: tl.constexpr, QUANT_BYTES: tl.constexpr):
    """Program (n tile, group): a group of any number of rows (empty: nothing to do), BLOCK_M at a time."""
    g = tl.load(table_ptr + 3 * tl.program_id(1)).to(tl.int64)
    a = tl.load(table_ptr + 3 * tl.program_id(1) + 1)
    b = tl.load(table_ptr + 3 * tl.program_id(1) + 2)
    for r0 in range(a, b, BLOCK_M):
        _few_rows_tile(x_ptr, x_stride, raw_ptr, raw_stride, row_bytes, g, r0, b, out_ptr, out_stride, N, K,
                       TYPE, QK, TYPE_SIZE, BLOCK_M, BLOCK_N, HALVES, UNROLL, VALUE_MASK, QUANT_BYTES)


@triton.jit
def _few_rows_tile(x_ptr, x_stride, raw_ptr, raw_stride, row_bytes, g, a, b, out_ptr, out_stride, N, K,
                   TYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HALVES: tl.constexpr, UNROLL: tl.constexpr, VALUE_MASK: tl.constexpr,
                   QUANT_BYTES: tl.constexpr):
    """Rows a..min(b, a + BLOCK_M) of x times BLOCK_N rows of weight g (the program's n tile).

    Memory-bound at one row: the program walks the rows HALVES*16 values at a time (several blocks'
    bytes in flight at once) and keeps one float32 accumulator per (row, weight row, value of the step),
    updated by fused multiply-adds, so the loop has no reductions; the step's lanes are summed once at
    the end. Tiles are [BLOCK_M, BLOCK_N, HALVES, 16]: weights [1, BLOCK_N, ...], activations read in
    the full shape (at one row, the weight tile's own shape: the compiler gives memory accesses of one
    shape the widest access among them, so both are laid out alike, consecutive values a thread, and
    nothing moves through shared memory between them)."""
    rows = a + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # the last tile's columns past N repeat row N-1 (read, never stored): the loads need no column mask
    weight_rows = (raw_ptr + g * raw_stride
                   + tl.minimum(cols, N - 1).to(tl.int64)[None, :, None, None] * row_bytes)  # [1, BN, 1, 1]
    starts = 16 * tl.arange(0, HALVES)[None, None, :, None]
    i = tl.arange(0, 16)[None, None, None, :]
    x_ptrs = tl.broadcast_to(x_ptr + rows.to(tl.int64)[:, None, None, None] * x_stride + starts + i,
                             (BLOCK_M, BLOCK_N, HALVES, 16))
    row_on = (rows < b)[:, None, None, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N, HALVES, 16), dtype=tl.float32)
    # unrolled, the next step's weight loads are issued before this step's arithmetic: twice the bytes in
    # flight for a few more registers
    for k0 in tl.range(0, K, 16 * HALVES, loop_unroll_factor=UNROLL):
        w = _half_pieces(weight_rows, k0, starts, i, K, QK, TYPE_SIZE, TYPE, 16 * HALVES, VALUE_MASK, QUANT_BYTES)
        on = (k0 + starts + i < K) if VALUE_MASK else (k0 + starts < K)
        xs = tl.load(x_ptrs + k0, mask=row_on & on, other=0.0)
        acc = tl.fma(xs, w, acc)
    total = tl.sum(tl.sum(acc, axis=3), axis=2)          # 16 values of a half-piece, then the half-pieces
    out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, total, mask=(rows < b)[:, None] & (cols < N)[None, :])


@triton.jit
def _many_rows_kernel(x_ptr, x_stride, raw_ptr, raw_stride, row_bytes, table_ptr, out_ptr, out_stride, N, K,
                      TYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, VALUE_MASK: tl.constexpr, QUANT_BYTES: tl.constexpr):
    """Program (n tile, group, m tile): BLOCK_M rows of the group times BLOCK_N weight rows, 32 values at
    a time through tl.dot tiles in IEEE float32."""
    g = tl.load(table_ptr + 3 * tl.program_id(1)).to(tl.int64)
    a = tl.load(table_ptr + 3 * tl.program_id(1) + 1)
    b = tl.load(table_ptr + 3 * tl.program_id(1) + 2)
    rows = a + tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if a + tl.program_id(2) * BLOCK_M < b:
        weight_rows = raw_ptr + g * raw_stride + tl.minimum(cols, N - 1).to(tl.int64)[:, None, None] * row_bytes
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
        starts = 16 * tl.arange(0, 2)[None, :, None]
        i = tl.arange(0, 16)[None, None, :]
        j = tl.arange(0, 32)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, 32):
            w = _half_pieces(weight_rows, k0, starts, i, K, QK, TYPE_SIZE, TYPE, 32, VALUE_MASK, QUANT_BYTES)
            xs = tl.load(x_rows + k0 + j, mask=(rows < b)[:, None] & (k0 + j < K), other=0.0)
            acc += tl.dot(xs, tl.trans(tl.reshape(w, (BLOCK_N, 32))), input_precision="ieee")
        out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
        tl.store(out, acc, mask=(rows < b)[:, None] & (cols < N)[None, :])


@triton.jit
def _dequantize_kernel(raw_ptr, row_bytes, ids_ptr, out_ptr, n, K,
                       TYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_R: tl.constexpr,
                       QUANT_BYTES: tl.constexpr):
    """Program (row tile, piece): 32 values of BLOCK_R rows."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = r < n
    ids = tl.load(ids_ptr + r, mask=row_mask, other=0)
    k = tl.program_id(1) * 32 + 16 * tl.arange(0, 2)[None, :, None] + tl.arange(0, 16)[None, None, :]
    mask = row_mask[:, None, None] & (k < K)
    start = tl.program_id(1) * 32 + 16 * tl.arange(0, 2)[None, :, None]
    row = raw_ptr + ids[:, None, None] * row_bytes
    x = _half_pieces(row, 0, start, tl.arange(0, 16)[None, None, :], K, QK, TYPE_SIZE, TYPE, 32, True, QUANT_BYTES)
    tl.store(out_ptr + r.to(tl.int64)[:, None, None] * K + k, x, mask=mask)


def splits(ggml_type: int) -> bool:
    """Whether weights of this ggml type take the split layout on a GPU."""
    return ggml_type in SPLIT_QUANT_BYTES


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes a row of k values takes: the file's, or a split row's (ggml_type SPLIT + t)."""
    if ggml_type >= SPLIT:
        return -(-file_row_bytes(ggml_type - SPLIT, k) // 16) * 16
    return file_row_bytes(ggml_type, k)


def split_blocks(raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """A file's rows [..., N, bytes] of Q8_0 or MXFP4 -> the split layout (see SPLIT), on raw's device."""
    lead, quant, (qk, size) = raw.shape[:-1], SPLIT_QUANT_BYTES[ggml_type], GGML_QUANT_SIZES[T(ggml_type)]
    count = k // qk
    pieces = raw.reshape(*lead, count, size)
    out = raw.new_zeros(*lead, row_bytes(SPLIT + ggml_type, k))
    out[..., :count * quant] = pieces[..., size - quant:].reshape(*lead, count * quant)
    out[..., count * quant:count * size] = pieces[..., :size - quant].reshape(*lead, count * (size - quant))
    return out


def join_blocks(split: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """split_blocks undone: the file's rows again."""
    lead, quant, (qk, size) = split.shape[:-1], SPLIT_QUANT_BYTES[ggml_type], GGML_QUANT_SIZES[T(ggml_type)]
    count = k // qk
    pieces = split.new_empty(*lead, count, size)
    pieces[..., size - quant:] = split[..., :count * quant].reshape(*lead, count, quant)
    pieces[..., :size - quant] = split[..., count * quant:count * size].reshape(*lead, count, size - quant)
    return pieces.reshape(*lead, count * size)


def _check_raw(raw: torch.Tensor, ggml_type: int, k: int, dims: int) -> None:
    name = T(ggml_type % SPLIT).name + (" (split)" if ggml_type >= SPLIT else "")
    check_raw(raw, dims, row_bytes(ggml_type, k), f"{name} with k={k}")


def _check_matrix(t: torch.Tensor, name: str, rows: int | None, cols: int) -> None:
    if (t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != cols or (rows is not None and t.shape[0] != rows)
            or (cols > 1 and t.stride(1) != 1)):
        raise ValueError(f"{name} must be float32 [{rows if rows is not None else 'M'}, {cols}] with a contiguous "
                         f"last dimension, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


def grouped_product(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int,
                    groups: list[tuple[int, int, int]], out: torch.Tensor) -> torch.Tensor:
    """For each (g, a, b): out[a:b] = x[a:b] @ deq(raw[g]).T. x float32 [M, k], raw uint8 [G, N, row_bytes],
    out float32 [M, N] (last dimensions contiguous). Rows outside every group are left alone."""
    return prepare_grouped_product(x, raw, ggml_type, k, groups, out)()


def linear(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, out: torch.Tensor) -> torch.Tensor:
    """out = x @ deq(raw).T: x float32 [M, k], raw uint8 [N, row_bytes], out float32 [M, N]."""
    _check_raw(raw, ggml_type, k, 2)
    return grouped_product(x, raw[None], ggml_type, k, [(0, 0, x.shape[0])], out)


def prepare_grouped_product(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int,
                            groups: list[tuple[int, int, int]], out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """grouped_product's checks and group tables now; the returned function only launches the kernels
    (at most two: every few-row group in one, every many-row group in the other), so a caller can
    replay it, or capture it in a CUDA graph, without the host work."""
    _check_raw(raw, ggml_type, k, 3)
    _check_matrix(x, "x", None, k)
    g_count, n, m = raw.shape[0], raw.shape[1], x.shape[0]
    _check_matrix(out, "out", m, n)
    check_device(x, raw, out)
    for g, a, b in groups:
        if not (0 <= g < g_count and 0 <= a <= b <= m):
            raise ValueError(f"group {(g, a, b)} out of range for {g_count} weights and {m} rows")
    args = _options(ggml_type, k)
    launches = []
    few = [grp for grp in groups if 0 < grp[2] - grp[1] <= FEW_ROWS]
    many = [grp for grp in groups if grp[2] - grp[1] > FEW_ROWS]
    if few and n:
        block_m = triton.next_power_of_2(max(b - a for _, a, b in few))
        block_n, options = _few_rows_options(args, block_m)
        launches.append((_few_rows_kernel, (triton.cdiv(n, block_n), len(few)), _table(few, x.device), options))
    if many and n:
        m_tiles = triton.cdiv(max(b - a for _, a, b in many), 32)
        launches.append((_many_rows_kernel, (triton.cdiv(n, 32), len(many), m_tiles), _table(many, x.device),
                         dict(args, BLOCK_M=32, BLOCK_N=32)))

    def run() -> torch.Tensor:
        for kernel, grid, table, options in launches:
            kernel[grid](x, x.stride(0), raw, raw.stride(0), raw.shape[2], table, out, out.stride(0), n, k, **options)
        return out
    return run


def _options(ggml_type: int, k: int) -> dict:
    file_type = T(ggml_type % SPLIT)
    qk, type_size = GGML_QUANT_SIZES[file_type]
    return {"TYPE": int(file_type), "QK": qk, "TYPE_SIZE": type_size, "VALUE_MASK": k % 16 != 0,
            "QUANT_BYTES": SPLIT_QUANT_BYTES[file_type] if ggml_type >= SPLIT else 0,
            "enable_fp_fusion": False}        # decode as dequantize_rows does; the products use tl.fma


def _few_rows_options(args: dict, block_m: int) -> tuple[int, dict]:
    block_n, halves, warps, unroll = FEW_TILES[block_m]
    return block_n, dict(args, BLOCK_M=block_m, BLOCK_N=block_n, HALVES=halves, UNROLL=unroll, num_warps=warps)


# (rows, device) -> the table of one group over every row, as a plain product has: made once, so that a
# product inside a CUDA graph's capture copies nothing from the host (and the graph's table stays)
_WHOLE_TABLES: dict = {}


def _table(groups, device) -> torch.Tensor:
    if len(groups) == 1 and groups[0][:2] == (0, 0):
        key = (groups[0][2], str(device))
        if key not in _WHOLE_TABLES:
            _WHOLE_TABLES[key] = torch.tensor(groups, dtype=torch.int64, device=device)
        return _WHOLE_TABLES[key]
    return torch.tensor(groups, dtype=torch.int64, device=device)


def slot_product(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, experts: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """out[i] = x[i] @ deq(raw[experts[i]]).T for every row i: experts int64 [M] stays on the device, so
    routed tokens need no sorting on the host (no synchronisation: decode's tokens). Ids must be in range
    (the router's top-k are). Up to SORTED_SLOTS rows, one few-row launch with a one-row group per slot
    (an expert chosen by several rows is read once for each); more are sorted by expert on the device
    and each expert's rows go through it together (_expert_rows_kernel: each chosen expert read once per
    FEW_ROWS rows)."""
    _check_raw(raw, ggml_type, k, 3)
    _check_matrix(x, "x", None, k)
    m, n = x.shape[0], raw.shape[1]
    _check_matrix(out, "out", m, n)
    check_device(x, raw, out, experts)
    if m > SORTED_SLOTS and n:
        table, order = _expert_groups(experts.reshape(-1).to(torch.int64), raw.shape[0])
        xs, ys = x.index_select(0, order), x.new_empty(m, n)
        block_n, options = _few_rows_options(_options(ggml_type, k), FEW_ROWS)
        _expert_rows_kernel[(triton.cdiv(n, block_n), table.shape[0])](xs, xs.stride(0), raw, raw.stride(0),
                                                                       raw.shape[2], table, ys, ys.stride(0), n, k,
                                                                       **options)
        out.index_copy_(0, order, ys)
    elif m and n:
        rows = torch.arange(m, device=x.device)
        table = torch.stack((experts.reshape(-1).to(torch.int64), rows, rows + 1), 1).contiguous()
        block_n, options = _few_rows_options(_options(ggml_type, k), 1)
        _few_rows_kernel[(triton.cdiv(n, block_n), m)](x, x.stride(0), raw, raw.stride(0), raw.shape[2], table, out,
                                                       out.stride(0), n, k, **options)
    return out


def _expert_groups(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(table, order): the rows in order of expert (stable), and one (expert, first, end) entry per group
    of rows of one expert in that order, min(experts, rows) entries, the ones past the last group empty
    (first = end = rows). Device operations only: nothing is read on the host."""
    m = experts.shape[0]
    order = torch.argsort(experts, stable=True)
    ordered = experts[order]
    first = torch.ones(m, dtype=torch.bool, device=experts.device)
    first[1:] = ordered[1:] != ordered[:-1]
    group = torch.cumsum(first, 0) - 1                  # each ordered row's group
    count = min(n_experts, m)
    starts = torch.full((count + 1,), m, dtype=torch.int64, device=experts.device)
    starts.scatter_reduce_(0, group, torch.arange(m, device=experts.device), "amin")
    table = torch.stack((ordered[starts[:count].clamp(max=m - 1)], starts[:count], starts[1:]), 1).contiguous()
    return table, order


def dequantize_rows(raw: torch.Tensor, ggml_type: int, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """raw uint8 [N, row_bytes] -> float32 [len(ids) or N, k], bit-exact against gguf.quants.dequantize
    (the GPU build turns off fused multiply-adds for this)."""
    _check_raw(raw, ggml_type, k, 2)
    if ids is None:         # every row: nothing to check (reading ids back would wait for the GPU)
        ids = torch.arange(raw.shape[0], device=raw.device)
    else:
        if ids.dim() != 1:
            raise ValueError(f"row ids must be 1-d, got shape {tuple(ids.shape)}")
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= raw.shape[0]):
            raise ValueError(f"row ids out of range for {raw.shape[0]} rows")
    check_device(raw, ids)
    out = torch.empty(ids.numel(), k, dtype=torch.float32, device=raw.device)
    if ids.numel():
        grid = (triton.cdiv(ids.numel(), 16), triton.cdiv(k, 32))
        options = _options(ggml_type, k)
        del options["VALUE_MASK"]
        _dequantize_kernel[grid](raw, raw.shape[1], ids, out, ids.numel(), k, BLOCK_R=16, **options)
    return out
