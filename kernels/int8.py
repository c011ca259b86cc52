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
from torch import Tensor

from .dense import FEW_ROWS, group_table
from .grouping import empty_slots, slot_products
from .native import int8_rows
from .ops import custom_op
from .weights import join_tensors

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

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[..., None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].float() * self.scale[ids][:, None]

    def linear(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if 0 < x.shape[0] <= FEW_ROWS and self._few_rows(x, [(0, 0, x.shape[0])], out, single=True):
            return out
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.q,
                                               self.scale.to(torch.bfloat16))
        return out.copy_(y)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear_op(x, self.q, self.scale)

    def slot_product(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return int8_slots_op(x, ids, self.q, self.scale)

    def grouped(self, x: torch.Tensor, groups: list[tuple[int, int, int]], out: torch.Tensor) -> torch.Tensor:
        few = [g for g in groups if g[2] - g[1] <= FEW_ROWS]
        if few and self._few_rows(x, few, out):
            groups = [g for g in groups if g[2] - g[1] > FEW_ROWS]
        for g, a, b in groups:
            self[g].linear(x[a:b], out[a:b])
        return out

    def _few_rows(self, x, groups, out, single: bool = False) -> bool:
        """kernels/csrc/few_rows.c's int8 kernel; False where that library or the layout can't."""
        lib = int8_rows()
        if lib is None or x.stride(-1) != 1 or out.stride(-1) != 1 or not self.q.is_contiguous():
            return False
        n, k = self.q.shape[-2:]
        if lib.raymoe_i8_grouped(x.data_ptr(), x.shape[0], x.stride(0), self.q.data_ptr(), self.scale.data_ptr(),
                                 0 if single else n * k, group_table(groups), len(groups), n, k, out.data_ptr(),
                                 out.stride(0)):
            raise MemoryError("int8 product: out of memory")
        return True

    def same_format(self, other) -> bool:
        return True

    @staticmethod
    def cat(parts: list["Int8Weight"], dim: int, loading=None) -> "Int8Weight":
        return Int8Weight(join_tensors([p.q for p in parts], dim, loading),
                          join_tensors([p.scale for p in parts], dim, loading))


def quantize_rows(w: torch.Tensor) -> Int8Weight | None:
    """Symmetric int8 per row of the last dimension; None when the kernel can't take w."""
    if w.dim() < 2 or w.shape[-1] % K_MULTIPLE:
        return None
    w = w.float()
    # the scale is rounded to bfloat16 first, so q is computed against the scale actually used
    scale = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16).float()
    q = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


# ---- the products as custom ops (kernels/ops.py): CPU only, int8 is a CPU mode ---------------------------

@custom_op("int8_linear")
def int8_linear_op(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x [T, K] @ (q [N, K] int8 * scale [N])^T."""
    return Int8Weight(q, scale).linear(x, x.new_empty(x.shape[0], q.shape[0]))


@int8_linear_op.register_fake
def _(x, q, scale):
    return x.new_empty(x.shape[0], q.shape[0])


@custom_op("int8_slots")
def int8_slots_op(x: Tensor, ids: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """kernels/weights.py's dense_slots for int8 rows: q [E, N, K], scale [E, N]."""
    return slot_products(Int8Weight(q, scale), x, ids)


@int8_slots_op.register_fake
def _(x, ids, q, scale):
    return empty_slots(x, ids, q.shape[-2])
