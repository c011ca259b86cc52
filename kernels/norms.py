"""RMSNorm variants. Statistics are always taken in float32.

On the CPU, float32 RMSNorm is one call of kernels/csrc/norms.c (the custom op `raymoe::rms_norm`, rms_norm_op
below); without a C compiler it is torch's, whose last bits differ."""
import ctypes
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native
from .gpu_ops import use_triton
from .ops import custom_op
from .pointwise import silu
# kernels/triton is imported inside the GPU paths, on first use: triton is optional where only the CPU runs

SOURCE = Path(__file__).parent / "csrc" / "norms.c"


@lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = native.load_source(SOURCE, fallback="RMSNorm runs as torch operations")
    if lib is not None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.raymoe_rms_norm.argtypes = [p, i, i, p, ctypes.c_float, p]
        lib.raymoe_rms_norm.restype = None
    return lib


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dimension, float32 (rms_norm_op's CPU implementation)."""
    lib = _library()
    if lib is None:
        return F.rms_norm(x, weight.shape, weight.float(), eps)
    x, w = x.contiguous(), weight.float().contiguous()
    y = torch.empty_like(x)
    k = x.shape[-1]
    if x.numel():
        lib.raymoe_rms_norm(x.data_ptr(), x.numel() // k, k, w.data_ptr(), eps, y.data_ptr())
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain `x / rms(x) * w` (GGUF convention: zero-centred weights already carry their +1)."""
    if x.dtype == torch.float32 and x.is_cpu and not torch.compiler.is_compiling():
        return cpu_rms_norm(x, weight, eps)     # the op's CPU implementation, without its dispatch (decode: 80 a step)
    return rms_norm_op(x.float(), weight, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm(x) * silu(gate)`: the output norm of a Gated DeltaNet head."""
    if use_triton("rms_norm", x) and x.dtype == torch.float32:
        from .triton import norms
        return norms.rms_norm(x, weight.float(), eps, gate.float())
    return (rms_norm(x, weight, eps).float() * silu(gate.float())).to(x.dtype)


@custom_op("rms_norm")
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., K] float32 times rsqrt(mean(x^2) + eps) times weight [K]."""
    return cpu_rms_norm(x, weight, eps)


@rms_norm_op.register_kernel("cuda")
def _(x, weight, eps):
    if use_triton("rms_norm", x):
        from .triton import norms as gpu
        return gpu.rms_norm(x, weight.float(), eps)
    return F.rms_norm(x, weight.shape, weight.float(), eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
