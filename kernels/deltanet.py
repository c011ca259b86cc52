"""Gated DeltaNet numerics: the causal depthwise conv and the gated delta rule.

Per V-head state S [dk, dv] (float32), per token:
    S <- exp(g) * S;  S <- S + k (x) ((v - S^T k) * beta);  y = S^T q / sqrt(dk)
`delta_rule_recurrent` runs it token by token (decode); `delta_rule_chunked` computes the
same thing 64 tokens at a time with the WY / triangular-solve form (prefill).
Inputs q/k must already be L2-normalised and expanded to one head per V head.

`GatedDeltaNet` holds a layer's small parameters and computes its glue around these: the q/k/v
split, the gates, the gated output norm, and `decode`, one token of several sequences at once.

On the CPU the compiled library (kernels/csrc/deltanet.c, built by kernels/native.py's machinery)
runs the conv, the whole decode step and the chunked form (with numpy's OpenBLAS sgemm) in one
call each; `library()` is None without a compiler (or with RAYMOE_NATIVE=0), and then torch
computes them (the chunked form also when numpy's BLAS is not scipy-openblas). On CUDA the Triton kernels
(kernels/triton/deltanet.py: same contracts; kernels/gpu_ops.py) take the head sizes they fit
(powers of two; the chunked form needs them and the chunk at least 16). The kernels are also torch custom
ops (the `*_op` at the end, kernels/ops.py), so that torch.compile traces `GatedDeltaNet.decode_all` whole.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from . import native
from .gpu_ops import use_triton
from .norms import gated_rms_norm
from .ops import custom_op
from .pointwise import sigmoid, silu, softplus
# kernels/triton is imported inside the GPU paths, on first use: triton is optional where only the CPU runs


SOURCE = Path(__file__).parent / "csrc" / "deltanet.c"
# no fused multiply-adds: the C rounds step by step as torch's separate operations do; sqrtf inline
EXTRA_FLAGS = ("-ffp-contract=off", "-fno-math-errno")


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled DeltaNet kernels for this machine, or None where they can't be built here (the
    reason is logged once)."""
    lib = native.load_source(SOURCE, None, EXTRA_FLAGS, fallback="the DeltaNet glue runs as torch operations")
    if lib is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.raymoe_dn_conv.argtypes = [i, i, i, p, i, i, p, i, p, p, p]
    lib.raymoe_dn_conv.restype = None
    lib.raymoe_dn_decode.argtypes = [i, p, p, p, p, p, i, p, i, p, p, p, p, p, ctypes.c_float, i, i, i, i, p, i]
    lib.raymoe_dn_decode.restype = ctypes.c_int
    lib.raymoe_dn_chunked.argtypes = [p, i, i, i, i, i, p, i, p, i, p, i, p, p, i, p, p]
    lib.raymoe_dn_chunked.restype = ctypes.c_int
    lib.raymoe_dn_heads.argtypes = [i, p, i, i, i, i, p, p]
    lib.raymoe_dn_heads.restype = None
    lib.raymoe_dn_gated_norm.argtypes = [i, i, i, p, p, i, p, ctypes.c_float, p]
    lib.raymoe_dn_gated_norm.restype = None
    lib.sgemm = native._numpy_sgemm()
    return lib


def _compiled(*tensors: torch.Tensor) -> bool:
    """Whether the compiled kernels take these: float32 CPU tensors, and the library is here."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and library() is not None


def _gpu(op: str, q: torch.Tensor, v: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether the Triton delta rule takes these: CUDA, power-of-two head sizes, a contiguous state."""
    dk, dv = q.shape[-1], v.shape[-1]
    return use_triton(op, q) and state.is_contiguous() and dk & (dk - 1) == 0 and dv & (dv - 1) == 0


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x [..., T, C], weight [C, K], state [..., K-1, C] (the previous
    inputs); leading dimensions batch independent sequences.

    Returns (y [..., T, C], new_state [..., K-1, C]).
    """
    if use_triton("conv1d", x) and x.dtype == torch.float32:
        return causal_conv1d_op(x, weight.float(), state.float())
    return cpu_causal_conv1d(x, weight, state)


def cpu_causal_conv1d(x, weight, state):
    """causal_conv1d without Triton: the compiled kernel where it takes these tensors, else torch (CUDA
    tensors too)."""
    if x.dim() in (2, 3) and _compiled(x, weight, state):
        return _conv_compiled(x, weight, state)
    kernel = weight.shape[1]
    full = torch.cat((state.to(x.dtype), x), dim=-2)                # [..., T+K-1, C]
    windows = full.unfold(-2, kernel, 1)                              # [..., T, C, K]
    y = (windows * weight.to(x.dtype)).sum(-1)
    return silu(y), full[..., full.shape[-2] - (kernel - 1):, :].clone()


def _conv_compiled(x, weight, state):
    n, (T, C), K = (x.shape[0] if x.dim() == 3 else 1), x.shape[-2:], weight.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    state, taps = state.contiguous(), weight.t().contiguous()
    y = torch.empty(x.shape, dtype=torch.float32)
    new_state = torch.empty(state.shape, dtype=torch.float32)
    ld_n = x.stride(0) if x.dim() == 3 else 0
    library().raymoe_dn_conv(n, T, C, x.data_ptr(), ld_n, x.stride(-2), taps.data_ptr(), K, state.data_ptr(),
                             y.data_ptr(), new_state.data_ptr())
    return y, new_state


def delta_rule_step(q, k, v, g, beta, state):
    """One token for a batch of heads: q/k [..., dk], v [..., dv], g/beta [...], state [..., dk, dv]
    contiguous (updated in place).

    Both reads of the state (k^T S, q^T S) come from one product with the old state, and the
    update `S <- exp(g) S + k delta^T` runs in place, so the state is read three times and
    written twice per token rather than materialising the outer product.
    """
    if _gpu("delta_step", q, v, state):
        return delta_rule_step_op(q.float(), k.float(), v.float(), g.float(), beta.float(), state)
    return torch_delta_rule_step(q, k, v, g, beta, state)


def torch_delta_rule_step(q, k, v, g, beta, state):
    """delta_rule_step in torch operations."""
    dk, dv = state.shape[-2:]
    S = state.view(-1, dk, dv)
    decay = g.exp()[..., None]
    reads = torch.bmm(torch.stack((k, q), dim=-2).reshape(-1, 2, dk), S).view(*state.shape[:-2], 2, dv)
    delta = (v - decay * reads[..., 0, :]) * beta[..., None]
    S.mul_(decay.reshape(-1, 1, 1)).baddbmm_(k.reshape(-1, dk, 1), delta.reshape(-1, 1, dv))
    return decay * reads[..., 1, :] + delta * (k * q).sum(-1, keepdim=True)


def delta_rule_recurrent(q, k, v, g, beta, state):
    """q/k [T, H, dk], v [T, H, dv], g/beta [T, H], state [H, dk, dv] float32 -> (y [T, H, dv], state).

    The state is updated in place (and returned)."""
    if _gpu("delta_rule", q, v, state):
        from .triton import deltanet
        return deltanet.delta_rule_recurrent(q.float(), k.float(), v.float(), g.float(), beta.float(), state)
    dk = q.shape[-1]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = q * dk ** -0.5
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        out[t] = delta_rule_step(q[t], k[t], v[t], g[t], beta[t], state)
    return out, state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """Same contract as `delta_rule_recurrent`, computed chunk by chunk (WY representation).

    Big elementwise passes are what a CPU spends its time on besides the products (measured at
    T=512, 32 heads of 128: 120 -> 65 ms on one thread), so scales fold into small factors, the
    triangular system is inverted once per chunk rather than solved for two right-hand sides, and
    the state is updated in place."""
    if _gpu("delta_rule", q, v, state) and min(q.shape[-1], v.shape[-1], chunk) >= 16:
        from .triton import deltanet
        return deltanet.delta_rule_chunked(q.float(), k.float(), v.float(), g.float(), beta.float(), state, chunk)
    if _compiled(q, k, v, g, beta, state) and library().sgemm is not None:
        return _chunked_compiled(q, k, v, g, beta, state, chunk)
    T, H, dk = q.shape
    dv = v.shape[-1]
    n = -(-T // chunk)
    # -> [n_chunks, H, chunk, *] float32, contiguous: a chunk's slice is contiguous for the batched
    # products. Zero padding leaves the state untouched (beta = 0, g = 0).
    def chunks(t):
        t = t.float()
        if T % chunk:
            t = torch.cat((t, t.new_zeros(n * chunk - T, *t.shape[1:])))
        return t.reshape(n, chunk, *t.shape[1:]).transpose(1, 2).contiguous()
    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))

    cum = g.cumsum(-1)                                                # log decay from chunk start
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()
    # The lower unit-triangular system L = I + strictly_lower(diag(beta) k k^T decay), inverted
    # once per chunk (small): u = L^-1 diag(beta) v, w = L^-1 diag(beta exp(cum)) k.
    eye = torch.eye(chunk, device=q.device)
    lower = torch.tril((k @ k.transpose(-1, -2)) * decay * beta[..., None], -1) + eye
    inv = torch.linalg.solve_triangular(lower, eye, upper=False, unitriangular=True)
    u = (inv * beta[..., None, :]) @ v
    w = (inv * (beta * cum.exp())[..., None, :]) @ k
    scale = dk ** -0.5
    intra = (q @ k.transpose(-1, -2)) * (decay * scale)                # causal in-chunk attention
    q_dec = q * (cum.exp() * scale)[..., None]
    k_dec = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)
    chunk_decay = cum[..., -1].exp()[..., None, None]

    S = state.float().clone()
    out = torch.empty(n, H, chunk, dv, device=q.device)
    for c in range(n):
        v_new = torch.baddbmm(u[c], w[c], S, alpha=-1)
        torch.bmm(q_dec[c], S, out=out[c])
        out[c].baddbmm_(intra[c], v_new)
        S.mul_(chunk_decay[c]).baddbmm_(k_dec[c], v_new)
    return out.transpose(1, 2).reshape(n * chunk, H, dv)[:T], S


def _chunked_compiled(q, k, v, g, beta, state, chunk):
    """The compiled chunked form: one thread per head, products by numpy's OpenBLAS on that thread."""
    T, H, dk = q.shape
    dv = v.shape[-1]
    def rows(t):        # heads side by side in a row, rows at any stride
        return t if t.stride(-1) == 1 and (t.dim() == 2 or t.stride(-2) == t.shape[-1]) else t.contiguous()
    q, k, v, g, beta = (rows(t) for t in (q, k, v, g, beta))
    if g.stride(0) != beta.stride(0):
        g, beta = g.contiguous(), beta.contiguous()
    S = state.float().contiguous().clone()
    out = torch.empty(T, H, dv)
    lib = library()
    if lib.raymoe_dn_chunked(lib.sgemm, T, H, dk, dv, chunk, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                             v.data_ptr(), v.stride(0), g.data_ptr(), beta.data_ptr(), g.stride(0), S.data_ptr(),
                             out.data_ptr()):
        raise MemoryError("chunked delta rule: out of memory")
    return out, S


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@dataclass
class GatedDeltaNet:
    """A Gated DeltaNet layer's small parameters (float32): conv taps [C, K], a = -exp(A_log) and
    dt_bias [n_v_heads], the output norm's weight [v_head_dim]; and its head sizes. V head vh
    reads K head vh % n_k_heads (tiled order)."""
    conv: torch.Tensor
    a: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    eps: float
    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    taps: torch.Tensor | None = None      # conv.t() contiguous [K, C], as the compiled decode step reads them

    def __post_init__(self):
        if self.taps is None:
            self.taps = self.conv.t().contiguous()

    def heads(self, mixed: torch.Tensor):
        """Split conv output [n, C] into L2-normalised q, k [n, H_v, dk] and v [n, H_v, dv]."""
        n, nk, dk = mixed.shape[0], self.n_k_heads, self.k_head_dim
        q, k, v = mixed.split([nk * dk, nk * dk, self.n_v_heads * self.v_head_dim], dim=-1)
        if _compiled(mixed) and mixed.dim() == 2 and mixed.stride(1) == 1:
            q, k = (torch.empty(n, self.n_v_heads, dk) for _ in range(2))
            library().raymoe_dn_heads(n, mixed.data_ptr(), mixed.stride(0), nk, self.n_v_heads, dk, q.data_ptr(),
                                      k.data_ptr())
            return q, k, v.reshape(n, self.n_v_heads, self.v_head_dim)
        # tiled V-head order: V head vh reads K head vh % n_k_heads, i.e. repeat (not interleave)
        repeat = self.n_v_heads // nk
        q = l2norm(q.reshape(n, nk, dk)).repeat(1, repeat, 1)
        k = l2norm(k.reshape(n, nk, dk)).repeat(1, repeat, 1)
        return q, k, v.reshape(n, self.n_v_heads, self.v_head_dim)

    def gates(self, beta: torch.Tensor, alpha: torch.Tensor):
        """(g, beta) per token and V head from the projections: log decay a * softplus(alpha + dt_bias)
        and the write strength sigmoid(beta)."""
        return self.a * softplus(alpha.float() + self.dt_bias), sigmoid(beta.float())

    def output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The out projection's input [n, H_v * dv] from the delta rule's y [n, H_v, dv]."""
        if _compiled(y, z, self.norm) and z.dim() == 2 and z.stride(-1) == 1 and self.norm.is_contiguous():
            y, out = y.contiguous(), torch.empty(y.shape[0], self.n_v_heads * self.v_head_dim)
            library().raymoe_dn_gated_norm(y.shape[0], self.n_v_heads, self.v_head_dim, y.data_ptr(), z.data_ptr(),
                                           z.stride(0), self.norm.data_ptr(), self.eps, out.data_ptr())
            return out
        return gated_rms_norm(y, z.reshape(y.shape), self.norm, self.eps).reshape(y.shape[0], -1)

    def decode(self, qkv, z, beta, alpha, rows: list[int] | range, conv_states, states, out: torch.Tensor) -> None:
        """One token of each of n sequences: row rows[i] of the projections qkv [*, C], z [*, H_v * dv],
        beta and alpha [*, H_v] is sequence i's; its caches, conv_states [n, K-1, C] and states
        [n, H_v, dk, dv] (contiguous), are updated in place. Writes out[rows] (the out
        projection's input)."""
        n, C, K = len(rows), self.conv.shape[0], self.conv.shape[1]
        if conv_states.shape != (n, K - 1, C) or \
                states.shape != (n, self.n_v_heads, self.k_head_dim, self.v_head_dim):
            raise ValueError(f"caches {tuple(conv_states.shape)}, {tuple(states.shape)} do not fit {n} sequences")
        parts = (qkv, z, beta, alpha)
        if _compiled(*parts, conv_states, states, out, self.taps, self.a, self.dt_bias, self.norm) and \
                _same_rows(parts) and out.stride(-1) == 1 and all(t.is_contiguous() for t in (
                    conv_states, states, self.taps, self.a, self.dt_bias, self.norm)):
            index = _first_rows(n) if rows == range(n) else torch.tensor(rows, dtype=torch.int64)
            failed = library().raymoe_dn_decode(
                n, index.data_ptr(), *(t.data_ptr() for t in parts), qkv.stride(0), self.taps.data_ptr(),
                K, conv_states.data_ptr(), states.data_ptr(), self.a.data_ptr(),
                self.dt_bias.data_ptr(), self.norm.data_ptr(), self.eps, self.n_k_heads, self.n_v_heads,
                self.k_head_dim, self.v_head_dim, out.data_ptr(), out.stride(0))
            if failed:
                raise MemoryError("DeltaNet decode step: out of memory")
            return
        idx = torch.tensor(rows, device=qkv.device)
        out[idx] = self._decode_torch(qkv[idx], z[idx], beta[idx], alpha[idx], conv_states, states)

    def decode_all(self, qkv, z, beta, alpha, conv_states, states) -> torch.Tensor:
        """decode() of every row, returning the out projection's input [n, H_v * dv]: one custom op
        (raymoe::deltanet_decode: the compiled step on the CPU, Triton's on CUDA where kernels/gpu_ops.py
        turns the step on), else torch operations; torch.compile traces either without a break."""
        if qkv.is_cpu and not torch.compiler.is_compiling():     # the op's CPU implementation, without its dispatch
            return self.decode_rows(qkv, z, beta, alpha, conv_states, states)
        triton = use_triton("delta_step", qkv) and use_triton("conv1d", qkv) and \
            all(n & (n - 1) == 0 for n in (self.k_head_dim, self.v_head_dim))
        if qkv.is_cuda and not triton:
            return self._decode_torch(qkv, z, beta, alpha, conv_states, states)
        return deltanet_decode_op(qkv, z, beta, alpha, conv_states, states, self.conv, self.taps, self.a,
                                  self.dt_bias, self.norm, self.eps, self.n_k_heads, self.n_v_heads, self.k_head_dim,
                                  self.v_head_dim)

    def decode_rows(self, qkv, z, beta, alpha, conv_states, states) -> torch.Tensor:
        """decode() of every row into a new out projection input [n, H_v * dv] (the op's CPU implementation)."""
        out = qkv.new_empty(qkv.shape[0], self.n_v_heads * self.v_head_dim)
        self.decode(qkv, z, beta, alpha, range(qkv.shape[0]), conv_states, states, out)
        return out

    def _decode_torch(self, qkv, z, beta, alpha, conv_states, states) -> torch.Tensor:
        g, beta = self.gates(beta, alpha)
        mixed, conv = causal_conv1d(qkv[:, None], self.conv, conv_states)
        conv_states.copy_(conv)
        q, k, v = self.heads(mixed[:, 0])
        y = delta_rule_step(q * self.k_head_dim ** -0.5, k, v.float(), g, beta, states)
        return self.output(y, z)


@lru_cache(maxsize=64)
def _first_rows(n: int) -> torch.Tensor:
    """The row index 0..n-1 (the library only reads it): made once per batch size."""
    return torch.arange(n, dtype=torch.int64)


def _same_rows(parts) -> bool:
    """Column slices of one [n, *] matrix (the stacked projections): one row stride, contiguous rows."""
    return all(t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == parts[0].stride(0) for t in parts)


# ---- the custom ops (kernels/ops.py) ------------------------------------------------------------------

@custom_op("causal_conv1d")
def causal_conv1d_op(x: Tensor, weight: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv + SiLU: x [..., T, C], weight [C, K], state [..., K-1, C] -> (y, new state)."""
    return cpu_causal_conv1d(x, weight, state)


@causal_conv1d_op.register_kernel("cuda")
def _(x, weight, state):
    from .triton import deltanet as gpu
    return gpu.causal_conv1d(x, weight, state)


@causal_conv1d_op.register_fake
def _(x, weight, state):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(state)


@custom_op("delta_rule_step", mutates=("state",))
def delta_rule_step_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
    """One token of the gated delta rule: q (scaled) / k [..., dk], v [..., dv], g / beta [...], state
    [..., dk, dv] float32 contiguous, updated in place -> y [..., dv]."""
    return torch_delta_rule_step(q, k, v, g, beta, state)


@delta_rule_step_op.register_kernel("cuda")
def _(q, k, v, g, beta, state):
    from .triton import deltanet as gpu
    return gpu.delta_rule_step(q, k, v, g, beta, state)


@delta_rule_step_op.register_fake
def _(q, k, v, g, beta, state):
    return v.new_empty(v.shape, dtype=torch.float32)


@custom_op("deltanet_decode", mutates=("conv_states", "states"))
def deltanet_decode_op(qkv: Tensor, z: Tensor, beta: Tensor, alpha: Tensor, conv_states: Tensor, states: Tensor,
                       conv: Tensor, taps: Tensor, a: Tensor, dt_bias: Tensor, norm: Tensor, eps: float,
                       n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int) -> Tensor:
    """One token of each of n sequences through a DeltaNet layer, from its input projections (qkv [n, C],
    z [n, H_v * dv], beta and alpha [n, H_v]) to its out projection's input [n, H_v * dv]; the caches
    conv_states [n, K-1, C] and states [n, H_v, dk, dv] are updated in place."""
    net = GatedDeltaNet(conv, a, dt_bias, norm, eps, n_k_heads, n_v_heads, k_head_dim, v_head_dim, taps)
    return net.decode_rows(qkv, z, beta, alpha, conv_states, states)


@deltanet_decode_op.register_kernel("cuda")
def _(qkv, z, beta, alpha, conv_states, states, conv, taps, a, dt_bias, norm, eps, n_k_heads, n_v_heads, k_head_dim,
      v_head_dim):
    from .triton import deltanet as gpu, norms as gpu_norms
    net = GatedDeltaNet(conv, a, dt_bias, norm, eps, n_k_heads, n_v_heads, k_head_dim, v_head_dim, taps)
    g, b = net.gates(beta, alpha)
    mixed, new_conv = gpu.causal_conv1d(qkv[:, None], conv, conv_states)
    conv_states.copy_(new_conv)
    q, k, v = net.heads(mixed[:, 0])
    y = gpu.delta_rule_step((q * k_head_dim ** -0.5).contiguous(), k.contiguous(), v.contiguous(), g, b, states)
    return gpu_norms.rms_norm(y, norm, eps, z.reshape(y.shape).contiguous()).reshape(qkv.shape[0], -1)


@deltanet_decode_op.register_fake
def _(qkv, z, beta, alpha, conv_states, states, conv, taps, a, dt_bias, norm, eps, n_k_heads, n_v_heads, k_head_dim,
      v_head_dim):
    return qkv.new_empty(qkv.shape[0], n_v_heads * v_head_dim)
