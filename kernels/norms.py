"""RMSNorm variants. Statistics are always taken in float32."""
import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain `x / rms(x) * w` (GGUF convention: zero-centred weights already carry their +1)."""
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm(x) * silu(gate)`: the output norm of a Gated DeltaNet head."""
    return (rms_norm(x, weight, eps).float() * F.silu(gate.float())).to(x.dtype)
