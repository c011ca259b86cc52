"""The thread policy, decided here only: how many torch threads an actor computes with (the --threads
default), what a worker process's environment must say before it loads torch, and when a step runs
on one thread. Outputs do not depend on the thread count (every kernel computes each output in a
fixed order, and kernels/pointwise.py keeps torch's pointwise ops so; tests/kernels/test_threads.py checks
it), so the count is free to follow the machine: by default the stages that compute at once on a
node share all of its cores, and a stage whose turn it is alone takes them all.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch

from .dense import GEMV_MAX_ROWS
from .native import blas_has_own_threads


def node_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # not on Linux
        return os.cpu_count() or 1


# A step that moves fewer weight bytes than this (tokens x the stage's weight bytes) runs on one thread:
# its parallel regions are too short to pay for waking the others (measured: the 7 MB embedded model's
# decode at PP=2 on 2 busy cores, 57 tok/s on one thread per stage against 8 on two).
PARALLEL_MIN_BYTES = 256 << 20


def share_of_cores(cores: int, stages_here: int, computing: int, work_bytes: int | None = None) -> int:
    """Threads for a stage when `computing` micro-batches run at once in a pipeline that has
    `stages_here` stages on this node of `cores` cores: at most that many of them compute at once
    here, and they share the cores evenly (a stage alone takes every core). A step of less than
    PARALLEL_MIN_BYTES of `work_bytes` takes one."""
    if work_bytes is not None and work_bytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, cores // max(1, min(stages_here, computing)))


def process_env(threads: int | None, dtype: str) -> dict[str, str]:
    """Environment variables for an actor that computes with `threads` torch threads (None: its
    node's share, see share_of_cores) in `dtype` mode; they only take effect when set before the
    process loads torch."""
    env = {"OPENBLAS_NUM_THREADS": str(threads)} if threads else {}
    if dtype != "int8" and blas_has_own_threads():
        # torch's OpenMP workers sleep between ops rather than spin on the cores BLAS needs
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def release_openmp_workers() -> bool:
    """End this process's OpenMP worker threads now (the next parallel region starts them again), so that
    none spins on after a step: libgomp's workers spin up to 300,000 times (milliseconds) before they sleep,
    on the cores another stage of the pipeline computes with next. A stage sharing its node calls this after
    every step, and keeps the long spin inside its step, where it spares a wake-up at every parallel region.
    False where the OpenMP runtime has no omp_pause_resource_all (OpenMP 5.0)."""
    pause = _omp_pause()
    return pause is not None and pause(1) == 0      # 1: omp_pause_soft


@functools.lru_cache(maxsize=None)
def _omp_pause():
    try:    # the runtime torch loaded (one copy per process: the compiled kernels link the same)
        return ctypes.CDLL(None).omp_pause_resource_all
    except AttributeError:
        return None


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
