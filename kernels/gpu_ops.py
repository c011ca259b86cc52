"""Which operations on CUDA tensors run as the Triton kernels of kernels/triton rather than as torch's
own operations. Block products always do (torch has no GGML formats); for the others it is a trade:
one Triton launch replaces several torch ones, but a Triton launch costs the host more, and at decode's
small sizes the host's launching is what a step waits for. tests/gpu/run.py measures both ways."""
from __future__ import annotations

import torch

# Measured on an H200 (tests/gpu/run.py, batch-1 decode of the full-size synthetic files): torch for every
# op but these ran at 33.1 tok/s (gpt-oss-20b) and 12.8 (Qwen3.5-35B-A3B), Triton for every op at 13.6
# and 6.5. delta_rule stays: its recurrent and chunked forms replace a Python loop over a prompt's tokens.
# The others ("attention", "conv1d", "delta_step", "rms_norm", "rope", "routing") are kept for when
# decode steps are replayed as CUDA graphs, where launch cost no longer counts.
TRITON_OPS = {"delta_rule"}


def use_triton(op: str, t: torch.Tensor) -> bool:
    return t.is_cuda and op in TRITON_OPS
