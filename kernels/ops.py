"""The kernels as torch custom ops (namespace `raymoe`), so that torch.compile traces a decode step whole.

Each op has a CPU implementation, which is exactly what the eager code runs (the compiled C library
through ctypes, or torch where it can't be built: the same bits either way), a CUDA implementation over
the Triton kernels of kernels/triton (imported on first use), and a fake one that gives the output's
shape and dtype. Arguments are tensors and plain numbers: expert ids stay a tensor (no list of groups),
so a traced step has no host synchronisation. Outside tracing, calls skip the dispatcher (see _Op).

    dense_linear, block_linear, int8_linear     x [T, K] times one weight's rows -> [T, N]
    dense_slots, block_slots, int8_slots        row t*k+j = x[t] through expert ids[t, j] -> [T*k, N]
    attention                                   one sequence's queries over its cache (sinks, window)
    causal_conv1d, delta_rule_step              the Gated DeltaNet conv and one recurrent step
    deltanet_decode                             a DeltaNet layer's whole decode step (conv, rule, norm)
    route                                       softmax-top-k / top-k-softmax routing
    rms_norm                                    RMSNorm over the last dimension, float32
    rope                                        NeoX rotary embedding of each head's leading values
    moe_combine, moe_token                      the routed experts' weighted sum (and the gated shared
                                                expert); one token's whole MoE after its router, one call

block_* take GGML blocks (uint8 [.., N, row bytes]) and, as raw2, optionally a second weight of the same
format whose rows follow the first's in the output (a GGUF file's gate and up experts: one product).
int8 is a CPU mode (no CUDA implementation). kernels/weights.py, attention.py, deltanet.py and moe.py
call these; docs/compiled-step.md says what is left to do.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

LIB = "raymoe"


class _Op:
    """A custom op, called through torch's dispatcher while torch.compile traces (the graph holds one
    call), and otherwise straight to its implementation for the tensors' device: the same function,
    without the dispatcher's Python layers (measured: tens of µs a call, which doubled the embedded
    models' decode step; a real model's step makes hundreds of calls)."""

    def __init__(self, op, cpu):
        self.op, self.kernels = op, {"cpu": cpu}

    def register_kernel(self, device: str):
        def register(fn):
            self.op.register_kernel(device)(fn)
            self.kernels[device] = fn
            return fn
        return register

    def register_fake(self, fn):
        return self.op.register_fake(fn)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.op(*args)
        kernel = self.kernels.get(args[0].device.type)
        if kernel is None:
            raise NotImplementedError(f"{self.op._qualname} has no {args[0].device.type} implementation")
        return kernel(*args)


def _op(name: str, mutates: tuple = ()):
    """A custom op whose decorated function is its CPU implementation."""
    def register(cpu) -> _Op:
        return _Op(torch.library.custom_op(f"{LIB}::{name}", mutates_args=mutates, device_types="cpu")(cpu), cpu)
    return register


# Up to this many rows, every block weight's product is the few-row kernel's one call (BlockWeight._few_rows)
DECODE_ROWS = 8


def _rows(raw: Tensor, raw2: Optional[Tensor]) -> int:
    return raw.shape[-2] + (0 if raw2 is None else raw2.shape[-2])


def _columns(raw: Tensor, raw2: Optional[Tensor], out: Tensor):
    """(weight, its columns of out) for raw and raw2."""
    n = raw.shape[-2]
    return [(raw, out[:, :n])] + ([] if raw2 is None else [(raw2, out[:, n:])])


def _block_weight(raw, raw2, ggml_type, k, quantize):
    from .weights import BlockWeight, ConcatWeight
    w = BlockWeight(raw, ggml_type, k, quantize)
    return w if raw2 is None else ConcatWeight([w, BlockWeight(raw2, ggml_type, k, quantize)], raw.dim() - 2)


def _slots(weight, x: Tensor, ids: Tensor) -> Tensor:
    """CPU (the ids are a CPU tensor: reading them is no synchronisation): one grouped product, as the
    eager path's. Slots of distinct experts (one token's) are each a group, in slot order; otherwise the
    slots are sorted by expert, so that each expert's weights are read once, and put back in slot order.
    A row's bits depend only on its own activations and weight."""
    from .linear import take_rows       # here: linear imports weights, which imports this module
    from .moe import _plan
    T, k = ids.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    flat = ids.reshape(-1).tolist()
    if len(set(flat)) == len(flat):
        tokens = _per_slot(x, ids)
        return weight.grouped(tokens, [(e, s, s + 1) for s, e in enumerate(flat)], x.new_empty(T * k, weight.shape[-2]))
    order, groups = _plan(ids, range(weight.shape[0]))
    tokens = take_rows(x, [s // k for s in order])
    products = weight.grouped(tokens, groups, x.new_empty(len(order), weight.shape[-2]))
    return x.new_empty(T * k, weight.shape[-2]).index_copy_(0, torch.tensor(order), products)


def _per_slot(x: Tensor, ids: Tensor) -> Tensor:
    """Row t*k+j = x[t]."""
    return x if ids.shape[1] == 1 else x.repeat_interleave(ids.shape[1], 0)


def _slots_fake(x: Tensor, ids: Tensor, n: int) -> Tensor:
    return x.new_empty(ids.shape[0] * ids.shape[1], n)


# ---- products --------------------------------------------------------------------------------------

@_op("dense_linear")
def dense_linear(x: Tensor, w: Tensor) -> Tensor:
    """x [T, K] @ w [N, K]^T, float32."""
    from .dense import dense_linear as run
    return run(x, w, x.new_empty(x.shape[0], w.shape[0]))


@dense_linear.register_kernel("cuda")
def _(x, w):
    return F.linear(x, w)       # cuBLAS (TF32 stays off for float32 products)


@dense_linear.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


@_op("dense_slots")
def dense_slots(x: Tensor, ids: Tensor, w: Tensor, w2: Optional[Tensor]) -> Tensor:
    """Row t*k+j = x[t] @ (w | w2)[ids[t, j]]^T: x [T, K], ids int64 [T, k], w [E, N, K] and optionally w2
    [E, N2, K] (a GGUF file's gate and up experts: one plan) -> [T*k, N + N2]."""
    from .weights import ConcatWeight, DenseWeight
    weight = DenseWeight(w) if w2 is None else ConcatWeight([DenseWeight(w), DenseWeight(w2)], 1)
    return _slots(weight, x, ids)


@dense_slots.register_kernel("cuda")
def _(x, ids, w, w2):
    experts, x = ids.reshape(-1), _per_slot(x, ids)[:, :, None]
    out = torch.bmm(w[experts], x)[..., 0]
    return out if w2 is None else torch.cat((out, torch.bmm(w2[experts], x)[..., 0]), -1)


@dense_slots.register_fake
def _(x, ids, w, w2):
    return _slots_fake(x, ids, _rows(w, w2))


@_op("block_linear")
def block_linear(x: Tensor, raw: Tensor, raw2: Optional[Tensor], ggml_type: int, k: int, quantize: bool) -> Tensor:
    """x [T, k] @ deq(raw [N, row bytes] | raw2 [N2, row bytes])^T -> [T, N + N2]. quantize: the fast mode
    (8-bit activations) where the format has one; otherwise exact float32."""
    from . import blocks
    if x.shape[0] <= DECODE_ROWS and blocks.library() is not None:     # BlockWeight's call, made straight
        out = x.new_empty(x.shape[0], _rows(raw, raw2))
        blocks.grouped_product(x if x.stride(-1) == 1 else x.contiguous(), raw, ggml_type, k, [(0, 0, x.shape[0])],
                               out, quantize, raw2)
        return out
    w = _block_weight(raw, raw2, ggml_type, k, quantize)
    return w.linear(x, x.new_empty(x.shape[0], w.shape[-2]))


@block_linear.register_kernel("cuda")
def _(x, raw, raw2, ggml_type, k, quantize):
    from .triton import blocks as gpu
    out, x = x.new_empty(x.shape[0], _rows(raw, raw2)), x if x.stride(-1) == 1 else x.contiguous()
    for w, columns in _columns(raw, raw2, out):
        gpu.linear(x, w, ggml_type, k, columns)
    return out


@block_linear.register_fake
def _(x, raw, raw2, ggml_type, k, quantize):
    return x.new_empty(x.shape[0], _rows(raw, raw2))


@_op("block_slots")
def block_slots(x: Tensor, ids: Tensor, raw: Tensor, raw2: Optional[Tensor], ggml_type: int, k: int,
                quantize: bool) -> Tensor:
    """Row t*K+j = x[t] @ deq(expert ids[t, j] of raw [E, N, row bytes] | raw2 [E, N2, row bytes])^T:
    x [T, k], ids int64 [T, K] -> [T*K, N + N2]."""
    from . import blocks
    if (ids.shape[0] == 1 or ids.shape[1] == 1) and blocks.library() is not None:
        experts = ids.reshape(-1).tolist()
        if len(set(experts)) == len(experts):   # _slots' groups of one slot each, x's rows read in place
            out = x.new_empty(len(experts), _rows(raw, raw2))
            blocks.slot_product(x if x.stride(-1) == 1 else x.contiguous(), raw, ggml_type, k, experts, out, quantize,
                                raw2)
            return out
    return _slots(_block_weight(raw, raw2, ggml_type, k, quantize), x, ids)


@block_slots.register_kernel("cuda")
def _(x, ids, raw, raw2, ggml_type, k, quantize):
    from .triton import blocks as gpu
    out, x, experts = x.new_empty(ids.numel(), _rows(raw, raw2)), _per_slot(x, ids).contiguous(), ids.reshape(-1)
    for w, columns in _columns(raw, raw2, out):
        gpu.slot_product(x, w, ggml_type, k, experts, columns)
    return out


@block_slots.register_fake
def _(x, ids, raw, raw2, ggml_type, k, quantize):
    return _slots_fake(x, ids, _rows(raw, raw2))


@_op("int8_linear")
def int8_linear(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x [T, K] @ (q [N, K] int8 * scale [N])^T (kernels/int8.py)."""
    from .int8 import Int8Weight
    return Int8Weight(q, scale).linear(x, x.new_empty(x.shape[0], q.shape[0]))


@int8_linear.register_fake
def _(x, q, scale):
    return x.new_empty(x.shape[0], q.shape[0])


@_op("int8_slots")
def int8_slots(x: Tensor, ids: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """dense_slots for int8 rows: q [E, N, K], scale [E, N]."""
    from .int8 import Int8Weight
    return _slots(Int8Weight(q, scale), x, ids)


@int8_slots.register_fake
def _(x, ids, q, scale):
    return _slots_fake(x, ids, q.shape[-2])


# ---- attention ---------------------------------------------------------------------------------------

@_op("attention")
def attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float, window: Optional[int],
              sinks: Optional[Tensor]) -> Tensor:
    """q [Tq, Hq, D] over k/v [Tk, Hkv, D] at positions q_pos [Tq], k_pos [Tk] -> [Tq, Hq, D]
    (kernels/attention.py's contract)."""
    from .attention import cpu_attention
    return cpu_attention(q, k, v, q_pos, k_pos, scale, window, sinks)


@attention.register_kernel("cuda")
def _(q, k, v, q_pos, k_pos, scale, window, sinks):
    from .triton.attention import attention as run
    return run(q, k, v, q_pos, k_pos, scale, window, sinks)


@attention.register_fake
def _(q, k, v, q_pos, k_pos, scale, window, sinks):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


# ---- Gated DeltaNet ----------------------------------------------------------------------------------

@_op("causal_conv1d")
def causal_conv1d(x: Tensor, weight: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv + SiLU: x [..., T, C], weight [C, K], state [..., K-1, C] -> (y, new state)."""
    from .deltanet import cpu_causal_conv1d
    return cpu_causal_conv1d(x, weight, state)


@causal_conv1d.register_kernel("cuda")
def _(x, weight, state):
    from .triton import deltanet as gpu
    return gpu.causal_conv1d(x, weight, state)


@causal_conv1d.register_fake
def _(x, weight, state):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(state)


@_op("delta_rule_step", mutates=("state",))
def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
    """One token of the gated delta rule: q (scaled) / k [..., dk], v [..., dv], g / beta [...], state
    [..., dk, dv] float32 contiguous, updated in place -> y [..., dv]."""
    from .deltanet import torch_delta_rule_step
    return torch_delta_rule_step(q, k, v, g, beta, state)


@delta_rule_step.register_kernel("cuda")
def _(q, k, v, g, beta, state):
    from .triton import deltanet as gpu
    return gpu.delta_rule_step(q, k, v, g, beta, state)


@delta_rule_step.register_fake
def _(q, k, v, g, beta, state):
    return v.new_empty(v.shape, dtype=torch.float32)


@_op("deltanet_decode", mutates=("conv_states", "states"))
def deltanet_decode(qkv: Tensor, z: Tensor, beta: Tensor, alpha: Tensor, conv_states: Tensor, states: Tensor,
                    conv: Tensor, taps: Tensor, a: Tensor, dt_bias: Tensor, norm: Tensor, eps: float, n_k_heads: int,
                    n_v_heads: int, k_head_dim: int, v_head_dim: int) -> Tensor:
    """One token of each of n sequences through a DeltaNet layer, from its input projections (qkv [n, C],
    z [n, H_v * dv], beta and alpha [n, H_v]) to its out projection's input [n, H_v * dv]; the caches
    conv_states [n, K-1, C] and states [n, H_v, dk, dv] are updated in place (kernels/deltanet.py)."""
    net = _deltanet(conv, taps, a, dt_bias, norm, eps, n_k_heads, n_v_heads, k_head_dim, v_head_dim)
    return net.decode_rows(qkv, z, beta, alpha, conv_states, states)


@deltanet_decode.register_kernel("cuda")
def _(qkv, z, beta, alpha, conv_states, states, conv, taps, a, dt_bias, norm, eps, n_k_heads, n_v_heads, k_head_dim,
      v_head_dim):
    from .triton import deltanet as gpu, norms
    net = _deltanet(conv, taps, a, dt_bias, norm, eps, n_k_heads, n_v_heads, k_head_dim, v_head_dim)
    g, b = net.gates(beta, alpha)
    mixed, new_conv = gpu.causal_conv1d(qkv[:, None], conv, conv_states)
    conv_states.copy_(new_conv)
    q, k, v = net.heads(mixed[:, 0])
    y = gpu.delta_rule_step((q * k_head_dim ** -0.5).contiguous(), k.contiguous(), v.contiguous(), g, b, states)
    return norms.rms_norm(y, norm, eps, z.reshape(y.shape).contiguous()).reshape(qkv.shape[0], -1)


@deltanet_decode.register_fake
def _(qkv, z, beta, alpha, conv_states, states, conv, taps, a, dt_bias, norm, eps, n_k_heads, n_v_heads, k_head_dim,
      v_head_dim):
    return qkv.new_empty(qkv.shape[0], n_v_heads * v_head_dim)


def _deltanet(conv, taps, a, dt_bias, norm, eps, nk, nv, dk, dv):
    from .deltanet import GatedDeltaNet
    return GatedDeltaNet(conv, a, dt_bias, norm, eps, nk, nv, dk, dv, taps)


# ---- the end of a MoE layer ---------------------------------------------------------------------------

@_op("moe_combine")
def moe_combine(rows: Tensor, weights: Tensor, gate: Optional[Tensor], shared: Optional[Tensor]) -> Tensor:
    """Row t = sum over j of weights[t, j] * rows[t*k + j] (j in order), plus sigmoid(gate[t]) * shared[t]
    where gate [T, 1] and shared [T, H] are given: rows [T*k, H] -> [T, H], float32. On the CPU one call
    of kernels/csrc/blocks.c (moe_token's end: the same bits), else torch's operations."""
    from . import blocks
    lib = blocks.library()
    if lib is None:
        return _torch_combine(rows, weights, gate, shared)
    T, k = weights.shape
    rows, weights = rows.contiguous(), weights.float().contiguous()
    shared = None if shared is None else shared.contiguous()
    out = rows.new_empty(T, rows.shape[-1])
    if T:
        blocks.moe_combine(lib, rows, weights, gate, shared, out)
    return out


@moe_combine.register_kernel("cuda")
def _(rows, weights, gate, shared):
    return _torch_combine(rows, weights, gate, shared)


@moe_combine.register_fake
def _(rows, weights, gate, shared):
    return rows.new_empty(weights.shape[0], rows.shape[-1])


def _torch_combine(rows, weights, gate, shared):
    T, k = weights.shape
    y = rows.reshape(T, k, -1).mul(weights[..., None].to(rows.dtype)).sum(1)
    return y if gate is None else y + torch.sigmoid(gate) * shared


@_op("moe_token")
def moe_token(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, gate_up2: Optional[Tensor], gate_up_type: int,
              gate_up_quantize: bool, gate_up_bias: Optional[Tensor], down: Tensor, down_type: int, down_quantize: bool,
              down_bias: Optional[Tensor], activation: int, exp_kind: int, alpha: float, limit: float,
              shared_gate_up: Optional[Tensor], shared_down: Optional[Tensor], shared_type: int,
              shared_quantize: bool, gate: Optional[Tensor]) -> Tensor:
    """One token's MoE layer after its router, CPU only, in one call: x [1, H] through the gate/up experts
    ids[0, j] of gate_up [E, N, row bytes] (| gate_up2's rows; plus gate_up_bias [E, 2F]), the activation
    (0: swiglu, 1: gpt-oss's clamped swiglu with alpha and limit; its exp as blocks.activation_exp says), the
    down experts of down [E, H, row bytes] (plus down_bias [E, H]); the shared expert's activation of
    shared_gate_up [1, 2S] and its down product (shared_down [H, row bytes]) when given; then moe_combine
    with gate [1, 1] -> [1, H]. The same bits as block_slots, the activation, block_linear and moe_combine
    called one after another (blocks.c's raymoe_moe_token)."""
    from . import blocks
    return blocks.moe_token(x, ids.reshape(-1).tolist(), weights,
                            (gate_up, gate_up2, gate_up_type, gate_up_quantize, gate_up_bias),
                            (down, down_type, down_quantize, down_bias), (activation, exp_kind, alpha, limit),
                            shared_gate_up, None if shared_down is None else (shared_down, shared_type, shared_quantize),
                            gate)


@moe_token.register_fake
def _(x, ids, weights, gate_up, gate_up2, gate_up_type, gate_up_quantize, gate_up_bias, down, down_type,
      down_quantize, down_bias, activation, exp_kind, alpha, limit, shared_gate_up, shared_down, shared_type,
      shared_quantize, gate):
    return x.new_empty(1, down.shape[-2])


# ---- routing ------------------------------------------------------------------------------------------

@_op("route")
def route(logits: Tensor, k: int, softmax_first: bool, renormalise: bool) -> tuple[Tensor, Tensor]:
    """(weights, ids) [T, k] from router logits [T, E]: softmax then top k (optionally renormalised), or
    top k then softmax (kernels/moe.py)."""
    from .moe import torch_route
    return torch_route(logits, k, softmax_first, renormalise)


@route.register_kernel("cuda")
def _(logits, k, softmax_first, renormalise):
    from .triton import moe
    return moe._route(logits.float(), k, softmax_first, renormalise)


@route.register_fake
def _(logits, k, softmax_first, renormalise):
    shape = (*logits.shape[:-1], k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


# ---- RoPE ---------------------------------------------------------------------------------------------

@_op("rope")
def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX rotary embedding of the first cos.shape[-1] values of each head: x [T, H, D] float32, cos and sin
    [T, rd] -> [T, H, D] (kernels/rope.py)."""
    from .rope import cpu_rope
    return cpu_rope(x, cos, sin)


@rope.register_kernel("cuda")
def _(x, cos, sin):
    from .rope import torch_rope
    return torch_rope(x, cos, sin)


@rope.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)


# ---- norms --------------------------------------------------------------------------------------------

@_op("rms_norm")
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., K] float32 times rsqrt(mean(x^2) + eps) times weight [K] (kernels/norms.py)."""
    from .norms import cpu_rms_norm
    return cpu_rms_norm(x, weight, eps)


@rms_norm.register_kernel("cuda")
def _(x, weight, eps):
    from .gpu_ops import use_triton
    if use_triton("rms_norm", x):
        from .triton import norms
        return norms.rms_norm(x, weight.float(), eps)
    return F.rms_norm(x, weight.shape, weight.float(), eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
