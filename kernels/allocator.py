"""glibc's malloc set to keep a step's freed buffers for the next step instead of handing them back.

By default glibc serves a block past its dynamic mmap threshold with a fresh mapping, and gives the heap's free top
back to the kernel once it passes twice that threshold. A prefill step allocates and frees tens to hundreds of MB
(activations, attention scores, products' outputs), so every step had the kernel map, fault in, zero and unmap them
page by page: on a 2-core host, about 30% of a 512-token prefill of gpt-oss-20b (docs/perf-log.md). Fixed thresholds
keep blocks up to 32 MB (glibc's ceiling for the threshold) in the heap and up to 256 MB of its free top, enough
for a 512-token step; the process keeps that much more memory between steps.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # mallopt's parameters (malloc.h)
HEAP_BLOCKS_UP_TO = 32 << 20
FREE_TOP_KEPT = 256 << 20


def keep_freed_memory() -> bool:
    """Sets this process's malloc thresholds (above); False where there is no glibc mallopt to set them."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO) == 1 and mallopt(M_TRIM_THRESHOLD, FREE_TOP_KEPT) == 1
    if not done:
        log.info("malloc's thresholds could not be set: freed buffers go back to the kernel")
    return done
