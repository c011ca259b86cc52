"""Reading a file's bytes into fresh memory fast: large reads go straight from the disk into the
tensor's own pages (O_DIRECT, page-aligned buffers faulted in ahead on a second thread), smaller
ones through the page cache; reads may run on background threads until their load waits
(kernels.weights.Loading).
"""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import torch

DIRECT_ALIGN = 4096          # O_DIRECT offsets, lengths and buffer addresses: multiples of this
DIRECT_CHUNK = 32 << 20      # bytes per direct read
DIRECT_MIN = 4 << 20         # smaller reads go through the page cache
DIRECT_IN_FLIGHT = 2         # direct reads waiting on the disk at once (two read faster than one here)
MADV_POPULATE_WRITE = 23     # Linux 5.14+: fault pages in without writing them from user space


class _Threads:
    """Reader and page-toucher threads, made on first use and kept (a stage reads hundreds of tensors)."""
    readers: ThreadPoolExecutor | None = None
    toucher: ThreadPoolExecutor | None = None

    @classmethod
    def get(cls) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        if cls.readers is None:
            cls.readers = ThreadPoolExecutor(DIRECT_IN_FLIGHT, thread_name_prefix="raymoe-read")
            cls.toucher = ThreadPoolExecutor(1, thread_name_prefix="raymoe-touch")
        return cls.readers, cls.toucher


def read_bytes(path: str, offset: int, nbytes: int, loading=None) -> torch.Tensor | None:
    """nbytes of the file from offset on, as a new uint8 tensor; None if the file ends first.

    Large reads go straight from the disk into the tensor's memory (O_DIRECT): no copy, and the page
    cache is not filled with a second copy of the weights, which a 24 GB machine holding 15 GB of them
    has no room for. Where the file system refuses O_DIRECT, reads go through the cache.

    With `loading` (a kernels.weights.Loading), direct reads run on background threads that it waits
    for: the bytes are there (and the file long enough) once loading.wait() returns True. The next
    tensors' pages are then prepared while the disk still fills this one's."""
    if nbytes >= DIRECT_MIN and hasattr(os, "O_DIRECT"):
        return _read_direct(path, offset, nbytes, loading)
    out = torch.empty(nbytes, dtype=torch.uint8)
    with open(path, "rb") as f:
        f.seek(offset)
        return out if f.readinto(out.numpy()) == nbytes else None


def _read_direct(path: str, offset: int, nbytes: int, loading) -> torch.Tensor | None:
    """Reads the aligned pages around [offset, offset + nbytes) into one buffer and returns the view of
    the asked bytes (at most 8 KB more memory than asked). Each chunk's pages are faulted in before the
    disk fills them, on two threads: on a virtual machine the first touch of fresh memory costs as much
    as the disk (measured here: the 15.4 GB Qwen3.5 file in 9-19 s, against 22-28 s through a bounce
    buffer copied out, and 14-23 s letting the reads fault the pages in)."""
    pos = offset - offset % DIRECT_ALIGN
    skip = offset - pos
    length = -(-(skip + nbytes) // DIRECT_ALIGN) * DIRECT_ALIGN
    buffer = torch.empty(length + DIRECT_ALIGN, dtype=torch.uint8)
    lead = -buffer.data_ptr() % DIRECT_ALIGN
    pages = buffer[lead:lead + length]
    view = memoryview(pages.numpy())
    for start in range(0, length, DIRECT_CHUNK):
        size = min(DIRECT_CHUNK, length - start)
        _touch(pages[start:start + size])
        read = (path, view[start:start + size], pos + start, min(size, skip + nbytes - start))
        if loading is not None:
            loading.defer(_Threads.get()[0].submit(_read_chunk, *read))
        elif not _read_chunk(*read):      # here, not behind the background reads
            return None
    return pages[skip:skip + nbytes]


def _read_chunk(path: str, view: memoryview, pos: int, need: int) -> bool:
    """Reads view from pos on; whether at least `need` bytes came (the asked ones in this chunk)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [view], pos) >= need
        finally:
            os.close(fd)
    except OSError:         # a file system that refuses direct reads, at open or (EINVAL) at read
        with open(path, "rb", buffering=0) as f:
            return os.preadv(f.fileno(), [view], pos) >= need


_libc = None


def _touch(pages: torch.Tensor) -> None:
    """Faults the (page-aligned) pages in, half on the toucher thread; where madvise can't, writes them."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    half = len(pages) // 2 // DIRECT_ALIGN * DIRECT_ALIGN
    other = _Threads.get()[1].submit(_libc.madvise, pages.data_ptr() + half, len(pages) - half, MADV_POPULATE_WRITE)
    mine = _libc.madvise(pages.data_ptr(), half, MADV_POPULATE_WRITE)
    if other.result() or mine:        # e.g. EINVAL before Linux 5.14
        pages.fill_(0)
