"""RMSNorm variants. Statistics are always taken in float32."""
import torch
import torch.nn.functional as F

from .gpu_ops import use_triton
from .pointwise import silu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain `x / rms(x) * w` (GGUF convention: zero-centred weights already carry their +1)."""
    if use_triton("rms_norm", x) and x.dtype == torch.float32:
        from .triton import norms
        return norms.rms_norm(x, weight.float(), eps)
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm(x) * silu(gate)`: the output norm of a Gated DeltaNet head."""
    if use_triton("rms_norm", x) and x.dtype == torch.float32:
        from .triton import norms
        return norms.rms_norm(x, weight.float(), eps, gate.float())
    return (rms_norm(x, weight, eps).float() * silu(gate.float())).to(x.dtype)
