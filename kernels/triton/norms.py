"""RMSNorm over the last dimension, statistics in float32 (kernels/norms.py): plain, and gated by
silu(gate) (the output norm of a Gated DeltaNet head). One program per row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_device


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, gate_ptr, out_ptr, D, eps, BLOCK: tl.constexpr, GATED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    mask = d < D
    x = tl.load(x_ptr + row * D + d, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps) * tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        gate = tl.load(gate_ptr + row * D + d, mask=mask, other=0.0).to(tl.float32)
        y = y * (gate * tl.sigmoid(gate))
    tl.store(out_ptr + row * D + d, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """`x / rms(x) * weight` over the last dimension (times silu(gate) when given, gate shaped as x)."""
    d = x.shape[-1]
    if weight.shape != (d,) or (gate is not None and gate.shape != x.shape):
        raise ValueError(f"weight {tuple(weight.shape)} / gate {None if gate is None else tuple(gate.shape)} "
                         f"do not fit x {tuple(x.shape)}")
    check_device(x, weight, gate)
    x = x.contiguous()
    out = torch.empty_like(x)
    rows = x.numel() // d if d else 0
    if rows:
        gate_arg = gate.contiguous() if gate is not None else x       # not read when GATED is off
        _rms_norm_kernel[(rows,)](x, weight.contiguous(), gate_arg, out, d, eps, BLOCK=triton.next_power_of_2(d),
                                  GATED=gate is not None)
    return out
