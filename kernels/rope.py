"""Rotary position embeddings: NeoX rotate-half pairing on a leading slice of each head.

The multi-section form (Qwen's interleaved M-RoPE) assigns each frequency to one of
the position components (time, height, width); with text-only positions all
components are equal and it reduces to plain partial RoPE.
"""
from __future__ import annotations

import ctypes
import math
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from . import native
from .gpu_ops import use_triton
from .ops import custom_op

SOURCE = Path(__file__).parent / "csrc" / "rope.c"


def inv_frequencies(base: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def section_ids(sections: list[int], n_freq: int, interleaved: bool = True) -> torch.Tensor:
    """Which position component (0=t, 1=h, 2=w) drives each frequency.

    Interleaved: frequency j belongs to h when j % 3 == 1 and j < 3*sections[1], to w when
    j % 3 == 2 and j < 3*sections[2], else to t. Contiguous: sections are consecutive runs.
    """
    ids = torch.zeros(n_freq, dtype=torch.long)
    if interleaved:
        j = torch.arange(n_freq)
        for comp in (1, 2):
            if comp < len(sections):
                ids[(j % 3 == comp) & (j < 3 * sections[comp])] = comp
    else:
        start = 0
        for comp, n in enumerate(sections[:3]):
            ids[start:start + n] = comp
            start += n
    return ids


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scale: float = 1.0,
                 sections: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, rotary_dim] for positions [T] (text) or [3, T] (multi-section)."""
    if positions.dim() == 1:
        freqs = positions.float()[:, None] * inv_freq[None, :]
    else:
        assert sections is not None, "multi-component positions need section ids"
        per_freq_pos = positions.float()[sections]          # [n_freq, T]
        freqs = per_freq_pos.T * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scale, emb.sin() * attention_scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of every head of x [T, H, D]; the rest pass through."""
    if use_triton("rope", x) and x.dtype == torch.float32:
        from .triton import rope as gpu      # on first use: triton is optional where only the CPU runs
        return gpu.apply_rope(x, cos.float(), sin.float())
    if x.dtype == torch.float32 and x.dim() == 3 and cos.dtype == sin.dtype == torch.float32:
        return rope_op(x, cos, sin)
    return torch_rope(x, cos, sin)


@lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = native.load_source(SOURCE, None, ("-ffp-contract=off",), fallback="RoPE runs as torch operations")
    if lib is not None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.raymoe_rope.argtypes = [p, i, i, i, p, p, i, p]
        lib.raymoe_rope.restype = None
    return lib


def cpu_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope_op's CPU implementation: one call of kernels/csrc/rope.c, the bits of torch_rope (which runs
    where there is no C compiler)."""
    lib = _library()
    T, H, k = x.shape
    rd = cos.shape[-1]
    if lib is None or rd % 2 or rd > k or cos.shape != (T, rd) or sin.shape != (T, rd):
        return torch_rope(x, cos, sin)
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        lib.raymoe_rope(x.data_ptr(), T, H, k, cos.data_ptr(), sin.data_ptr(), rd, y.data_ptr())
    return y


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope as torch operations."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


@custom_op("rope")
def rope_op(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX rotary embedding of the first cos.shape[-1] values of each head: x [T, H, D] float32, cos and sin
    [T, rd] -> [T, H, D]."""
    return cpu_rope(x, cos, sin)


@rope_op.register_kernel("cuda")
def _(x, cos, sin):
    return torch_rope(x, cos, sin)


@rope_op.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)


def yarn_inv_frequencies(base: float, rotary_dim: int, factor: float, original_context: int,
                         beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True,
                         attention_factor: float | None = None) -> tuple[torch.Tensor, float]:
    """YaRN frequencies and cos/sin scale, computed exactly as transformers' `_compute_yarn_parameters`.

    Frequencies below the correction range are interpolated (divided by `factor`), those above are
    kept, and a linear ramp blends the two in between. `truncate` rounds the range outwards to whole
    dimensions (llama.cpp always does; gpt-oss's config says not to). The attention factor, when not
    given, is `0.1 * ln(factor) + 1`; it multiplies cos and sin.
    """
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original_context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001       # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)
