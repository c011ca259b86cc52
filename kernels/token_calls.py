"""A decode step's layer in two C calls (kernels/csrc/blocks.c), for up to MAX_ROWS sequences: its mixer
(`x + mixer(rms_norm(x))`: Gated DeltaNet or attention) and its feed-forward (`h + moe(rms_norm(h))`).

A decode step on the CPU runs each layer as a dozen small calls from Python: RMSNorm, products, a split, the
routing's torch operations, the experts' plan, the residual sums. Each product streams megabytes through the
caches, so each Python call after it starts cold; together they took about a tenth of a full-size
Qwen3.5-35B-A3B step at one sequence and a fifth at four. Here the same calls are made from C, with the same
arguments: the bits are those of the separate calls. The functions of the other libraries (norms.c's RMSNorm,
few_rows.c's float32 rows, deltanet.c's decode step, rope.c, attention.c) come as pointers; the routing is done
in C the way torch computes it (route_lanes checks that it gives this torch's bits here, else the layer keeps its
separate calls), and tied router scores, which torch.topk orders its own way, hand the step back to them.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from functools import lru_cache

import torch

from . import attention, blocks, deltanet, native, norms, rope
from .blocks import MoEWeight, TokenMoE
from .moe import torch_route
from .pointwise import sigmoid
from .weights import BlockWeight, ConcatWeight, DenseWeight

log = logging.getLogger(__name__)

# (softmax first, renormalise) as kernels.moe.torch_route takes them -> raymoe_route's kind
ROUTES = {(True, True): 0, (True, False): 1, (False, False): 2}
MAX_EXPERTS, MAX_USED = 1024, 64        # what the library's routing takes
TIES = 1                                # raymoe_route's and raymoe_token_ffn's status for tied router scores
MAX_ROWS, MAX_SLOTS = 8, 64             # the most tokens a call takes (blocks.c's TOKEN_ROWS), and a feed-forward's
                                        # tokens times experts each


class RowWeight(ctypes.Structure):
    """blocks.c's row_weight: a weight of a one-row product, float32 rows or GGML blocks."""
    _fields_ = [("blocks", ctypes.c_int), ("type", ctypes.c_int), ("quantize", ctypes.c_int), ("w", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("stride", ctypes.c_int64)]


class TokenFFNCall(ctypes.Structure):
    """blocks.c's token_ffn."""
    _fields_ = [("rms_norm", ctypes.c_void_p), ("f32_rows", ctypes.c_void_p), ("norm", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("alpha", ctypes.c_float), ("limit", ctypes.c_float), ("route", ctypes.c_int),
                ("lanes", ctypes.c_int), ("act", ctypes.c_int), ("exp_kind", ctypes.c_int), ("h", ctypes.c_int64),
                ("parts", ctypes.c_int64), ("width", ctypes.c_int64), ("experts", ctypes.c_int64),
                ("k", ctypes.c_int64), ("ff", ctypes.c_int64), ("sff", ctypes.c_int64), ("part", RowWeight * 4),
                ("bias", ctypes.c_void_p), ("gate_up", MoEWeight), ("down", MoEWeight), ("shared", MoEWeight)]


class TokenDeltaNetCall(ctypes.Structure):
    """blocks.c's token_deltanet."""
    _fields_ = [("rms_norm", ctypes.c_void_p), ("f32_rows", ctypes.c_void_p), ("dn_decode", ctypes.c_void_p),
                ("norm", ctypes.c_void_p), ("taps", ctypes.c_void_p), ("a", ctypes.c_void_p),
                ("dt_bias", ctypes.c_void_p), ("dn_norm", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("dn_eps", ctypes.c_float), ("h", ctypes.c_int64), ("parts", ctypes.c_int64), ("width", ctypes.c_int64),
                ("K", ctypes.c_int64), ("nk", ctypes.c_int64), ("nv", ctypes.c_int64), ("dk", ctypes.c_int64),
                ("dv", ctypes.c_int64), ("part", RowWeight * 4), ("out", RowWeight)]


class TokenAttentionCall(ctypes.Structure):
    """blocks.c's token_attention."""
    _fields_ = [("rms_norm", ctypes.c_void_p), ("f32_rows", ctypes.c_void_p), ("rope", ctypes.c_void_p),
                ("attention", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p), ("o_bias", ctypes.c_void_p),
                ("sinks", ctypes.c_void_p), ("eps", ctypes.c_float), ("qk_eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("gate", ctypes.c_int), ("h", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("d", ctypes.c_int64),
                ("window", ctypes.c_int64), ("parts", ctypes.c_int64), ("width", ctypes.c_int64),
                ("part", RowWeight * 4), ("out", RowWeight)]


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The block library with these calls set up, where it and the other libraries they call are built here."""
    lib = blocks.library()
    if lib is None or norms._library() is None:
        return None
    p, i, c = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.raymoe_route.argtypes = [c, c, p, i, i, i, p, p]
    lib.raymoe_route.restype = c
    for name, call, args in (("ffn", TokenFFNCall, [i, p, p, p]), ("deltanet", TokenDeltaNetCall, [i, p, p, p, p, p]),
                             ("attention", TokenAttentionCall, [i, p, p, p, i, p, p, p, p, p, p, p])):
        run, scratch = getattr(lib, f"raymoe_token_{name}"), getattr(lib, f"raymoe_token_{name}_scratch")
        run.argtypes, run.restype = [ctypes.POINTER(call), *args], c
        scratch.argtypes, scratch.restype = [ctypes.POINTER(call), i], i
    lib.raymoe_gate_rows.argtypes = [p, p, i, p]
    lib.raymoe_gate_rows.restype = None
    return lib


def _address(lib: ctypes.CDLL, name: str) -> int:
    """The address of a library's function, for the calls that call it."""
    return ctypes.cast(lib[name], ctypes.c_void_p).value


def _rms_norm() -> int:
    return _address(norms._library(), "raymoe_rms_norm")


def _f32_rows() -> int | None:
    lib = native.few_rows()
    return None if lib is None else _address(lib, "raymoe_f32_grouped")


def row_weights(weight, k: int) -> list[RowWeight] | None:
    """A weight [N, k] as the library's one-row products take it, in column order (a ConcatWeight's parts), where
    its one-row products make those calls: float32 rows where dense products take few_rows.c's kernel
    (kernels/dense.py), GGML blocks on the CPU (blocks.RowProduct). None for anything else."""
    if isinstance(weight, ConcatWeight) and weight.pair:
        return None
    parts = weight.parts if isinstance(weight, ConcatWeight) else [weight]
    f32 = native.few_rows() is not None and not native.blas_has_own_threads()
    out = []
    for part in parts:
        if type(part) is DenseWeight and f32 and part.t.is_cpu and part.t.shape[-1:] == (k,) and part.t.dim() == 2 \
                and part.t.is_contiguous():
            out.append(RowWeight(0, 0, 0, part.t.data_ptr(), part.t.shape[0], 0))
        elif type(part) is BlockWeight and part.raw.is_cpu and not part.split and part.k == k and part.raw.dim() == 2 \
                and part.raw.shape[0] and part.raw.is_contiguous() and blocks.supported(part.type) \
                and part.raw.shape[1] == blocks.row_bytes(part.type, k):
            out.append(RowWeight(1, part.type, int(part.quantize_activations), part.raw.data_ptr(), part.raw.shape[0],
                                 part.raw.stride(0)))
        else:
            return None
    return out if len(out) <= 4 else None


def _parts(call, weights: list[RowWeight]) -> int:
    for i, weight in enumerate(weights):
        call.part[i] = weight
    return sum(weight.n for weight in weights)


class TokenFFN:
    """A layer's feed-forward for a decode step's tokens in one call (raymoe_token_ffn): `x + moe(rms_norm(x))`, the
    post-attention norm, the router's product, the routing and the experts. moe: the layer's blocks.TokenMoE; norm
    and eps: the norm's float32 weight and epsilon; router: row_weights of the router's product (the logits, then
    with a shared expert its gate and gate/up); bias: the router's [width] or None; route and lanes: raymoe_route's
    kind and lanes (route_lanes); experts and k: the routed experts and how many a token takes. `keep`: what the
    weights' pointers point into (kept alive here)."""

    def __init__(self, moe: TokenMoE, norm: torch.Tensor, eps: float, router: list[RowWeight],
                 bias: torch.Tensor | None, route: int, lanes: int, experts: int, k: int, keep=()):
        lib = library()
        h = moe.h
        call = TokenFFNCall(rms_norm=_rms_norm(), f32_rows=_f32_rows(), norm=norm.data_ptr(), eps=eps,
                            alpha=moe.activation[2], limit=moe.activation[3], route=route, lanes=lanes,
                            act=moe.activation[0], exp_kind=moe.activation[1], h=h, parts=len(router), experts=experts,
                            k=k, ff=moe.ff, sff=moe.sff, bias=None if bias is None else bias.data_ptr(),
                            gate_up=moe.gate_up, down=moe.down)
        call.width = width = _parts(call, router)
        if moe.shared is not None:
            call.shared = moe.shared
        if experts + (1 + 2 * moe.sff if moe.sff else 0) != width or moe.experts != experts or \
                not 0 < k <= min(experts, MAX_USED) or experts > MAX_EXPERTS:
            raise ValueError(f"a router of {width} columns for {experts} experts ({moe.experts} in the weights), "
                             f"{k} a token, shared expert {moe.sff} wide")
        _check_vector(norm, h, "the norm's weight")
        if bias is not None:
            _check_vector(bias, width, "the router's bias")
        self.h, self.rows = h, min(MAX_ROWS, MAX_SLOTS // k)
        self.ref, self.run = ctypes.byref(call), lib.raymoe_token_ffn
        self.scratch = _scratch_sizes(lib.raymoe_token_ffn_scratch, self.ref, self.rows)
        self.keep = (call, moe, norm, bias, keep)

    def takes(self, x: torch.Tensor) -> bool:
        return _rows(x, self.h, self.rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """x: a decode step's tokens [n, h] that `takes` passed. None where a token's router scores tie among its
        k + 1 best: torch.topk orders those its own way, so the caller makes the separate calls."""
        n = x.shape[0]
        out = x.new_empty(n, self.h)
        status = self.run(self.ref, n, x.data_ptr(), _scratch(self.scratch[n]), out.data_ptr())
        if status == TIES:
            return None
        blocks._status(status)
        return out


class TokenDeltaNet:
    """A Gated DeltaNet layer's mixer for a decode step's tokens in one call (raymoe_token_deltanet): `x +
    mixer(rms_norm(x))`. net: its kernels.deltanet.GatedDeltaNet; norm and eps: the input norm's float32 weight and
    epsilon; inputs: row_weights of the input projections ([qkv | z | beta | alpha], V heads tiled); out: of the out
    projection (one weight); h: the hidden size. `keep`: what the weights' pointers point into."""

    def __init__(self, net, norm: torch.Tensor, eps: float, inputs: list[RowWeight], out: list[RowWeight], h: int,
                 keep=()):
        lib = library()
        nk, nv, dk, dv = net.n_k_heads, net.n_v_heads, net.k_head_dim, net.v_head_dim
        self.conv_shape = (net.conv.shape[1] - 1, net.conv.shape[0])
        self.state_shape = (nv, dk, dv)
        call = TokenDeltaNetCall(rms_norm=_rms_norm(), f32_rows=_f32_rows(),
                                 dn_decode=_address(deltanet.library(), "raymoe_dn_decode"), norm=norm.data_ptr(),
                                 taps=net.taps.data_ptr(), a=net.a.data_ptr(), dt_bias=net.dt_bias.data_ptr(),
                                 dn_norm=net.norm.data_ptr(), eps=eps, dn_eps=net.eps, h=h, parts=len(inputs),
                                 K=net.conv.shape[1], nk=nk, nv=nv, dk=dk, dv=dv)
        call.width = width = _parts(call, inputs)
        if width != 2 * nk * dk + 2 * nv * dv + 2 * nv or len(out) != 1 or out[0].n != h:
            raise ValueError(f"input projections of {width} columns, an out projection of {len(out)} parts, for "
                             f"{nk}x{dk} key and {nv}x{dv} value heads and {h} hidden")
        call.out = out[0]
        _check_vector(norm, h, "the norm's weight")
        for t, size, what in ((net.taps, net.conv.numel(), "taps"), (net.a, nv, "a"), (net.dt_bias, nv, "dt_bias"),
                              (net.norm, dv, "the output norm")):
            _check_vector(t.view(-1) if t.is_contiguous() else t, size, what)
        self.h, self.ref, self.run = h, ctypes.byref(call), lib.raymoe_token_deltanet
        self.scratch = _scratch_sizes(lib.raymoe_token_deltanet_scratch, self.ref, MAX_ROWS)
        self.keep = (call, net, norm, keep)

    def takes(self, x: torch.Tensor, caches) -> bool:
        conv, state = caches
        n = x.shape[0]
        return _rows(x, self.h, MAX_ROWS) and all(
            t.dtype == torch.float32 and t.is_cpu and t.shape == (n, *shape) and t.is_contiguous()
            for t, shape in ((conv, self.conv_shape), (state, self.state_shape)))

    def __call__(self, x: torch.Tensor, caches) -> torch.Tensor:
        """x: a decode step's tokens [n, h] (row i sequence i's) and their stacked caches (conv [n, K-1, C], state
        [n, H_v, dk, dv]) that `takes` passed; the caches are updated in place."""
        conv, state = caches
        n = x.shape[0]
        out = x.new_empty(n, self.h)
        blocks._status(self.run(self.ref, n, x.data_ptr(), conv.data_ptr(), state.data_ptr(),
                                _scratch(self.scratch[n]), out.data_ptr()))
        return out


class TokenAttention:
    """An attention layer's mixer for a decode step's tokens in one call (raymoe_token_attention): `x +
    mixer(rms_norm(x))`. attn: its stages.layers.attention.Attention; norm and eps: the input norm's float32 weight and
    epsilon; qkv, out: row_weights of its q/k/v and out products; h: the hidden size. `keep`: what the weights'
    pointers point into."""

    def __init__(self, attn, norm: torch.Tensor, eps: float, qkv: list[RowWeight], out: list[RowWeight], h: int,
                 keep=()):
        lib, s = library(), attn.spec
        self.heads, self.kv_heads, self.d = s.n_head, s.n_kv_head, s.head_dim
        qd, kvd = s.n_head * s.head_dim, s.n_kv_head * s.head_dim
        call = TokenAttentionCall(rms_norm=_rms_norm(), f32_rows=_f32_rows(),
                                  rope=_address(rope._library(), "raymoe_rope"),
                                  attention=_address(attention._library(), "raymoe_attention_rows"),
                                  norm=norm.data_ptr(), eps=eps, qk_eps=attn.eps, scale=s.head_dim ** -0.5,
                                  gate=int(s.output_gate), h=h, heads=s.n_head, kv_heads=s.n_kv_head, d=s.head_dim,
                                  window=attn.window or 0, parts=len(qkv))
        call.width = width = _parts(call, qkv)
        if width != (2 if s.output_gate else 1) * qd + 2 * kvd or len(out) != 1 or out[0].n != h:
            raise ValueError(f"a q/k/v product of {width} columns, an out product of {len(out)} parts, for "
                             f"{s.n_head} and {s.n_kv_head} heads of {s.head_dim} and {h} hidden")
        call.out = out[0]
        _check_vector(norm, h, "the norm's weight")
        for name, t, n in (("q_norm", attn.q_norm, s.head_dim), ("k_norm", attn.k_norm, s.head_dim),
                           ("qkv_bias", attn.qkv_bias, width), ("o_bias", attn.o_bias, h),
                           ("sinks", attn.sinks, s.n_head)):
            if t is not None:
                _check_vector(t, n, name)
                setattr(call, name, t.data_ptr())
        self.h, self.ref, self.run = h, ctypes.byref(call), lib.raymoe_token_attention
        self.scratch = _scratch_sizes(lib.raymoe_token_attention_scratch, self.ref, MAX_ROWS)
        self.keep = (call, attn, norm, keep)

    def takes(self, x: torch.Tensor, inputs) -> bool:
        """Whether x [n, h] and decode_inputs' (positions, cos, sin, kv) are what the call reads: each sequence's
        cache with its new row reserved (not a row given as a tensor), contiguous float32 and int64 tensors."""
        positions, cos, sin, kv = inputs
        n = x.shape[0]
        if not _rows(x, self.h, MAX_ROWS) or len(kv) != n or positions.shape != (n,) or \
                positions.dtype != torch.int64 or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != n or \
                cos.shape[1] % 2 or cos.shape[1] > self.d or \
                not all(t.is_cpu and t.is_contiguous() and t.dtype == torch.float32 for t in (cos, sin)) or \
                not positions.is_cpu or not positions.is_contiguous():
            return False
        for keys, values, k_pos, row in kv:
            shape = (keys.shape[0], self.kv_heads, self.d)
            if not (row is None and keys.shape == shape and values.shape == shape and k_pos.shape == shape[:1]
                    and k_pos.dtype == torch.int64 and keys.dtype == values.dtype == torch.float32
                    and all(t.is_cpu and t.is_contiguous() for t in (keys, values, k_pos))):
                return False
        return True

    def __call__(self, x: torch.Tensor, inputs) -> torch.Tensor:
        """x: a decode step's tokens [n, h] (row i sequence i's) and their decode_inputs that `takes` passed; each
        cache's new row is written."""
        positions, cos, sin, kv = inputs
        n = x.shape[0]
        # the sequences' keys, then their values, then their positions: three arrays of n addresses
        pointers = (ctypes.c_void_p * (3 * n))(*(cache[j].data_ptr() for j in range(3) for cache in kv))
        first = ctypes.addressof(pointers)
        lengths = (ctypes.c_int64 * n)(*(cache[0].shape[0] for cache in kv))
        out = x.new_empty(n, self.h)
        blocks._status(self.run(self.ref, n, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[1],
                                positions.data_ptr(), first, first + 8 * n, first + 16 * n, lengths,
                                _scratch(self.scratch[n]), out.data_ptr()))
        return out


def gate_matches() -> bool:
    """Whether the library's `x * sigmoid(g)` (Qwen's attention output gate) gives torch's bits here."""
    lib = library()
    return lib is not None and _gate_matches(lib)


@lru_cache(maxsize=None)
def _gate_matches(lib: ctypes.CDLL) -> bool:
    g = torch.Generator().manual_seed(0)
    gate = torch.cat([torch.randn(4096, generator=g) * scale for scale in (1, 4, 30, 120)] +
                     [torch.tensor([0.0, -0.0, 87.5, -87.5, 88.7, -88.7, 103.9, -103.9, 104.1, -104.1, 150.0, -150.0,
                                    float("inf"), float("-inf")] * 8)])
    x = torch.randn(gate.shape, generator=g)
    want, got = x * sigmoid(gate), torch.empty_like(x)
    lib.raymoe_gate_rows(x.data_ptr(), gate.data_ptr(), x.numel(), got.data_ptr())
    return torch.equal(got.view(torch.int32), want.view(torch.int32))


def _rows(x: torch.Tensor, h: int, most: int) -> bool:
    return x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and 0 < x.shape[0] <= most and x.shape[1] == h \
        and x.is_contiguous()


def _scratch_sizes(size, call, most: int) -> list[int]:
    """[0, floats for 1 row, ..., for `most` rows] of a call's scratch."""
    return [0] + [size(call, n) for n in range(1, most + 1)]


_thread = threading.local()


def _scratch(floats: int) -> int:
    """The address of this thread's scratch of at least `floats` floats, which every layer's calls share (one
    layer computes at a time in a thread): a few megabytes, where each layer's own would take a hundred."""
    buffer = getattr(_thread, "scratch", None)
    if buffer is None or buffer.numel() < floats:
        buffer = _thread.scratch = torch.empty(floats)
    return buffer.data_ptr()


def _check_vector(t: torch.Tensor, n: int, what: str) -> None:
    if t.dtype != torch.float32 or t.shape != (n,) or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"{what} must be contiguous float32 [{n}], got {t.dtype} {tuple(t.shape)}")


def route_lanes(kind: int, experts: int, k: int) -> int | None:
    """The float lanes (16 or 8) with which the library's routing of `kind` (ROUTES) gives the bits of
    kernels.moe.torch_route here, for one token's logits of `experts` values and k chosen; None where neither
    does (the routing stays torch's). Its softmax follows ATen's: reductions over the lanes of torch's vector
    kernels (16 with AVX-512, 8 with AVX2), SLEEF's exp; checked against this torch on random logits. Ties among
    the logits (which random logits do not have) may be ordered otherwise than torch.topk orders them."""
    lib = library()
    if lib is None or not 0 < k <= min(experts, MAX_USED) or experts > MAX_EXPERTS:
        return None
    return _route_lanes(lib, kind, experts, k)


@lru_cache(maxsize=None)
def _route_lanes(lib: ctypes.CDLL, kind: int, experts: int, k: int) -> int | None:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(1, experts, generator=g) * scale for scale in (0.1, 1, 4, 16) for _ in range(64)]
    softmax_first, renormalise = next(key for key, value in ROUTES.items() if value == kind)
    want = [torch_route(row, k, softmax_first, renormalise) for row in rows]
    logits = torch.cat(rows)
    for lanes in (16, 8):
        w, ids = torch.empty(len(rows), k), torch.empty(len(rows), k, dtype=torch.int64)
        lib.raymoe_route(kind, lanes, logits.data_ptr(), len(rows), experts, k, w.data_ptr(), ids.data_ptr())
        if all(torch.equal(ids[i:i + 1], want_ids) and torch.equal(w[i:i + 1].view(torch.int32),
                                                                  want_w.view(torch.int32))
               for i, (want_w, want_ids) in enumerate(want)):
            return lanes
    log.info("the routing in C does not give this torch's bits: a decode token's feed-forward takes separate calls")
    return None
