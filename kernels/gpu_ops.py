"""Which operations on CUDA tensors run as the Triton kernels of kernels/triton rather than as torch's
own operations. Block products always do (torch has no GGML formats); for the others it is a trade:
one Triton launch replaces several torch ones, but a Triton launch costs the host more, and at decode's
small sizes the host's launching is what a step waits for. tests/gpu/run.py measures both ways."""
from __future__ import annotations

import os

import torch

# Decode steps replayed as CUDA graphs (stages/runtime/decode_graph.py); RAYMOE_CUDA_GRAPHS=0 runs them eagerly.
CUDA_GRAPHS = os.environ.get("RAYMOE_CUDA_GRAPHS", "1") != "0"
ALL_OPS = {"delta_rule", "attention", "conv1d", "delta_step", "rms_norm", "rope", "routing"}
# Measured on an H200 (tests/gpu/run.py, batch-1 decode of the full-size synthetic files, 2026-12-04, one
# run, before the decode attention kernel): eager steps, torch for every op but delta_rule 17.5 tok/s
# (gpt-oss-20b) and 10.0 (Qwen3.5-35B-A3B), Triton for every op 7.0 and 4.3 (the host's launching is what
# such a step waits for); CUDA graphs, Triton for every op 56.6 and 40.7, torch for the small ops 46.6 and
# 31.5. Under graphs the Triton kernels also keep the eager step's bits: the attention kernel adds nothing
# for the empty rows a graph reads past a cache's end, where torch's softmax sums in another order.
# delta_rule always: its recurrent and chunked forms replace a Python loop over a prompt's tokens.
TRITON_OPS = set(ALL_OPS) if CUDA_GRAPHS else {"delta_rule"}


def use_triton(op: str, t: torch.Tensor) -> bool:
    return t.is_cuda and op in TRITON_OPS
