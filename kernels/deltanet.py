"""Gated DeltaNet numerics: the causal depthwise conv and the gated delta rule.

Per V-head state S [dk, dv] (float32), per token:
    S <- exp(g) * S;  S <- S + k (x) ((v - S^T k) * beta);  y = S^T q / sqrt(dk)
`delta_rule_recurrent` runs it token by token (decode); `delta_rule_chunked` computes the
same thing 64 tokens at a time with the WY / triangular-solve form (prefill).
Inputs q/k must already be L2-normalised and expanded to one head per V head.

On CUDA the Triton kernels (kernels/triton/deltanet.py: same contracts; kernels/gpu_ops.py) take the head
sizes they fit (powers of two; the chunked form needs them and the chunk at least 16).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .gpu_ops import use_triton


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
        from .triton import deltanet
        return deltanet.causal_conv1d(x, weight.float(), state.float())
    kernel = weight.shape[1]
    full = torch.cat((state.to(x.dtype), x), dim=-2)                # [..., T+K-1, C]
    windows = full.unfold(-2, kernel, 1)                              # [..., T, C, K]
    y = (windows * weight.to(x.dtype)).sum(-1)
    return F.silu(y), full[..., full.shape[-2] - (kernel - 1):, :].clone()


def delta_rule_step(q, k, v, g, beta, state):
    """One token for a batch of heads: q/k [..., dk], v [..., dv], g/beta [...], state [..., dk, dv]
    contiguous (updated in place).

    Both reads of the state (k^T S, q^T S) come from one product with the old state, and the
    update `S <- exp(g) S + k delta^T` runs in place, so the state is read three times and
    written twice per token rather than materialising the outer product.
    """
    if _gpu("delta_step", q, v, state):
        from .triton import deltanet
        return deltanet.delta_rule_step(q.float(), k.float(), v.float(), g.float(), beta.float(), state)
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
    """Same contract as `delta_rule_recurrent`, computed chunk by chunk (WY representation)."""
    if _gpu("delta_rule", q, v, state) and min(q.shape[-1], v.shape[-1], chunk) >= 16:
        from .triton import deltanet
        return deltanet.delta_rule_chunked(q.float(), k.float(), v.float(), g.float(), beta.float(), state, chunk)
    T, H, dk = q.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    # -> [H, n_chunks, chunk, *] in float32; zero padding leaves the state untouched (beta = 0, g = 0).
    def prep(t, width):
        t = t.float().transpose(0, 1)
        t = F.pad(t, (0, 0, 0, pad)) if width else F.pad(t, (0, pad))
        return t.reshape(H, -1, chunk, width) if width else t.reshape(H, -1, chunk)
    q, k, v = prep(q * dk ** -0.5, dk), prep(k, dk), prep(v, dv)
    g, beta = prep(g, 0), prep(beta, 0)
    n_chunks = q.shape[1]

    cum = g.cumsum(-1)                                                # log decay from chunk start
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # Lower unit-triangular system (I + strictly_lower(beta k k^T decay)) solved once per chunk.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    lower = torch.tril(system, -1) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(lower, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay                          # causal in-chunk attention
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    S = state.float().clone()
    out = torch.empty(H, n_chunks, chunk, dv, device=q.device)
    for c in range(n_chunks):
        v_new = u[:, c] - w[:, c] @ S
        out[:, c] = q_dec[:, c] @ S + intra[:, c] @ v_new
        S = S * chunk_decay[:, c] + k_dec[:, c].transpose(-1, -2) @ v_new
    out = out.reshape(H, -1, dv)[:, :T].transpose(0, 1)
    return out, S
