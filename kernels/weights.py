"""Weight matrices in their storage format, behind one interface.

Model code never asks how a weight is stored. Every kind answers the same calls:

- `linear(x, out)`: `out = x W^T` for x [T, K] and a weight [N, K];
- `grouped(x, groups, out)`: rows a:b of x through weight g, for each (g, a, b), of a stack [G, N, K]
  (the tokens of each expert);
- `product(x)` and `slot_product(x, ids)`: `linear` into a new tensor, and row t*k+j = x[t] through weight
  ids[t, j] of a stack, as one custom op each (defined below; int8's in kernels/int8.py): tensors in and out,
  the expert ids left a tensor, so that torch.compile traces a decode step without host synchronisation;
- `rows(ids)`: embedding rows as float32;
- `w[a:b]`: a slice of the leading dimension (the experts an expert actor holds);
- `shape`, `nbytes`, `dequantize()`;
- `to(device)`: the same weight on another device. On a CUDA device the products run as the Triton
  kernels of kernels/triton (float32 activations: the exact mode; there is no 8-bit-activation path).

The kinds: `DenseWeight` (float32), `BlockWeight` (GGML blocks exactly as the file stores them:
F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, MXFP4; on a GPU, Q8_0 and MXFP4 rows are split into
quants and scales for aligned reads, kernels/triton/blocks.py), `Int8Weight` (int8 rows, kernels/int8.py),
and `ConcatWeight` (weights side by side, one product each into column slices of one output; two block
weights of one format, one product for both on the CPU). `cat_weights` fuses weights into one product when their
kinds and formats match.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import blocks, dense, native
from .dense import FEW_ROWS, dense_grouped
from .dequant import dequantize
from .grouping import empty_slots, per_slot, slot_products
from .ops import custom_op
# kernels/triton is imported inside the GPU paths, on first use: triton is optional where only the CPU runs

F32, F16, BF16, MXFP4 = 0, 1, 30, 39
UNQUANTISED = (F32, F16, BF16)
# the ggml types BlockWeight computes with (gguf numbering): F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
# Q4_K, Q5_K, Q6_K, BF16, MXFP4
BLOCK_TYPES = (1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30, 39)
# Up to this many rows, every block weight's product is the few-row kernel's one call (BlockWeight._few_rows)
DECODE_ROWS = 8


def rows_computed_alone(mode: str, device: str = "cpu") -> int:
    """Up to how many rows every product of a CPU decode step in `mode` computes each row by itself, in a
    fixed order, with the bits it gets alone: those of the compiled few-row kernels (blocks.c's, up to 8 rows
    a weight in the fast mode; few_rows.c's). So up to that many sequences may share a decode step without
    changing a bit of theirs. 0 where this host lacks a kernel that would be needed (BLAS and torch may sum a
    row otherwise in company), and on a GPU, whose decode steps are not checked for it."""
    if device == "cuda" or blocks.library() is None or native.few_rows() is None or \
            (mode == "int8" and native.int8_rows() is None):
        return 0
    return min(DECODE_ROWS, FEW_ROWS)


class DenseWeight:
    """A float32 tensor [..., N, K]."""

    def __init__(self, t: torch.Tensor):
        self.t = t if t.dtype == torch.float32 else t.float()

    shape = property(lambda self: self.t.shape)
    nbytes = property(lambda self: self.t.nbytes)

    def __getitem__(self, index) -> "DenseWeight":
        return DenseWeight(self.t[index])

    def to(self, device) -> "DenseWeight":
        return DenseWeight(self.t.to(device))

    def dequantize(self) -> torch.Tensor:
        return self.t

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.t)

    def linear(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return dense.dense_linear(x, self.t, out)

    def grouped(self, x: torch.Tensor, groups, out: torch.Tensor) -> torch.Tensor:
        return dense_grouped(x, self.t, groups, out)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear_op(x, self.t)

    def slot_product(self, x: torch.Tensor, ids: torch.Tensor, second: "DenseWeight | None" = None) -> torch.Tensor:
        return dense_slots_op(x, ids, self.t, None if second is None else second.t)

    def same_format(self, other) -> bool:
        return True

    @staticmethod
    def cat(parts: list["DenseWeight"], dim: int, loading: "Loading | None" = None) -> "DenseWeight":
        return DenseWeight(join_tensors([p.t for p in parts], dim, loading))


class BlockWeight:
    """GGML blocks: raw uint8 [..., N, bytes per row] holding rows of k values of `ggml_type`.

    quantize_activations: products quantise the activations to 8 bits per block and sum in
    integers (the fast mode, as llama.cpp); otherwise float32 activations meet the exactly
    dequantised weight values (the exact mode: many-row products dequantise tiles and multiply
    them in float32)."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, k: int, quantize_activations: bool, split: bool = False):
        self.raw, self.type, self.k, self.split = raw, int(ggml_type), k, split
        self._row = None        # the one-row product's call (blocks.RowProduct), made on first use
        self.quantize_activations = quantize_activations and self.type not in UNQUANTISED
        # the type the kernels take for these bytes: a split weight's (kernels/triton/blocks.py, GPU only) differs
        self.kernel_type = self.type
        if split:
            from .triton.blocks import SPLIT
            self.kernel_type += SPLIT

    shape = property(lambda self: torch.Size((*self.raw.shape[:-1], self.k)))
    nbytes = property(lambda self: self.raw.nbytes)

    def __getitem__(self, index) -> "BlockWeight":
        return BlockWeight(self.raw[index], self.type, self.k, self.quantize_activations, self.split)

    def to(self, device) -> "BlockWeight":
        """On a GPU, Q8_0 and MXFP4 rows take the split layout, which the GPU kernels read faster."""
        raw, split = self.raw, self.split
        if split and torch.device(device).type != "cuda":
            from .triton.blocks import join_blocks
            raw, split = join_blocks(raw, self.type, self.k), False
        raw = raw.to(device)
        if raw.is_cuda and not split:
            from .triton import blocks as gpu_blocks
            if gpu_blocks.splits(self.type):
                raw, split = gpu_blocks.split_blocks(raw, self.type, self.k), True
        return BlockWeight(raw, self.type, self.k, self.quantize_activations, split)

    def dequantize(self) -> torch.Tensor:
        flat = self.raw.reshape(-1, self.raw.shape[-1])
        return self._dequantize_rows(flat).reshape(self.shape)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._dequantize_rows(self.raw[ids])

    def _dequantize_rows(self, raw: torch.Tensor) -> torch.Tensor:
        if raw.is_cuda or self.split:         # split bytes: the Triton kernels only
            from .triton import blocks as gpu_blocks
            return gpu_blocks.dequantize_rows(raw.contiguous(), self.kernel_type, self.k)
        if blocks.library() is None:      # no compiler: torch's bit-exact decoders
            return dequantize(raw.contiguous(), self.type)
        return blocks.dequantize_rows(raw.contiguous(), self.type, self.k)

    def linear(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self._one_row(x, None, out) is not None:
            return out
        return self._product(x, self.raw, [(0, 0, x.shape[0])], out)

    def grouped(self, x: torch.Tensor, groups, out: torch.Tensor, second: "BlockWeight | None" = None) -> torch.Tensor:
        """second (CPU, with the compiled library): a weight of this format whose rows follow this one's in
        out's columns, in the same call (ConcatWeight's gate and up)."""
        return self._product(x, self.raw, groups, out, None if second is None else second.raw)

    def product(self, x: torch.Tensor, raw2: torch.Tensor | None = None) -> torch.Tensor:
        y = self._one_row(x, raw2)
        return y if y is not None else block_linear_op(x, self.raw, raw2, self.kernel_type, self.k,
                                                       self.quantize_activations)

    def _one_row(self, x: torch.Tensor, raw2: torch.Tensor | None, out: torch.Tensor | None = None):
        """An eager decode step's one-row product on the CPU (with raw2's rows after these: the same raw2 each
        time, ConcatWeight's pair) through blocks.RowProduct, made on first use; into out when given. None where
        that call does not take these (no compiled library, under torch.compile, other rows): the caller's way."""
        if x.shape[0] != 1 or not self.raw.is_cpu or torch.compiler.is_compiling():
            return None
        row = self._row
        if row is None or row.tensors[1] is not raw2:
            if blocks.library() is None or self.raw.shape[-2] + (0 if raw2 is None else raw2.shape[-2]) == 0:
                return None
            row = self._row = blocks.RowProduct(self.raw, self.type, self.k, self.quantize_activations, raw2)
        return row(x, out) if row.takes(x, out) else None

    def slot_product(self, x: torch.Tensor, ids: torch.Tensor, second: "BlockWeight | None" = None) -> torch.Tensor:
        return block_slots_op(x, ids, self.raw, None if second is None else second.raw, self.kernel_type, self.k,
                              self.quantize_activations)

    def _product(self, x, raw, groups, out, raw2=None):
        """raw: a stack [G, N, bytes], or one weight [N, bytes] (linear: no view made per call).
        raw2 (CPU, with the compiled library only): a second weight of this format, its rows after
        raw's in out's columns, multiplied in the same call (see ConcatWeight)."""
        if raw.is_cuda or self.split:
            from .triton import blocks as gpu_blocks
            return gpu_blocks.grouped_product(x if x.stride(-1) == 1 else x.contiguous(),
                                              raw if raw.dim() == 3 else raw[None], self.kernel_type, self.k,
                                              [g for g in groups if g[2] > g[1]], out)
        if blocks.library() is None:      # no compiler: dequantise one weight at a time
            for g, a, b in groups:
                w = raw[g] if raw.dim() == 3 else raw
                out[a:b] = F.linear(x[a:b], BlockWeight(w, self.type, self.k, False).dequantize())
            return out
        if x.stride(-1) != 1:
            x = x.contiguous()
        few_rows = self._few_rows()
        if all(b - a <= few_rows for _, a, b in groups):   # decode: one call, no lists to split
            blocks.grouped_product(x, raw, self.type, self.k, groups, out, self.quantize_activations, raw2)
            return out
        few = [g for g in groups if g[2] - g[1] <= few_rows]
        many = [g for g in groups if g[2] - g[1] > few_rows]
        if few:
            blocks.grouped_product(x, raw, self.type, self.k, few, out, self.quantize_activations, raw2)
        if many and self.quantize_activations:
            blocks.grouped_many_rows(x, raw, self.type, self.k, many, out, raw2)
        elif many:
            n = raw.shape[-2]
            for w, columns in ((raw, out[:, :n]), (raw2, out[:, n:])) if raw2 is not None else ((raw, out),):
                for g, a, b in many:
                    blocks.many_rows_product(x[a:b], w[g] if w.dim() == 3 else w, self.type, self.k, columns[a:b])
        return out

    def _few_rows(self) -> int:
        """Up to how many rows per weight the few-row kernel wins. Fast mode: measured here (1
        thread), integer products over unpacked tiles win from ~8-12 rows, MXFP4's from ~20 (its
        unpacking costs more than the others')."""
        if not self.quantize_activations:
            return FEW_ROWS
        return 16 if self.type == MXFP4 else 8

    def same_format(self, other: "BlockWeight") -> bool:
        return ((self.type, self.k, self.quantize_activations, self.split)
                == (other.type, other.k, other.quantize_activations, other.split))

    @staticmethod
    def cat(parts: list["BlockWeight"], dim: int, loading: "Loading | None" = None) -> "BlockWeight":
        first = parts[0]
        return BlockWeight(join_tensors([p.raw for p in parts], dim, loading), first.type, first.k,
                           first.quantize_activations, first.split)


class ConcatWeight:
    """Weights side by side along the output dimension (`dim` counts in the stacked weight's
    dimensions: 0 for [N, K], 1 for [E, N, K]); each runs its own product into its columns."""

    def __init__(self, parts: list, dim: int):
        self.parts, self.dim = parts, dim
        self.widths = [p.shape[dim] for p in parts]
        # two block weights of one format on the CPU (a GGUF file's gate and up experts): one product
        self.pair = (len(parts) == 2 and all(type(p) is BlockWeight for p in parts) and parts[0].same_format(parts[1])
                     and parts[0].raw.dim() == parts[1].raw.dim() and all(p.raw.is_cpu for p in parts))

    @property
    def shape(self) -> torch.Size:
        shape = list(self.parts[0].shape)
        shape[self.dim] = sum(self.widths)
        return torch.Size(shape)

    nbytes = property(lambda self: sum(p.nbytes for p in self.parts))

    def to(self, device) -> "ConcatWeight":
        return ConcatWeight([p.to(device) for p in self.parts], self.dim)

    def __getitem__(self, index) -> "ConcatWeight":
        return ConcatWeight([p[index] for p in self.parts], self.dim - (0 if isinstance(index, slice) else 1))

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts], self.dim)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.rows(ids) for p in self.parts], -1)

    def _columns(self, out: torch.Tensor):
        start = 0
        for part, width in zip(self.parts, self.widths):
            yield part, out[:, start:start + width]
            start += width

    def _one_call(self) -> bool:
        return self.pair and blocks.library() is not None

    def linear(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self._one_call():
            return self.grouped(x, [(0, 0, x.shape[0])], out)
        for part, columns in self._columns(out):
            part.linear(x, columns)
        return out

    def grouped(self, x: torch.Tensor, groups, out: torch.Tensor) -> torch.Tensor:
        if self._one_call():
            first, second = self.parts
            return first.grouped(x, groups, out, second)
        for part, columns in self._columns(out):
            part.grouped(x, groups, columns)
        return out

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.pair:       # one op; its CPU implementation takes the one-call path where the library is
            return self.parts[0].product(x, self.parts[1].raw)
        if not torch.compiler.is_compiling():   # eager: each part's product straight into its columns
            return self.linear(x, x.new_empty(x.shape[0], self.shape[-2]))
        return torch.cat([part.product(x) for part in self.parts], -1)

    def slot_product(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        parts = self.parts
        if len(parts) == 2 and type(parts[0]) in (DenseWeight, BlockWeight) and type(parts[1]) is type(parts[0]) \
                and parts[0].same_format(parts[1]):     # two expert stacks of one kind: one op, one plan of slots
            return parts[0].slot_product(x, ids, parts[1])
        return torch.cat([part.slot_product(x, ids) for part in self.parts], -1)


def as_weight(w):
    """A weight of one of the kinds above; a plain tensor becomes a DenseWeight."""
    return DenseWeight(w) if isinstance(w, torch.Tensor) else w


def cat_weights(weights: list, dim: int = 0, loading: "Loading | None" = None):
    """Weights joined along an output dimension (0 for [N, K], 1 for [E, N, K]): neighbours of the
    same kind and format fuse into one weight (one product); a ConcatWeight holds what is left.
    `loading`: reads may still be filling the weights' bytes (see Loading)."""
    runs: list[list] = []
    for w in weights:
        w = as_weight(w)
        for part in (w.parts if isinstance(w, ConcatWeight) else [w]):
            if runs and type(runs[-1][0]) is type(part) and runs[-1][0].same_format(part):
                runs[-1].append(part)
            else:
                runs.append([part])
    fused = [run[0] if len(run) == 1 else type(run[0]).cat(run, dim, loading) for run in runs]
    return fused[0] if len(fused) == 1 else ConcatWeight(fused, dim)


def join_tensors(tensors: list[torch.Tensor], dim: int, loading: "Loading | None" = None) -> torch.Tensor:
    """torch.cat(tensors, dim), now, or with `loading`, once the reads filling the tensors are done."""
    return torch.cat(tensors, dim) if loading is None else loading.join(tensors, dim)


class Loading:
    """One load's work still to finish: reads running in the background (stages/files/direct_io.py) and the joins
    of weights they fill. The load goes on reading meanwhile; `wait` finishes it all, in order."""

    def __init__(self):
        self._work: list = []           # each with result() -> bool: whether it succeeded

    def defer(self, work) -> None:
        """Work (a read's future) whose result() waits for it and says whether it succeeded."""
        self._work.append(work)

    def join(self, tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
        """torch.cat(tensors, dim) into the tensor returned, done by wait() after the reads before it."""
        shape = list(tensors[0].shape)
        shape[dim] = sum(t.shape[dim] for t in tensors)
        out = torch.empty(shape, dtype=tensors[0].dtype, device=tensors[0].device)
        self._work.append(_Join(out, tensors, dim))
        return out

    def wait(self) -> bool:
        """Finishes everything deferred so far; False if a read came short (the file ended first)."""
        complete = all([work.result() for work in self._work])
        self._work.clear()
        return complete


class _Join:
    """A join left for later, waited on like a read: result() fills `out` and says it succeeded."""

    def __init__(self, out: torch.Tensor, tensors: list[torch.Tensor], dim: int):
        self.out, self.tensors, self.dim = out, tensors, dim

    def result(self) -> bool:
        if self.tensors:
            torch.cat(self.tensors, self.dim, out=self.out)
            self.tensors = None         # the parts' memory goes now
        return True


# ---- the products as custom ops (kernels/ops.py) ---------------------------------------------------------

def _rows(raw: Tensor, raw2: Optional[Tensor]) -> int:
    return raw.shape[-2] + (0 if raw2 is None else raw2.shape[-2])


def _columns(raw: Tensor, raw2: Optional[Tensor], out: Tensor):
    """(weight, its columns of out) for raw and raw2."""
    n = raw.shape[-2]
    return [(raw, out[:, :n])] + ([] if raw2 is None else [(raw2, out[:, n:])])


def _block_weight(raw, raw2, ggml_type, k, quantize):
    w = BlockWeight(raw, ggml_type, k, quantize)
    return w if raw2 is None else ConcatWeight([w, BlockWeight(raw2, ggml_type, k, quantize)], raw.dim() - 2)


@custom_op("dense_linear")
def dense_linear_op(x: Tensor, w: Tensor) -> Tensor:
    """x [T, K] @ w [N, K]^T, float32."""
    return dense.dense_linear(x, w, x.new_empty(x.shape[0], w.shape[0]))


@dense_linear_op.register_kernel("cuda")
def _(x, w):
    return F.linear(x, w)       # cuBLAS (TF32 stays off for float32 products)


@dense_linear_op.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


@custom_op("dense_slots")
def dense_slots_op(x: Tensor, ids: Tensor, w: Tensor, w2: Optional[Tensor]) -> Tensor:
    """Row t*k+j = x[t] @ (w | w2)[ids[t, j]]^T: x [T, K], ids int64 [T, k], w [E, N, K] and optionally w2
    [E, N2, K] (a GGUF file's gate and up experts: one plan) -> [T*k, N + N2]."""
    weight = DenseWeight(w) if w2 is None else ConcatWeight([DenseWeight(w), DenseWeight(w2)], 1)
    return slot_products(weight, x, ids)


@dense_slots_op.register_kernel("cuda")
def _(x, ids, w, w2):
    experts, x = ids.reshape(-1), per_slot(x, ids)[:, :, None]
    out = torch.bmm(w[experts], x)[..., 0]
    return out if w2 is None else torch.cat((out, torch.bmm(w2[experts], x)[..., 0]), -1)


@dense_slots_op.register_fake
def _(x, ids, w, w2):
    return empty_slots(x, ids, _rows(w, w2))


@custom_op("block_linear")
def block_linear_op(x: Tensor, raw: Tensor, raw2: Optional[Tensor], ggml_type: int, k: int, quantize: bool) -> Tensor:
    """x [T, k] @ deq(raw [N, row bytes] | raw2 [N2, row bytes])^T -> [T, N + N2]. quantize: the fast mode
    (8-bit activations) where the format has one; otherwise exact float32."""
    if x.shape[0] <= DECODE_ROWS and blocks.library() is not None:     # BlockWeight's call, made straight
        out = x.new_empty(x.shape[0], _rows(raw, raw2))
        blocks.grouped_product(x if x.stride(-1) == 1 else x.contiguous(), raw, ggml_type, k, [(0, 0, x.shape[0])],
                               out, quantize, raw2)
        return out
    w = _block_weight(raw, raw2, ggml_type, k, quantize)
    return w.linear(x, x.new_empty(x.shape[0], w.shape[-2]))


@block_linear_op.register_kernel("cuda")
def _(x, raw, raw2, ggml_type, k, quantize):
    from .triton import blocks as gpu
    out, x = x.new_empty(x.shape[0], _rows(raw, raw2)), x if x.stride(-1) == 1 else x.contiguous()
    for w, columns in _columns(raw, raw2, out):
        gpu.linear(x, w, ggml_type, k, columns)
    return out


@block_linear_op.register_fake
def _(x, raw, raw2, ggml_type, k, quantize):
    return x.new_empty(x.shape[0], _rows(raw, raw2))


@custom_op("block_slots")
def block_slots_op(x: Tensor, ids: Tensor, raw: Tensor, raw2: Optional[Tensor], ggml_type: int, k: int,
                   quantize: bool) -> Tensor:
    """Row t*K+j = x[t] @ deq(expert ids[t, j] of raw [E, N, row bytes] | raw2 [E, N2, row bytes])^T:
    x [T, k], ids int64 [T, K] -> [T*K, N + N2]."""
    if (ids.shape[0] == 1 or ids.shape[1] == 1) and blocks.library() is not None:
        experts = ids.reshape(-1).tolist()
        if len(set(experts)) == len(experts):   # slot_products' groups of one slot each, x's rows read in place
            out = x.new_empty(len(experts), _rows(raw, raw2))
            blocks.slot_product(x if x.stride(-1) == 1 else x.contiguous(), raw, ggml_type, k, experts, out, quantize,
                                raw2)
            return out
    return slot_products(_block_weight(raw, raw2, ggml_type, k, quantize), x, ids)


@block_slots_op.register_kernel("cuda")
def _(x, ids, raw, raw2, ggml_type, k, quantize):
    from .triton import blocks as gpu
    out, x, experts = x.new_empty(ids.numel(), _rows(raw, raw2)), per_slot(x, ids).contiguous(), ids.reshape(-1)
    for w, columns in _columns(raw, raw2, out):
        gpu.slot_product(x, w, ggml_type, k, experts, columns)
    return out


@block_slots_op.register_fake
def _(x, ids, raw, raw2, ggml_type, k, quantize):
    return empty_slots(x, ids, _rows(raw, raw2))
