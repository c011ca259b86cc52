"""Matrix products computed straight from GGML quantised blocks (kernels/csrc/blocks.c): the
weights stay in the bytes the GGUF file stores and are unpacked in cache, row by row.

    dequantize_rows     raw rows -> float32, bit for bit as gguf-py's dequantize
    grouped_product     few activation rows per weight (decode; experts' groups of tokens), in
                        exact mode (float32) or fast mode (int8 activations, as llama.cpp)
    grouped_many_rows   many activation rows per weight (prefill) in fast mode: int8 activations
                        times tiles of unpacked weight rows, summed in integers
    many_rows_product   many activation rows in exact mode: tiles of dequantised rows times sgemm
    slot_product        grouped_product for a decode step's (token, expert) slots, one row each
    moe_combine         the routed slots' weighted sum plus the gated shared expert (moe.moe_combine_op)
    moe_token           one token's MoE layer after its router, in one call (moe.moe_token_op): the
                        experts' gate/up products, their activation, down products and that sum

The library is built by kernels/native.py's machinery for this machine's CPU (AVX-512 VNNI and
VBMI, AVX2 or portable C), or for $RAYMOE_MARCH. Where the CPU and kernel allow AMX (and not
RAYMOE_AMX=0), many-row groups of 32 rows or more multiply on AMX int8 tiles, with the same bits
as the VNNI kernels. Results depend neither on the thread count nor on the other rows in a call.
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from raymoe.kernels import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "blocks.c"
# The dequantisation must round as gguf-py's numpy code: no fused multiply-adds. Without traps on floating
# point exceptions (which nothing here sets), the MoE activation's loops vectorise.
EXTRA_FLAGS = ("-ffp-contract=off", "-fno-trapping-math")

TYPES = (T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
         T.BF16, T.MXFP4)
_SIZES = {int(t): GGML_QUANT_SIZES[t] for t in TYPES}  # elements, bytes per block


@lru_cache(maxsize=None)
def load(arch: str | None = None) -> ctypes.CDLL | None:
    """The library built for -march=arch (default native.march()), or None where it can't be
    built or loaded here (the reason is logged once)."""
    lib = native.load_source(SOURCE, arch, EXTRA_FLAGS, fallback="no block kernels")
    if lib is None:
        return None
    p, i, c = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.raymoe_blocks_arch.restype = c
    lib.raymoe_blocks_dequantize.argtypes = [c, p, i, i, p]
    lib.raymoe_blocks_dequantize.restype = None
    lib.raymoe_blocks_grouped.argtypes = [c, c, p, i, i, p, i, p, i, i, p, i, i, i, p, i]
    lib.raymoe_blocks_grouped.restype = c
    lib.raymoe_blocks_grouped_many.argtypes = [c, p, i, i, p, i, p, i, i, p, i, i, i, p, i]
    lib.raymoe_blocks_grouped_many.restype = c
    lib.raymoe_blocks_many_rows.argtypes = [p, c, p, i, i, p, i, i, p, i]
    lib.raymoe_blocks_many_rows.restype = c
    lib.raymoe_blocks_set_amx.argtypes = [c]
    lib.raymoe_blocks_set_amx.restype = c
    lib.raymoe_blocks_amx_min_rows.restype = c
    lib.raymoe_blocks_set_transposed.argtypes = [c]
    lib.raymoe_blocks_set_transposed.restype = c
    lib.raymoe_moe_combine.argtypes = [i, i, i, p, p, p, i, p, p]
    lib.raymoe_moe_combine.restype = None
    f, wp = ctypes.c_float, ctypes.POINTER(MoEWeight)
    lib.raymoe_moe_token.argtypes = [p, i, i, p, p, wp, i, wp, c, c, f, f, p, i, wp, p, p, p]
    lib.raymoe_moe_token.restype = c
    lib.raymoe_moe_activation.argtypes = [c, c, f, f, p, i, i, p]
    lib.raymoe_moe_activation.restype = None
    lib.sgemm = native._numpy_sgemm()
    _start_amx(lib)
    return lib


def _start_amx(lib: ctypes.CDLL) -> None:
    """Many-row products on AMX tiles where this build, the CPU and the kernel allow it, unless
    RAYMOE_AMX=0; otherwise (said once) on AVX-512 VNNI registers, with the same results."""
    want = os.environ.get("RAYMOE_AMX", "1") != "0"
    if lib.raymoe_blocks_set_amx(int(want)):
        log.info("many-row products use AMX tiles")
    elif want and lib.raymoe_blocks_arch() == 2 and "amx_int8" in native._cpu_flags():
        log.warning("this CPU has AMX but it could not be used (compiler or kernel): many-row products use VNNI")


def set_amx(on: bool) -> bool:
    """Many-row products on AMX tiles (on) or VNNI registers: the same bits either way (tests and
    benchmarks compare them). Returns whether AMX is in use now."""
    return bool(_lib().raymoe_blocks_set_amx(int(on)))


def library() -> ctypes.CDLL | None:
    """The library for this machine (built on first use), or None (no compiler, RAYMOE_NATIVE=0)."""
    return load()


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("the block kernels are unavailable here (see the log)")
    return lib


def supported(ggml_type: int) -> bool:
    return int(ggml_type) in _SIZES


def _sizes(ggml_type: int) -> tuple[int, int]:
    if not supported(ggml_type):
        raise ValueError(f"unsupported GGML type {ggml_type}")
    return _SIZES[int(ggml_type)]


@lru_cache(maxsize=None)
def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of k elements."""
    elems, size = _sizes(ggml_type)
    if k <= 0 or k % elems:
        raise ValueError(f"{T(ggml_type).name} rows need a positive multiple of {elems} elements, got {k}")
    return k // elems * size


def check_raw(raw: torch.Tensor, dims: int, expected_row_bytes: int, what) -> None:
    """raw is a contiguous `dims`-d uint8 tensor of rows of `expected_row_bytes`; `what` names their format (or
    makes that name: called only on failure, since this check runs several times per decode product)."""
    if raw.dtype != torch.uint8 or raw.dim() != dims or not raw.is_contiguous():
        raise ValueError(f"raw must be a contiguous {dims}-d uint8 tensor, got {raw.dtype} {tuple(raw.shape)}")
    if raw.shape[-1] != expected_row_bytes:
        raise ValueError(f"raw rows of {raw.shape[-1]} bytes, expected {expected_row_bytes} for "
                         f"{what() if callable(what) else what}")


def _check_raw(raw: torch.Tensor, ggml_type: int, k: int, dims: int) -> None:
    check_raw(raw, dims, row_bytes(ggml_type, k), lambda: f"{T(ggml_type).name} with k={k}")


def _rows_fit(t: torch.Tensor, rows: int | None, cols: int) -> bool:
    """t is a float32 CPU matrix [rows (any, for None), cols] whose last dimension is contiguous (any row stride)."""
    # each attribute read once: these checks run on every decode product (a few µs per call counts)
    shape, stride = t.shape, t.stride()
    return not (t.dtype != torch.float32 or not t.is_cpu or len(shape) != 2 or shape[1] != cols
                or (rows is not None and shape[0] != rows) or (cols > 1 and stride[1] != 1) or stride[0] < 1)


def _check_rows(t: torch.Tensor, name: str, rows: int | None, cols: int) -> None:
    """_rows_fit, or a ValueError naming t."""
    if not _rows_fit(t, rows, cols):
        raise ValueError(f"{name} must be float32 [{rows if rows is not None else 'M'}, {cols}] with a "
                         f"contiguous last dimension, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


def dequantize_rows(raw: torch.Tensor, ggml_type: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """raw uint8 [N, row_bytes] -> float32 [N, k], bit-exact against gguf.quants.dequantize."""
    _check_raw(raw, ggml_type, k, 2)
    n = raw.shape[0]
    if out is None:
        out = torch.empty(n, k, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (n, k) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [{n}, {k}], got {out.dtype} {tuple(out.shape)}")
    if n:
        _lib().raymoe_blocks_dequantize(int(ggml_type), raw.data_ptr(), n, k, out.data_ptr())
    return out


def _status(code: int) -> None:
    if code:
        raise MemoryError("the block kernels could not allocate their buffers")


def grouped_product(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, groups: list[tuple[int, int, int]],
                    out: torch.Tensor, quantize_activations: bool, raw2: torch.Tensor | None = None) -> None:
    """For each (g, a, b) in groups: out[a:b] = x[a:b] @ deq(raw[g]).T.

    x float32 [M, k], raw uint8 [G, N, row_bytes] (or [N, row_bytes]: one weight, g = 0), out
    float32 [M, N] (last dimensions contiguous). quantize_activations: the fast mode (activations as int8 blocks, integer dot
    products); otherwise float32 activations times the exact weights. Float weights are always
    multiplied exactly. raw2: a second weight (stack) of the same type whose rows follow raw's,
    as if joined: out [M, N + N2] (one call, the activations quantised once)."""
    groups = _check_groups(x, raw, ggml_type, k, groups, out, raw2)
    if not groups:
        return
    _status(_lib().raymoe_blocks_grouped(int(ggml_type), 1 if quantize_activations else 0, x.data_ptr(), x.shape[0],
                                         x.stride(0), raw.data_ptr(), raw.stride(0), *_second(raw2, raw),
                                         _table(groups), len(groups), out.shape[1], k, out.data_ptr(), out.stride(0)))


class RowProduct:
    """grouped_product's call for one activation row through raw (| raw2's rows after raw's), its weight
    arguments checked and converted once: a decode step makes hundreds of these products, and per call the
    checks and conversions cost about what a small product's work does. Call it with x [1, k] float32 whose
    last dimension is contiguous (`takes`), and out [1, N + N2] likewise (or None: a new one): the same call,
    so the same bits."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, k: int, quantize_activations: bool,
                 raw2: torch.Tensor | None = None):
        self.k, self.n = k, raw.shape[-2] + (0 if raw2 is None else raw2.shape[-2])
        _check_groups(torch.empty(1, k), raw, ggml_type, k, [(0, 0, 1)], torch.empty(1, self.n), raw2)
        self.head = (int(ggml_type), 1 if quantize_activations else 0)
        self.weight = (raw.data_ptr(), raw.stride(0), *_second(raw2, raw), _one_group(0, 0, 1), 1, self.n, k)
        self.tensors = (raw, raw2)          # the bytes the pointers above point into stay alive
        self.call = _lib().raymoe_blocks_grouped

    def takes(self, x: torch.Tensor, out: torch.Tensor | None = None) -> bool:
        """Whether x and out (when given) are what grouped_product's checks would pass for this call."""
        return _rows_fit(x, 1, self.k) and (out is None or _rows_fit(out, 1, self.n))

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = x.new_empty(1, self.n)
        _status(self.call(*self.head, x.data_ptr(), 1, x.stride(0), *self.weight, out.data_ptr(), out.stride(0)))
        return out


def slot_product(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, experts: list[int], out: torch.Tensor,
                 quantize_activations: bool, raw2: torch.Tensor | None = None) -> None:
    """out[s] = x_s @ deq(raw[experts[s]] | raw2[experts[s]]).T for each slot s: a decode step's (token,
    expert) slots, each a group of one row, as grouped_product computes them (the same call, the same
    bits) at a fraction of its cost per call. x [1, k] is every slot's row, read in place (no copy per
    slot); x [len(experts), k] gives one row per slot. raw [E, N, row_bytes]; raw2 as grouped_product's."""
    _check_raw(raw, ggml_type, k, 3)
    count, n = raw.shape[0], raw.shape[1]
    if raw2 is not None:
        _check_raw(raw2, ggml_type, k, 3)
        if raw2.shape[0] != count:
            raise ValueError(f"raw2 holds {raw2.shape[0]} weights, raw {count}")
        n += raw2.shape[1]
    slots = len(experts)
    _check_rows(x, "x", None, k)
    if x.shape[0] not in (1, slots):
        raise ValueError(f"x has {x.shape[0]} rows for {slots} slots (1, or one per slot)")
    _check_rows(out, "out", slots, n)
    if not slots or not n:
        return
    if min(experts) < 0 or max(experts) >= count:
        raise ValueError(f"expert ids {experts} out of range for {count} weights")
    table = _table([(e, s, s + 1) for s, e in enumerate(experts)])
    _status(_lib().raymoe_blocks_grouped(int(ggml_type), 1 if quantize_activations else 0, x.data_ptr(), slots,
                                         0 if x.shape[0] == 1 else x.stride(0), raw.data_ptr(), raw.stride(0),
                                         *_second(raw2, raw), table, slots, n, k, out.data_ptr(), out.stride(0)))


def moe_combine(lib: ctypes.CDLL, rows: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor | None,
                shared: torch.Tensor | None, out: torch.Tensor) -> None:
    """kernels.moe.moe_combine_op's CPU call: rows [T*k, H], weights [T, k], shared and out [T, H] contiguous float32;
    gate [T, 1] (any row stride) with shared, or neither."""
    T, k = weights.shape
    h = rows.shape[-1]
    _check_rows(rows, "rows", T * k, h)
    _check_rows(out, "out", T, h)
    if weights.dtype != torch.float32 or not all(t is None or t.is_contiguous() for t in (rows, weights, shared, out)):
        raise ValueError("moe_combine takes float32 weights and contiguous rows, weights, shared and out")
    if (gate is None) != (shared is None):
        raise ValueError("the shared expert's gate and output come together")
    if gate is not None:
        _check_rows(shared, "shared", T, h)
        if gate.dtype != torch.float32 or gate.shape != (T, 1):
            raise ValueError(f"gate must be float32 [{T}, 1], got {gate.dtype} {tuple(gate.shape)}")
    lib.raymoe_moe_combine(T, k, h, rows.data_ptr(), weights.data_ptr(), None if gate is None else gate.data_ptr(),
                           0 if gate is None else gate.stride(0), None if shared is None else shared.data_ptr(),
                           out.data_ptr())


class MoEWeight(ctypes.Structure):
    """blocks.c's moe_weight: a stack of experts (or one matrix) of GGML blocks, and its bias."""
    _fields_ = [("type", ctypes.c_int), ("quantize", ctypes.c_int), ("raw", ctypes.c_void_p),
                ("raw2", ctypes.c_void_p), ("stride", ctypes.c_int64), ("stride2", ctypes.c_int64),
                ("n1", ctypes.c_int64), ("bias", ctypes.c_void_p)]


def _moe_weight(raw: torch.Tensor, raw2: torch.Tensor | None, ggml_type: int, k: int, quantize: bool,
                bias: torch.Tensor | None, dims: int) -> tuple[MoEWeight, int]:
    """The library's description of a weight ([E,] N, row bytes; raw2's rows after raw's) and its rows."""
    _check_raw(raw, ggml_type, k, dims)
    rows = raw.shape[-2]
    if raw2 is not None:
        _check_raw(raw2, ggml_type, k, dims)
        if raw2.shape[:-2] != raw.shape[:-2]:
            raise ValueError(f"raw2 holds {tuple(raw2.shape[:-2])} weights, raw {tuple(raw.shape[:-2])}")
        rows += raw2.shape[-2]
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (*raw.shape[:-2], rows)
                             or not bias.is_contiguous()):
        raise ValueError(f"a bias must be contiguous float32 {[*raw.shape[:-2], rows]}, got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    return MoEWeight(int(ggml_type), int(quantize), raw.data_ptr(), None if raw2 is None else raw2.data_ptr(),
                     raw.stride(0) if dims == 3 else 0, 0 if raw2 is None or dims == 2 else raw2.stride(0),
                     raw.shape[-2], None if bias is None else bias.data_ptr()), rows


def moe_token(x: torch.Tensor, experts: list[int], weights: torch.Tensor, gate_up: tuple, down: tuple,
              activation: tuple[int, int, float, float], shared_gate_up: torch.Tensor | None,
              shared_down: tuple | None, gate: torch.Tensor | None) -> torch.Tensor:
    """kernels.moe.moe_token_op's CPU call (see there): one token's k slots, k <= 64. gate_up: (raw [E, F, bytes], raw2
    [E, F, bytes] or None, type, quantize, bias [E, 2F] or None); down: (raw [E, H, bytes], type, quantize,
    bias [E, H] or None); activation: (kind, exp kind, alpha, limit) as blocks.c's raymoe_moe_activation takes them;
    shared_down: (raw [H, bytes], type, quantize) with shared_gate_up [1, 2S] and gate [1, 1], or all None."""
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("the shared expert's gate/up, weight and gate come together")
    sff = 0 if shared_gate_up is None else shared_gate_up.shape[-1] // 2
    return TokenMoE(x.shape[-1], gate_up, down, activation, shared_down, sff)(x, experts, weights, shared_gate_up,
                                                                              gate)


class TokenMoE:
    """moe_token with its weights checked and described once (a decode step makes one call per MoE layer, and
    building the descriptions cost about a tenth of the call): h, the hidden size; sff, the shared expert's
    width (0 without one); the other arguments as moe_token's. Call it with (x, experts, weights,
    shared_gate_up, gate) as moe_token takes them."""

    def __init__(self, h: int, gate_up: tuple, down: tuple, activation: tuple[int, int, float, float],
                 shared_down: tuple | None, sff: int):
        raw, raw2, gate_up_type, gate_up_quantize, gate_up_bias = gate_up
        self.gate_up, rows = _moe_weight(raw, raw2, gate_up_type, h, gate_up_quantize, gate_up_bias, 3)
        self.h, self.ff, self.sff, self.experts = h, rows // 2, sff, raw.shape[0]
        if rows % 2 or not self.ff:
            raise ValueError(f"gate/up has {rows} rows, not two halves")
        down_raw, down_type, down_quantize, down_bias = down
        self.down, down_rows = _moe_weight(down_raw, None, down_type, self.ff, down_quantize, down_bias, 3)
        if down_rows != h or down_raw.shape[0] != raw.shape[0]:
            raise ValueError(f"down holds {down_raw.shape[0]} experts of {down_rows} rows for {raw.shape[0]} of {h}")
        self.shared = None
        if shared_down is not None:
            shared_raw, shared_type, shared_quantize = shared_down
            self.shared, shared_rows = _moe_weight(shared_raw, None, shared_type, sff, shared_quantize, None, 2)
            if shared_rows != h:
                raise ValueError(f"the shared expert's down has {shared_rows} rows for {h}")
        self.activation = activation
        self.tensors = (gate_up, down, shared_down)     # the bytes the descriptions point into stay alive

    def __call__(self, x: torch.Tensor, experts: list[int], weights: torch.Tensor,
                 shared_gate_up: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
        h, k, ff, sff = self.h, len(experts), self.ff, self.sff
        _check_rows(x, "x", 1, h)
        if not 0 < k <= 64 or weights.shape != (1, k) or weights.dtype != torch.float32:
            raise ValueError(f"moe_token takes one token's 1-64 slots, got {k} experts, weights {tuple(weights.shape)}")
        if min(experts) < 0 or max(experts) >= self.experts:
            raise ValueError(f"expert ids {experts} out of range for {self.experts} weights")
        if (shared_gate_up is None) != (self.shared is None) or (shared_gate_up is None) != (gate is None):
            raise ValueError("the shared expert's gate/up, weight and gate come together")
        if shared_gate_up is not None:
            _check_rows(shared_gate_up, "shared_gate_up", 1, 2 * sff)
            if gate.dtype != torch.float32 or gate.numel() != 1:
                raise ValueError(f"the shared expert's gate must be one float32 value, got {tuple(gate.shape)}")
        table, weights = (ctypes.c_int64 * k)(*experts), weights.contiguous()
        scratch, out = x.new_empty(k * (3 * ff + h) + sff + h), x.new_empty(1, h)
        _status(_lib().raymoe_moe_token(x.data_ptr(), h, k, table, weights.data_ptr(), ctypes.byref(self.gate_up), ff,
                                        ctypes.byref(self.down), *self.activation,
                                        None if shared_gate_up is None else shared_gate_up.data_ptr(), sff,
                                        None if self.shared is None else ctypes.byref(self.shared),
                                        None if gate is None else gate.data_ptr(), scratch.data_ptr(), out.data_ptr()))
        return out


def activation_exp(activation, kind: int, alpha: float, limit: float) -> int | None:
    """Which exp (1: vector_expf, 0: the C library's) gives the library's MoE activation (kind, alpha, limit:
    blocks.c's raymoe_moe_activation) the bits of torch's `activation` (kernels.moe.activation_code gives its
    code) here, or None when neither does: the library's exp is SLEEF's, which torch's vectorised kernels use,
    and the check is against whatever this torch build computes. Rows of 64 values (a multiple of every vector
    length, so torch takes its vector formula throughout)."""
    lib = library()
    return None if lib is None else _activation_exp(lib, activation, kind, alpha, limit)


@lru_cache(maxsize=None)
def _activation_exp(lib: ctypes.CDLL, activation, kind: int, alpha: float, limit: float) -> int | None:
    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(8192, generator=g) * scale for scale in (1, 4, 30, 120)] +
                       [torch.tensor([0.0, -0.0, 1e-40, -1e-40, 87.5, -87.5, 88.7, -88.7, 103.9, -103.9, 104.1,
                                      -104.1, 150.0, -150.0, float("inf"), float("-inf"), float("nan")] * 8)])
    values = values[:values.numel() // 64 * 64].view(-1, 64)
    gate_up = torch.cat([values, values.flip(0)], 1)
    want = activation(gate_up)
    for exp_kind in (1, 0):
        got = torch.empty_like(want)
        lib.raymoe_moe_activation(kind, exp_kind, alpha, limit, gate_up.data_ptr(), got.shape[0], 64, got.data_ptr())
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())   # NaNs: any bits
        if bool(same.all()):
            return exp_kind
    log.info("the MoE activation in C does not give this torch's bits: a decode step's MoE takes separate calls")
    return None


def _second(raw2: torch.Tensor | None, raw: torch.Tensor) -> tuple[int | None, int, int]:
    """The library's (raw2, its stride, rows taken from raw) arguments."""
    return (None, 0, raw.shape[-2]) if raw2 is None else (raw2.data_ptr(), raw2.stride(0), raw.shape[-2])


def _table(groups: list[tuple[int, int, int]]):
    """(g, a, b) triples as the flat int64 array the library takes (a ctypes array: a tenth of
    torch.tensor's cost per call; one group's, as a decode product's, made once: the library only reads it)."""
    if len(groups) == 1:
        return _one_group(*groups[0])
    return (ctypes.c_int64 * (3 * len(groups)))(*(v for group in groups for v in group))


@lru_cache(maxsize=4096)
def _one_group(g: int, a: int, b: int):
    return (ctypes.c_int64 * 3)(g, a, b)


def _check_groups(x, raw, ggml_type, k, groups, out, raw2=None) -> list[tuple[int, int, int]]:
    """The non-empty groups, after checking every argument. raw [G, N, row_bytes], or [N, row_bytes]
    for one weight; raw2 (optional) the same with N2 rows."""
    _check_raw(raw, ggml_type, k, 2 if raw.dim() == 2 else 3)
    _check_rows(x, "x", None, k)
    g_count, n = (raw.shape[0] if raw.dim() == 3 else 1), raw.shape[-2]
    if raw2 is not None:
        _check_raw(raw2, ggml_type, k, raw.dim())
        if raw.dim() == 3 and raw2.shape[0] != g_count:
            raise ValueError(f"raw2 holds {raw2.shape[0]} weights, raw {g_count}")
        n += raw2.shape[-2]
    m = x.shape[0]
    _check_rows(out, "out", m, n)
    kept = []
    for g, a, b in groups:
        if not (0 <= g < g_count and 0 <= a <= b <= m):
            raise ValueError(f"group {(g, a, b)} out of range for {g_count} weights and {m} rows")
        if b > a:
            kept.append((g, a, b))
    return kept if n else []


def grouped_many_rows(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, groups: list[tuple[int, int, int]],
                      out: torch.Tensor, raw2: torch.Tensor | None = None) -> None:
    """grouped_product's fast mode for groups of many rows (prefill), quantised types only:
    activations as int8 blocks (Q8_K for K-quants, Q8_0 otherwise), integer dot products against
    tiles of weight rows unpacked in cache. raw2: as grouped_product's."""
    if int(ggml_type) in (T.F32, T.F16, T.BF16):
        raise ValueError(f"{T(ggml_type).name} weights have no fast mode")
    groups = _check_groups(x, raw, ggml_type, k, groups, out, raw2)
    if not groups:
        return
    _status(_lib().raymoe_blocks_grouped_many(int(ggml_type), x.data_ptr(), x.shape[0], x.stride(0), raw.data_ptr(),
                                              raw.stride(0), *_second(raw2, raw), _table(groups), len(groups),
                                              out.shape[1], k, out.data_ptr(), out.stride(0)))


def many_rows_product(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, out: torch.Tensor) -> None:
    """out = x @ deq(raw).T for many rows of x (prefill), exact float32: x [M, k], raw uint8
    [N, row_bytes], out [M, N] (last dimensions contiguous)."""
    _check_raw(raw, ggml_type, k, 2)
    _check_rows(x, "x", None, k)
    m, n = x.shape[0], raw.shape[0]
    _check_rows(out, "out", m, n)
    if m == 0 or n == 0:
        return
    lib = _lib()
    _status(lib.raymoe_blocks_many_rows(lib.sgemm, int(ggml_type), x.data_ptr(), m, x.stride(0), raw.data_ptr(),
                                        n, k, out.data_ptr(), out.stride(0)))


def benchmark(megabytes: int = 1024, threads: int = 2, repeats: int = 5) -> dict[str, float]:
    """GB/s of weight bytes streamed by a 1-row fast product over a weight of about `megabytes`
    MB per type (Q8_0, MXFP4, Q3_K, Q4_K, Q6_K), and by numpy's float32 matrix-vector product, best of
    `repeats`; printed and returned. A weight of 256 MB or less gave rates past the memory's on a 2-core
    EPYC VM with 32 MB of L3 (Q6_K 46 GB/s where 1 GB gave 30): measure from memory with 1 GB."""
    torch.set_num_threads(threads)
    k = 4096
    results = {}
    for t in (T.Q8_0, T.MXFP4, T.Q3_K, T.Q4_K, T.Q6_K):
        n = megabytes * 2**20 // row_bytes(t, k)
        raw = _random_weight(t, n, k)
        x, out = torch.randn(1, k), torch.empty(1, n)
        results[t.name] = raw.numel() / _best(lambda: grouped_product(x, raw, t, k, [(0, 0, 1)], out, True), repeats)
        raw = raw[0]
        results[t.name + " exact"] = raw.numel() / _best(
            lambda: grouped_product(x, raw[None], t, k, [(0, 0, 1)], out, False), repeats)
    w = np.random.default_rng(0).standard_normal((megabytes * 2**20 // (4 * k), k), dtype=np.float32)
    v = np.random.default_rng(1).standard_normal((1, k), dtype=np.float32)
    results["numpy float32"] = w.nbytes / _best(lambda: v @ w.T, repeats)
    for name, rate in results.items():
        print(f"{name:>16}: {rate / 1e9:6.1f} GB/s")
    return results


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _random_weight(t: T, n: int, k: int) -> torch.Tensor:
    """[1, n, row_bytes] random blocks of type t with small finite scales (for benchmarks)."""
    elems, size = _SIZES[int(t)]
    raw = torch.randint(0, 256, (n * k // elems, size), dtype=torch.uint8)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    offsets = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q2_K: (80, 82),
               T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}.get(t, ())
    for o in offsets:
        raw[:, o:o + 2] = scale
    if t == T.MXFP4:
        raw[:, 0] = 120
    return raw.view(1, n, -1)


if __name__ == "__main__":
    benchmark()
