"""Compiled CPU kernels (kernels/csrc/few_rows.c): products of a few rows (float32 or int8
weights), and float32 matrix products on numpy's OpenBLAS driven from OpenMP threads.

Built with the machine's C compiler (`cc`, or $CC) for its own CPU (or $RAYMOE_MARCH, to test
the code paths of other CPUs) on first use and cached per source, compiler, flags and CPU under
$RAYMOE_CACHE/native (default ~/.cache/raymoe/native), so each Ray node builds its own. `_build`
also compiles the other kernel sources (kernels/blocks.py). The library runs its threads on the OpenMP runtime torch has loaded,
so it shares torch's thread count and workers; numpy's OpenBLAS is set to one thread and called
inside them (`sgemm`), so one pool of threads does all the work. The few-row kernels take float32 weights
with AVX2 or AVX-512, int8 ones with AVX-512 VNNI only (`int8_rows()`); without AVX2, `few_rows()` is
None and float32 products of every row count take the OpenBLAS path (`f32_gemm()`); with no compiler, or
RAYMOE_NATIVE=0, both are None and products stay with OpenBLAS's own threads and PyTorch.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch  # noqa: F401  (loads torch's OpenMP runtime before the library links to it)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "few_rows.c"
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]


def march() -> str:
    """The -march the libraries are built for: the machine's own CPU, or $RAYMOE_MARCH (e.g.
    x86-64, haswell) to build and test the code paths of other CPUs."""
    return os.environ.get("RAYMOE_MARCH", "native")


def _cache_dir() -> Path:
    root = os.environ.get("RAYMOE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "raymoe"))
    return Path(root) / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, source: Path = SOURCE, arch: str | None = None, extra: tuple[str, ...] = ()) -> Path:
    """source compiled to a shared library for -march=arch (default march()), cached by a key of
    everything that shapes the binary."""
    flags = [*FLAGS, f"-march={arch or march()}", *extra]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([source.read_text(), compiler, version, " ".join(flags),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed into place, so processes building at once never see half a file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, "-o", str(built), str(source)], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def compiler() -> str | None:
    """The C compiler to build with: $CC, cc or gcc."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@lru_cache(maxsize=None)
def load_source(source: Path, arch: str | None = None, extra: tuple[str, ...] = (),
                fallback: str = "torch computes instead") -> ctypes.CDLL | None:
    """The library built from `source` for -march=arch (default march()), or None where it can't be
    built or loaded here (the reason is logged once, with `fallback`: what runs instead)."""
    if os.environ.get("RAYMOE_NATIVE", "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found: %s", fallback)
        return None
    try:
        return ctypes.CDLL(str(_build(cc, source, arch, extra)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native kernels unavailable (%s): %s", e, fallback)
        return None


def _library() -> ctypes.CDLL | None:
    """kernels/csrc/few_rows.c built for this CPU (loaded once: load_source caches it), or None."""
    return load_source(SOURCE, fallback="float32 and few-row products use OpenBLAS and PyTorch (slower)")


@lru_cache(maxsize=None)
def few_rows() -> ctypes.CDLL | None:
    """The loaded library, or None where it can't be used here (the reason is logged once)."""
    return with_few_rows(_library())


def with_few_rows(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    """A build of few_rows.c set up for its float32 kernel, or None where that build has none."""
    if lib is None:
        return None
    if not lib.raymoe_few_rows_available():
        log.info("this CPU has neither AVX2 nor AVX-512: few-row products use OpenBLAS and PyTorch")
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.raymoe_f32_grouped.argtypes = [p, i, p, i, p, i, i, i, p, i]
    lib.raymoe_f32_grouped.restype = None
    return lib


@lru_cache(maxsize=None)
def int8_rows() -> ctypes.CDLL | None:
    """The library where it has the int8 kernel (AVX-512 VNNI), or None."""
    lib = few_rows()
    if lib is None or lib.raymoe_few_rows_available() < 2:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.raymoe_i8_grouped.argtypes = [p, i, i, p, p, i, p, i, i, i, p, i]
    lib.raymoe_i8_grouped.restype = ctypes.c_int
    return lib


@lru_cache(maxsize=None)
def f32_gemm() -> ctypes.CDLL | None:
    """The library with `sgemm` set, for raymoe_f32_gemm: float32 matrix products on numpy's OpenBLAS, switched
    to one thread and called on fixed slices from OpenMP threads, so that no sum depends on the thread count
    (OpenBLAS's own threads change its kernel, and so the last bits, with their number). Built on every CPU, with
    or without AVX-512. None without the library or where numpy's BLAS is another."""
    lib = _library()
    sgemm = _numpy_sgemm() if lib is not None else None
    if sgemm is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.raymoe_f32_gemm.argtypes = [p, p, i, i, p, i, i, p, i]
    lib.raymoe_f32_gemm.restype = None
    lib.sgemm = sgemm
    return lib


@lru_cache(maxsize=None)
def _numpy_sgemm() -> int | None:
    """The address of numpy's OpenBLAS cblas_sgemm (64-bit integers), its threads set to one; None
    when numpy uses another BLAS."""
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "libscipy_openblas64_*.so"))
    try:
        blas = ctypes.CDLL(libs[0])
        sgemm, set_threads = blas.scipy_cblas_sgemm64_, blas.scipy_openblas_set_num_threads64_
    except (IndexError, OSError, AttributeError):
        log.info("numpy's BLAS is not scipy-openblas64: float32 matrix products keep BLAS's own threads")
        return None
    set_threads.argtypes = [ctypes.c_int]
    set_threads(1)
    return ctypes.cast(sgemm, ctypes.c_void_p).value


def blas_has_own_threads() -> bool:
    """Whether float32 products run on BLAS's own threads (no library, or numpy not on
    scipy-openblas): then torch's OpenMP workers must sleep between ops (OMP_WAIT_POLICY=PASSIVE,
    set before torch loads) rather than spin on the cores BLAS needs (measured: float32 decode ~3x
    slower with spinning workers)."""
    return f32_gemm() is None
