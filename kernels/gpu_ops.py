"""Which operations on CUDA tensors run as the Triton kernels of kernels/triton rather than as torch's
own operations. Block products always do (torch has no GGML formats); for the others it is a trade:
one Triton launch replaces several torch ones, but a Triton launch costs the host more, and at decode's
small sizes the host's launching is what a step waits for. tests/gpu/run.py measures both ways."""
from __future__ import annotations

import torch

# delta_rule: the recurrent and chunked forms replace a Python loop over tokens (prefill) with one launch
TRITON_OPS = {"delta_rule", "attention", "conv1d", "delta_step", "rms_norm", "rope", "routing"}


def use_triton(op: str, t: torch.Tensor) -> bool:
    return t.is_cuda and op in TRITON_OPS
