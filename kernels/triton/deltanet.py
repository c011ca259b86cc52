"""Gated DeltaNet on the GPU (kernels/deltanet.py): the causal depthwise conv1d with its state, and
the gated delta rule token by token (decode, and the recurrent form) and chunk by chunk (prefill).

Per V-head state S [dk, dv] (float32), per token:
    S <- exp(g) S;  S <- S + k (x) ((v - S^T k) beta);  y = S^T q
Each program owns one head and a tile of dv columns of its state (the columns are independent), keeps
that tile in registers over all the tokens, and writes it back once. q must already be L2-normalised,
expanded to one head per V head and, for `delta_rule_step`, scaled by dk^-0.5 (as the CPU functions).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_device, power_of_two

BLOCK_V = 16       # state columns per program


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, T, BH, scale,
                      DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr):
    """q/k [T, BH, DK], v/out [T, BH, DV], g/beta [T, BH], state [BH, DK, DV] (updated in place)."""
    bh = tl.program_id(0).to(tl.int64)
    dk = tl.arange(0, DK)
    dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    s_ptr = state_ptr + (bh * DK + dk[:, None]) * DV + dv[None, :]
    S = tl.load(s_ptr)
    for t in range(T):
        row = t * BH + bh
        q = tl.load(q_ptr + row * DK + dk) * scale
        k = tl.load(k_ptr + row * DK + dk)
        v = tl.load(v_ptr + row * DV + dv)
        decay = tl.exp(tl.load(g_ptr + row))
        beta = tl.load(beta_ptr + row)
        # both reads come from the old state, as delta_rule_step
        k_read = tl.sum(k[:, None] * S, 0)
        q_read = tl.sum(q[:, None] * S, 0)
        delta = (v - decay * k_read) * beta
        S = S * decay + k[:, None] * delta[None, :]
        tl.store(out_ptr + row * DV + dv, decay * q_read + delta * tl.sum(k * q, 0))
    tl.store(s_ptr, S)


@triton.jit
def _forward_substitute(lower, rhs, C: tl.constexpr):
    """Solve (I + lower) X = rhs for X [C, W], lower strictly lower-triangular [C, C], row by row."""
    r = tl.arange(0, C)
    x = rhs
    for i in range(1, C):
        row = tl.sum(tl.where(r[:, None] == i, lower, 0.0), 0)                # lower[i, :]
        xi = tl.sum(tl.where(r[:, None] == i, x, 0.0), 0) - tl.sum(row[:, None] * x, 0)
        x = tl.where(r[:, None] == i, xi[None, :], x)
    return x


@triton.jit
def _chunked_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, T, H, scale,
                    DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr):
    """The recurrent kernel's contract (BH = H), C tokens at a time: within a chunk, the WY form
    (a unit lower-triangular solve) gives every token's correction from the chunk's starting state;
    the state then advances once per chunk. Padding tokens have g = beta = 0 and leave it unchanged."""
    h = tl.program_id(0).to(tl.int64)
    dk = tl.arange(0, DK)
    dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    c = tl.arange(0, C)
    s_ptr = state_ptr + (h * DK + dk[:, None]) * DV + dv[None, :]
    S = tl.load(s_ptr)
    causal = c[None, :] <= c[:, None]
    for start in range(0, T, C):
        t = start + c
        valid = t < T
        rows = t.to(tl.int64) * H + h
        q = tl.load(q_ptr + rows[:, None] * DK + dk[None, :], mask=valid[:, None], other=0.0) * scale
        k = tl.load(k_ptr + rows[:, None] * DK + dk[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] * DV + dv[None, :], mask=valid[:, None], other=0.0)
        g = tl.load(g_ptr + rows, mask=valid, other=0.0)
        beta = tl.load(beta_ptr + rows, mask=valid, other=0.0)
        cum = tl.cumsum(g, 0)                                                  # log decay since chunk start
        decay = tl.where(causal, tl.exp(cum[:, None] - cum[None, :]), 0.0)
        k_beta = k * beta[:, None]
        system = tl.dot(k_beta, tl.trans(k), input_precision="ieee") * decay
        lower = tl.where(c[None, :] < c[:, None], system, 0.0)
        u = _forward_substitute(lower, v * beta[:, None], C)
        w = _forward_substitute(lower, k_beta * tl.exp(cum)[:, None], C)
        v_new = u - tl.dot(w, S, input_precision="ieee")
        intra = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        y = (tl.dot(q * tl.exp(cum)[:, None], S, input_precision="ieee")
             + tl.dot(intra, v_new, input_precision="ieee"))
        tl.store(out_ptr + rows[:, None] * DV + dv[None, :], y, mask=valid[:, None])
        last = tl.sum(tl.where(c == C - 1, cum, 0.0), 0)
        k_dec = k * tl.exp(last - cum)[:, None]
        S = S * tl.exp(last) + tl.dot(tl.trans(k_dec), v_new, input_precision="ieee")
    tl.store(s_ptr, S)


def _check(q, k, v, g, beta, state, lead: tuple) -> None:
    dk, dv = q.shape[-1], v.shape[-1]
    if (k.shape != q.shape or v.shape != (*lead, dv) or q.shape != (*lead, dk) or g.shape != lead
            or beta.shape != lead or state.dtype != torch.float32 or not state.is_contiguous()
            or any(t.dtype != torch.float32 for t in (q, k, v, g, beta))):
        raise ValueError(f"delta rule shapes do not fit: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)} state {tuple(state.shape)} "
                         "(all float32, state contiguous)")
    power_of_two(dk, "dk")
    power_of_two(dv, "dv")
    check_device(q, k, v, g, beta, state)


def _launch_recurrent(q, k, v, g, beta, state, T, BH, scale):
    dk, dv = q.shape[-1], v.shape[-1]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    block_v = min(BLOCK_V, dv)
    if T and BH:
        _recurrent_kernel[(BH, dv // block_v)](q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                               beta.contiguous(), state, out, T, BH, scale, DK=dk, DV=dv,
                                               BLOCK_V=block_v)
    return out


def delta_rule_step(q, k, v, g, beta, state):
    """One token for a batch of heads: q/k [..., dk] (q scaled by dk^-0.5), v [..., dv], g/beta [...],
    state [..., dk, dv] contiguous float32, updated in place -> y [..., dv]."""
    lead = tuple(g.shape)
    _check(q, k, v, g, beta, state, lead)
    if state.shape != (*lead, q.shape[-1], v.shape[-1]):
        raise ValueError(f"state {tuple(state.shape)} does not fit heads {lead}")
    bh = g.numel()
    return _launch_recurrent(q.reshape(1, bh, -1), k.reshape(1, bh, -1), v.reshape(1, bh, -1), g.reshape(1, bh),
                             beta.reshape(1, bh), state, 1, bh, 1.0).reshape(v.shape)


def delta_rule_recurrent(q, k, v, g, beta, state):
    """q/k [T, H, dk], v [T, H, dv], g/beta [T, H], state [H, dk, dv] float32 (updated in place)
    -> (y [T, H, dv], state)."""
    _check(q, k, v, g, beta, state, tuple(g.shape))
    T, H, dk = q.shape
    if state.shape != (H, dk, v.shape[-1]):
        raise ValueError(f"state {tuple(state.shape)} does not fit {H} heads")
    return _launch_recurrent(q, k, v, g, beta, state, T, H, dk ** -0.5), state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """Same contract as `delta_rule_recurrent`, computed `chunk` tokens at a time. The chunk's products
    are tl.dot tiles, at least 16 wide on the GPU: chunk, dk and dv must be at least 16."""
    _check(q, k, v, g, beta, state, tuple(g.shape))
    T, H, dk = q.shape
    dv = v.shape[-1]
    if state.shape != (H, dk, dv):
        raise ValueError(f"state {tuple(state.shape)} does not fit {H} heads")
    power_of_two(chunk, "chunk")
    if min(chunk, dk, dv) < 16:
        raise ValueError(f"the chunked form needs chunk, dk and dv >= 16, got {chunk}, {dk}, {dv}")
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if T and H:
        _chunked_kernel[(H, dv // BLOCK_V)](q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                            beta.contiguous(), state, out, T, H, dk ** -0.5, DK=dk, DV=dv,
                                            BLOCK_V=BLOCK_V, C=chunk)
    return out, state


@triton.jit
def _history(x_seq, s_seq, i, ch, mask, C, KERNEL: tl.constexpr):
    """Value i of a sequence's history, the state's KERNEL-1 rows then x's rows, for channels ch."""
    index = ch * 0 + i
    xv = tl.load(x_seq + (index - (KERNEL - 1)) * C + ch, mask=mask & (index >= KERNEL - 1), other=0.0)
    sv = tl.load(s_seq + index * C + ch, mask=mask & (index < KERNEL - 1), other=0.0)
    return tl.where(index >= KERNEL - 1, xv, sv)


@triton.jit
def _conv_kernel(x_ptr, w_ptr, state_ptr, out_ptr, new_state_ptr, T, C,
                 KERNEL: tl.constexpr, BLOCK_C: tl.constexpr):
    """x/out [B, T, C], w [C, KERNEL], state/new_state [B, KERNEL-1, C]; one program per (sequence, channel tile)."""
    b = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = ch < C
    x_seq, s_seq = x_ptr + b * T * C, state_ptr + b * (KERNEL - 1) * C
    for t in range(T):
        acc = tl.zeros((BLOCK_C,), tl.float32)
        for j in tl.static_range(KERNEL):
            w = tl.load(w_ptr + ch * KERNEL + j, mask=mask, other=0.0)
            acc += _history(x_seq, s_seq, t + j, ch, mask, C, KERNEL) * w
        tl.store(out_ptr + (b * T + t) * C + ch, acc * tl.sigmoid(acc), mask=mask)
    for r in tl.static_range(KERNEL - 1):         # the new state: the last KERNEL-1 values of the history
        tl.store(new_state_ptr + (b * (KERNEL - 1) + r) * C + ch, _history(x_seq, s_seq, T + r, ch, mask, C, KERNEL),
                 mask=mask)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU: x [..., T, C], weight [C, K], state [..., K-1, C] float32
    -> (y [..., T, C], new_state [..., K-1, C])."""
    c, kernel = weight.shape
    if (x.shape[-1] != c or state.shape != (*x.shape[:-2], kernel - 1, c)
            or any(t.dtype != torch.float32 for t in (x, weight, state))):
        raise ValueError(f"conv shapes do not fit: x {tuple(x.shape)} weight {tuple(weight.shape)} "
                         f"state {tuple(state.shape)} (all float32)")
    check_device(x, weight, state)
    T = x.shape[-2]
    batch = x.numel() // max(T * c, 1)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_state = torch.empty_like(state, memory_format=torch.contiguous_format)
    if batch and c:
        _conv_kernel[(batch, triton.cdiv(c, 64))](x.contiguous(), weight.contiguous(), state.contiguous(), out,
                                                  new_state, T, c, KERNEL=kernel, BLOCK_C=64)
    return out, new_state

