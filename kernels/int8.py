"""Weights kept as int8 with one scale per output row (`--dtype int8`).

Every weight matrix is quantised at load to int8 with a scale per row (a bfloat16 value, held
as float32), about a quarter of float32's bytes; a quantised file's blocks (Q8_0, Q4_K,
MXFP4, ...) are dequantised exactly first, then requantised per row. Everything else runs in
float32. Products of a few rows (decode) go to kernels/csrc/few_rows.c (see kernels/linear.py),
which quantises the activations to int8 in blocks of 32 as llama.cpp does for Q8_0 and sums in
int32 (AVX-512 VNNI). Longer ones (prefill), and all of them where that library can't be built,
go through PyTorch's `_weight_int8pack_mm` here, which rounds its input to bfloat16. That kernel needs
the inner dimension to be a multiple of 16 (others give wrong results); other weights are not
quantised.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

K_MULTIPLE = 16


@dataclass
class Int8Weight:
    """q int8 [..., N, K] and scale float32 [..., N] (bfloat16 values): the weight is q * scale[..., None]."""
    q: torch.Tensor
    scale: torch.Tensor

    def __getitem__(self, index) -> "Int8Weight":
        return Int8Weight(self.q[index], self.scale[index])

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def clone(self) -> "Int8Weight":
        return Int8Weight(self.q.clone(), self.scale.clone())


def quantize_rows(w: torch.Tensor) -> Int8Weight | None:
    """Symmetric int8 per row of the last dimension; None when the kernel can't take w."""
    if w.dim() < 2 or w.shape[-1] % K_MULTIPLE:
        return None
    w = w.float()
    # the scale is rounded to bfloat16 first, so q is computed against the scale actually used
    scale = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16).float()
    q = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (rounded to bfloat16 for the kernel) times w -> [T, N] in x's dtype, or into `out`."""
    y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), w.q, w.scale.to(torch.bfloat16))
    y = y.to(x.dtype) if out is None else out.copy_(y)
    return y if bias is None else y.add_(bias)


def cat_weights(weights: list, dim: int = 0):
    """torch.cat (along a dimension other than the last) for weights that may be Int8Weight; float
    ones joining them are quantised too (they share the inner size, so the kernel takes them)."""
    if not any(isinstance(w, Int8Weight) for w in weights):
        return torch.cat(weights, dim)
    parts = [w if isinstance(w, Int8Weight) else quantize_rows(w) for w in weights]
    return Int8Weight(torch.cat([p.q for p in parts], dim), torch.cat([p.scale for p in parts], dim))


def lookup_rows(table, ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows of a float or Int8Weight table, as float32 for an Int8Weight."""
    if isinstance(table, Int8Weight):
        return table.q[ids].float() * table.scale[ids].float()[:, None]
    return torch.nn.functional.embedding(ids, table)
