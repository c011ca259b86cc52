"""Rotary embedding applied on the GPU: NeoX rotate-half pairing on the first rotary_dim values of
each head, from the cos/sin tables kernels/rope.py makes (plain, YaRN with its attention factor
folded into the tables, partial rotary). The tables are [T, rotary_dim] per step and shared by
every layer; this kernel is the per-layer part, one program per (token, head)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_device


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, D, HALF, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    base = (t * H + tl.program_id(1)) * D
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    x1 = tl.load(x_ptr + base + i, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + base + HALF + i, mask=mask, other=0.0)
    c = tl.load(cos_ptr + t * 2 * HALF + i, mask=mask, other=0.0)
    s = tl.load(sin_ptr + t * 2 * HALF + i, mask=mask, other=0.0)
    # as apply_rope: rot * cos + cat(-x2, x1) * sin (cos/sin repeat over the two halves)
    tl.store(out_ptr + base + i, x1 * c + (-x2) * s, mask=mask)
    tl.store(out_ptr + base + HALF + i, x2 * c + x1 * s, mask=mask)
    rest = 2 * HALF + tl.arange(0, BLOCK)
    for start in range(0, D - 2 * HALF, BLOCK):       # the values past rotary_dim pass through
        r = rest + start
        tl.store(out_ptr + base + r, tl.load(x_ptr + base + r, mask=r < D), mask=r < D)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x float32 [T, H, D]; cos/sin float32 [T, rotary_dim] (kernels.rope.rope_cos_sin) -> rotated copy of x."""
    t, h, d = x.shape
    rd = cos.shape[-1]
    if (cos.shape != (t, rd) or sin.shape != (t, rd) or rd % 2 or rd > d
            or x.dtype != torch.float32 or cos.dtype != torch.float32 or sin.dtype != torch.float32):
        raise ValueError(f"rope needs float32 x [T, H, D] and cos/sin [T, rotary_dim <= D, even], got "
                         f"{x.dtype} {tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    check_device(x, cos, sin)
    x = x.contiguous()
    out = torch.empty_like(x)
    if t and h:
        _rope_kernel[(t, h)](x, cos.contiguous(), sin.contiguous(), out, h, d, rd // 2,
                             BLOCK=triton.next_power_of_2(max(rd // 2, 1)))
    return out
