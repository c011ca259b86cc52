"""Dequantise GGML tensor data (as gguf-py's GGUFReader maps it) to float32 torch tensors.

Vectorised PyTorch: a row's bytes are viewed as ``[n_blocks, type_size]`` uint8 and every
format is decoded with bit operations on whole tensors.  Results are bit-exact against
``gguf.quants.dequantize``: scales are converted from float16 (or e8m0) to float32 first and
the float operations happen in the same order as there (no fused multiply-add).

Input layouts (gguf 0.19 ``ReaderTensor.data``):
  * F32 / F16: float32 / float16 arrays in element shape (slowest dimension first).
  * every other type, BF16 included: uint8 arrays of shape ``[..., bytes_per_row]``.
Raw row bytes as a numpy or torch uint8 array of shape ``[..., bytes_per_row]`` are accepted
for every type (F32 and F16 too).
"""
from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType as T

__all__ = ["dequantize"]


def _u8(data) -> torch.Tensor:
    """Raw bytes as a torch uint8 tensor, copying a numpy array only when torch cannot share it.

    A read-only (mmap'd) array is copied once; the decoders below never write to their input,
    so sharing a writable array or a torch tensor is safe.
    """
    if isinstance(data, torch.Tensor):
        return data
    arr = np.asarray(data)
    if not (arr.flags.writeable and arr.flags.c_contiguous):
        arr = np.array(arr, copy=True, order="C")
    return torch.from_numpy(arr)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 stored in the 2 bytes ``b[..., 0:2]``, as float32 [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def _bits(x: torch.Tensor, shifts: list[int], dim: int, mask: int) -> torch.Tensor:
    """``(x.unsqueeze(dim) >> shifts) & mask``: one new axis at ``dim`` per shift."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=x.device)
    shape = [1] * (x.dim() + 1)
    shape[dim] = len(shifts)
    return (x.unsqueeze(dim) >> s.view(shape)) & mask


# ---------------------------------------------------------------------------------------------
# Plain float types.

def _float(data, qtype: T) -> torch.Tensor:
    """F32 / F16: always returns a fresh float32 tensor (never aliases a read-only mmap)."""
    dtype = {T.F32: (np.float32, torch.float32), T.F16: (np.float16, torch.float16)}[qtype]
    if isinstance(data, torch.Tensor):
        if data.dtype == torch.uint8:
            data = data.contiguous().view(dtype[1])
        return data.to(torch.float32, copy=True)
    arr = np.asarray(data)
    if arr.dtype == np.uint8:
        arr = np.ascontiguousarray(arr).view(dtype[0])
    # numpy does the float16 -> float32 conversion, exactly as gguf.quants does
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))


def _bf16(b: torch.Tensor) -> torch.Tensor:
    # BF16: 2 bytes per element, the top half of a float32 (stored as uint8 by the reader).
    return b.contiguous().view(torch.bfloat16).float()


# ---------------------------------------------------------------------------------------------
# Legacy 32-element block formats.

def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # Q8_0 (34 B): d f16 | qs[32] int8.  x = qs * d
    d = _f16(b[:, 0:2])
    return b[:, 2:].contiguous().view(torch.int8).float().mul_(d)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    return _bits(qs, [0, 4], 1, 0x0F).reshape(qs.shape[0], 32)


def _high_bit(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes (a little-endian uint32) -> [n, 32]: bit j is element j's 5th bit."""
    return _bits(qh, list(range(8)), 2, 1).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # Q4_0 (18 B): d f16 | qs[16] nibbles.  x = d * (q - 8)
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:]).float().sub_(8)
    return q.mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # Q4_1 (20 B): d f16 | m f16 | qs[16] nibbles.  x = d * q + m
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:]).float()
    return q.mul_(d).add_(m)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # Q5_0 (22 B): d f16 | qh[4] (5th bits) | qs[16] nibbles.  x = d * (q - 16)
    d = _f16(b[:, 0:2])
    q = (_nibbles(b[:, 6:]) | (_high_bit(b[:, 2:6]) << 4)).float().sub_(16)
    return q.mul_(d)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    # Q5_1 (24 B): d f16 | m f16 | qh[4] (5th bits) | qs[16] nibbles.  x = d * q + m
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = (_nibbles(b[:, 8:]) | (_high_bit(b[:, 4:8]) << 4)).float()
    return q.mul_(d).add_(m)


# ---------------------------------------------------------------------------------------------
# K-quants: 256-element super-blocks made of 16 or 8 sub-blocks, each with its own scale.

def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # Q2_K (84 B): scales[16] (low nibble scale, high nibble min) | qs[64] 2-bit | d f16 | dmin f16
    # 16 sub-blocks of 16; byte i of each 32-byte half holds 4 elements 32 apart.
    # x = (d * sc) * q - (dmin * m)
    n = b.shape[0]
    scales, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = _bits(qs.reshape(n, 2, 32), [0, 2, 4, 6], 2, 0x03).reshape(n, 16, 16).float()
    return q.mul_(dl).sub_(ml).view(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # Q3_K (110 B): hmask[32] (3rd bits, inverted) | qs[64] 2-bit | scales[12] (16 x 6-bit) | d f16
    # Scale i: low 4 bits from byte i%8 (nibble i//8), high 2 bits from byte 8+i%4 (pair i//4).
    # x = (d * (sc - 32)) * (q - 4 * (1 - hbit))
    n = b.shape[0]
    hmask, qs, scales = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])
    lo = _bits(scales[:, 0:8], [0, 4], 1, 0x0F).reshape(n, 16)
    hi = _bits(scales[:, 8:12], [0, 2, 4, 6], 1, 0x03).reshape(n, 16)
    sc = (lo | (hi << 4)).float().sub_(32)
    dl = (d * sc).view(n, 16, 1)
    ql = _bits(qs.reshape(n, 2, 32), [0, 2, 4, 6], 2, 0x03).reshape(n, 16, 16)
    qh = _bits(hmask, list(range(8)), 1, 0x01).reshape(n, 16, 16)
    q = ql.float().sub_(((qh ^ 1) << 2).float())
    return q.mul_(dl).view(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins.

    Bytes 0-3: scale j (low 6 bits) for j<4; bytes 4-7: min j for j<4; bytes 8-11: low
    nibble = low 4 bits of scale j+4, high nibble = low 4 bits of min j+4, whose top 2 bits
    are the top 2 bits of bytes j and j+4.
    """
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # Q4_K (144 B): d f16 | dmin f16 | scales[12] | qs[128] nibbles
    # 8 sub-blocks of 32; each 32-byte chunk holds 2 sub-blocks (low nibbles, then high).
    # x = (d * sc) * q - (dmin * m)
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.float()).view(n, 8, 1)
    ml = (dmin * mn.float()).view(n, 8, 1)
    q = _bits(b[:, 16:144].reshape(n, 4, 32), [0, 4], 2, 0x0F).reshape(n, 8, 32).float()
    return q.mul_(dl).sub_(ml).view(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # Q5_K (176 B): d f16 | dmin f16 | scales[12] | qh[32] (5th bits) | qs[128] nibbles
    # Like Q4_K; bit j of qh byte i is the 5th bit of element 32*j + i.
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.float()).view(n, 8, 1)
    ml = (dmin * mn.float()).view(n, 8, 1)
    ql = _bits(b[:, 48:176].reshape(n, 4, 32), [0, 4], 2, 0x0F).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48], list(range(8)), 1, 0x01)
    q = (ql | (qh << 4)).float()
    return q.mul_(dl).sub_(ml).view(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # Q6_K (210 B): ql[128] low nibbles | qh[64] 2-bit highs | scales[16] int8 | d f16
    # Per 128-element half: ql 64 bytes (low nibbles = elements 0..63, high = 64..127),
    # qh 32 bytes (bit pair k = elements 32k..32k+31).  x = (d * sc) * (q - 32)
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    dl = (d * sc).view(n, 16, 1)
    lo = _bits(ql.reshape(n, 2, 64), [0, 4], 2, 0x0F).reshape(n, 8, 32)
    hi = _bits(qh.reshape(n, 2, 32), [0, 2, 4, 6], 2, 0x03).reshape(n, 8, 32)
    q = (lo | (hi << 4)).float().sub_(32).view(n, 16, 16)
    return q.mul_(dl).view(n, QK_K)


# ---------------------------------------------------------------------------------------------
# Microscaling.

_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    # MXFP4 (17 B): e e8m0 | qs[16] e2m1 nibbles (low = elements 0..15, high = 16..31).
    # x = 2^(e-128) * (2 * e2m1) (the e8m0 scale is halved because the values are doubled)
    e = b[:, 0:1].to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    table = torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=b.device)
    q = table[_nibbles(b[:, 1:]).long()]
    return q.mul_(d)


# ---------------------------------------------------------------------------------------------

_BLOCK_DECODERS = {
    T.BF16: _bf16,
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.MXFP4: _mxfp4,
}


def dequantize(data, qtype) -> torch.Tensor:
    """Decode ``data`` of GGML type ``qtype`` to a new float32 tensor.

    ``data``: a ``ReaderTensor.data`` array, or raw row bytes (numpy or torch uint8) of shape
    ``[..., bytes_per_row]``.  Returns shape ``data.shape[:-1] + (elements_per_row,)``; typed
    F32/F16 input keeps its shape.  Raises NotImplementedError for unsupported types.
    """
    try:
        qtype = T(qtype)
    except ValueError:
        raise NotImplementedError(f"unsupported GGML tensor type {qtype}") from None
    if qtype in (T.F32, T.F16):
        return _float(data, qtype)
    decode = _BLOCK_DECODERS.get(qtype)
    if decode is None:
        raise NotImplementedError(f"unsupported GGML tensor type {qtype.name}")

    raw = _u8(data)
    if raw.dtype != torch.uint8:
        raise TypeError(f"{qtype.name} data must be uint8 bytes, got {raw.dtype}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    lead, row_bytes = tuple(raw.shape[:-1]), raw.shape[-1]
    if row_bytes % type_size:
        raise ValueError(f"{qtype.name} row of {row_bytes} bytes is not a whole number of "
                         f"{type_size}-byte blocks")
    n_blocks = raw.numel() // type_size
    out = decode(raw.reshape(n_blocks, type_size))
    return out.reshape(*lead, row_bytes // type_size * block_size)
