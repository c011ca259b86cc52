"""The thread policy, decided here only: how many torch threads an actor computes with (the --threads
default), what a worker process's environment must say before it loads torch, and when a step runs
on one thread. Every choice depends on settings and the step's size, never on timing or on the
pipeline degree, so outputs stay reproducible: the last bits of a product depend on the thread count.
"""
from __future__ import annotations

import contextlib
import os

import torch

from .dense import GEMV_MAX_ROWS
from .native import blas_has_own_threads


def default_threads() -> int:
    """Torch threads per actor when --threads is not given: cores / 4, whatever --pp or --ep is."""
    return max(1, (os.cpu_count() or 1) // 4)


def process_env(threads: int, dtype: str) -> dict[str, str]:
    """Environment variables for an actor that computes with `threads` torch threads in `dtype` mode;
    they only take effect when set before the process loads torch."""
    env = {"OPENBLAS_NUM_THREADS": str(threads)}
    if dtype != "int8" and blas_has_own_threads():
        # torch's OpenMP workers sleep between ops rather than spin on the cores BLAS needs
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


@contextlib.contextmanager
def torch_threads_for(n_rows: int):
    """Run a step of n_rows tokens with fewer torch threads where that is faster: when float32
    products of a few rows go to OpenBLAS's own threads (no compiled library), torch's other ops
    are too small to share out, so one torch thread keeps its workers from waking to compete with
    OpenBLAS (measured: batch-1 decode ~5-12% faster)."""
    if not blas_has_own_threads() or n_rows > GEMV_MAX_ROWS or torch.get_num_threads() == 1:
        yield
        return
    with one_torch_thread():
        yield


def loading_threads(mode: str):
    """Load weights on one torch thread, except in `--dtype int8` mode (which requantises every matrix
    at load). Loading moves bytes and computes next to nothing; with a second thread, the first op
    big enough to share out wakes an OpenMP worker, which under OMP_WAIT_POLICY=ACTIVE then spins
    for the rest of the load on the cores the reader threads and page faults need (measured: the
    15.4 GB Qwen3.5 file in 26 s, 21 s of it one worker spinning, against 9 s)."""
    return contextlib.nullcontext() if mode == "int8" else one_torch_thread()


@contextlib.contextmanager
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
