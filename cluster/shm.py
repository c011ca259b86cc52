"""The `shm` transport's ring: preallocated shared-memory slots between two processes of one node.

One ring per stage-to-stage edge. Its memory is a file in /dev/shm that both ends map: SLOTS slots, each a
64-byte header (sequence number, status, dtype, shape, byte length) followed by room for the largest
activation. The sender copies a tensor into the next slot, the receiver copies it out: two memcpys, no
pickling, no object store. Two named pipes synchronise them: `full` carries one byte per written slot
(sender -> receiver), `free` one byte per released slot (receiver -> sender; it starts with SLOTS bytes, so a
sender more than SLOTS messages ahead waits). A waiting end blocks in read() without spinning, and a peer
that dies closes its ends of the pipes, so the survivor's next read sees EOF (or its write EPIPE) at once
instead of waiting forever.

Lifecycle: the receiver creates the three files (`create`), the sender opens them and unlinks them
(`attach`); from then on the ring is held only by the two processes' mappings and descriptors, and the
kernel frees it when both have exited, however they end. Nothing stays in /dev/shm, even when a stage is
killed; `unlink` removes what a setup that failed half-way left.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import select
import struct

import torch

from raymoe.stages.errors import RaymoeError

# where the rings live: a tmpfs every stage of the node maps (RAYMOE_SHM_DIR names another, as where a
# container's /dev/shm is too small), read by the coordinator's process, which names the rings
SHM_DIR = os.environ.get("RAYMOE_SHM_DIR", "/dev/shm")
SLOTS = 4                       # messages a sender may be ahead of its receiver
HEADER = struct.Struct("<8q")   # seq, status, dtype code, ndim, shape[0..2], nbytes
HEADER_BYTES = 64               # keeps every slot's data 64-byte aligned
MAX_DIMS = 3
OK, FAILED, FAILED_OOM = 0, 1, 2
END = 3                         # a chain of decode steps ends here (cluster/chain.py)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8]


class RingError(RuntimeError):
    """The other end of a ring is gone, failed this step, or the ring lost step."""


def slot_stride(slot_bytes: int) -> int:
    return HEADER_BYTES + -(-slot_bytes // 64) * 64


def unlink(path: str):
    """Remove a ring's names (the memory itself lives on while either end has it mapped)."""
    for p in (path, path + ".full", path + ".free"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _blocking(fd: int) -> int:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


class Ring:
    """One end of a ring: `create` gives the receiving end, `attach` the sending one."""

    def __init__(self, path: str, slots: int, slot_bytes: int, data_fd: int, pipe_in: int, pipe_out: int):
        self.path, self.slots, self.slot_bytes = path, slots, slot_bytes
        self.stride = slot_stride(slot_bytes)
        try:
            self.mm = mmap.mmap(data_fd, slots * self.stride)
        finally:
            os.close(data_fd)          # the mapping keeps the memory
        self.pipe_in, self.pipe_out = pipe_in, pipe_out
        self.data = [torch.frombuffer(self.mm, dtype=torch.uint8, count=slot_bytes, offset=i * self.stride + HEADER_BYTES)
                     for i in range(slots)]
        self.count = 0                 # messages sent or received so far: the next one's sequence number

    @classmethod
    def create(cls, path: str, slots: int, slot_bytes: int) -> Ring:
        """The receiving end: make the file (its memory reserved now, so a full /dev/shm is an error here, not a
        SIGBUS later) and the pipes, and put SLOTS credits in `free`."""
        size = slots * slot_stride(slot_bytes)
        if not os.path.isdir(os.path.dirname(path)):
            raise RaymoeError(f"--transport shm needs {os.path.dirname(path)} (Linux shared memory), which this node "
                              f"lacks: use --transport gloo")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            os.mkfifo(path + ".full", 0o600)
            os.mkfifo(path + ".free", 0o600)
            full = _blocking(os.open(path + ".full", os.O_RDONLY | os.O_NONBLOCK))
            # read-write, so that opening it never waits for the sender (and the credits can be written now)
            free = os.open(path + ".free", os.O_RDWR)
            os.write(free, b"\0" * slots)
        except OSError as e:
            os.close(fd)
            unlink(path)
            if e.errno == 28:          # ENOSPC
                raise RaymoeError(f"no room in {SHM_DIR} for the shm transport's ring ({size / 2**20:.0f} MiB): "
                                  f"give {SHM_DIR} more room (docker: --shm-size) or use --transport gloo") from None
            raise
        return cls(path, slots, slot_bytes, fd, full, free)

    @classmethod
    def attach(cls, path: str, slots: int, slot_bytes: int) -> Ring:
        """The sending end: open what `create` made, then unlink the names (module doc)."""
        try:
            fd = os.open(path, os.O_RDWR)
            free = os.open(path + ".free", os.O_RDONLY)     # the receiver holds its write end: does not wait
            full = _blocking(os.open(path + ".full", os.O_WRONLY | os.O_NONBLOCK))
        finally:
            unlink(path)
        return cls(path, slots, slot_bytes, fd, free, full)

    def _wait(self, what: str):
        if not os.read(self.pipe_in, 1):
            raise RingError(f"the {what} stage is gone (shm ring {os.path.basename(self.path)})")

    def _signal(self, what: str):
        try:
            os.write(self.pipe_out, b"\1")
        except BrokenPipeError:
            raise RingError(f"the {what} stage is gone (shm ring {os.path.basename(self.path)})") from None

    def send(self, t: torch.Tensor, status: int = OK):
        """Copy t into the next slot (waiting while every slot is unread) and tell the receiver."""
        nbytes = t.numel() * t.element_size()
        if nbytes > self.slot_bytes:
            raise RaymoeError(f"an activation of {nbytes} bytes {tuple(t.shape)} does not fit the shm transport's "
                              f"slots of {self.slot_bytes} bytes (max batch tokens x hidden x 4)")
        if t.dim() > MAX_DIMS:
            raise ValueError(f"the shm ring carries tensors of at most {MAX_DIMS} dimensions, not {t.dim()}")
        self._wait("next")
        slot = self.count % self.slots
        if nbytes:
            self.data[slot][:nbytes].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
        shape = list(t.shape) + [0] * (MAX_DIMS - t.dim())
        HEADER.pack_into(self.mm, slot * self.stride, self.count, status, DTYPES.index(t.dtype), t.dim(), *shape, nbytes)
        self.count += 1
        self._signal("next")

    def send_end(self):
        """Tell the receiver that the steps of this call end here (no tensor follows)."""
        self.send(torch.empty(0), END)

    def send_failure(self, out_of_memory: bool = False):
        """Tell the receiver that this step failed here, so that it fails too instead of waiting; quiet when the
        receiver is gone."""
        try:
            self.send(torch.empty(0), FAILED_OOM if out_of_memory else FAILED)
        except RingError:
            pass

    def ready(self) -> bool:
        """Whether a message waits (or the sender is gone), so that recv() would not block."""
        return bool(select.select([self.pipe_in], [], [], 0)[0])

    def recv(self, end_ok: bool = False) -> torch.Tensor | None:
        """Wait for the next slot and copy it out (the slot is free again as soon as this returns). None for
        the end of a chain's steps, where end_ok; elsewhere that is out of step."""
        self._wait("previous")
        slot = self.count % self.slots
        seq, status, code, ndim, *rest = HEADER.unpack_from(self.mm, slot * self.stride)
        shape, nbytes = rest[:ndim], rest[-1]
        if seq != self.count:
            raise RingError(f"shm ring {os.path.basename(self.path)} out of step: message {seq}, expected {self.count}")
        out = torch.empty(shape, dtype=DTYPES[code])
        if nbytes:
            out.view(-1).view(torch.uint8).copy_(self.data[slot][:nbytes])
        self.count += 1
        self._signal("previous")
        if status == FAILED_OOM:
            raise MemoryError("the previous stage ran out of memory on this step")
        if status == END:
            if not end_ok:
                raise RingError(f"shm ring {os.path.basename(self.path)} out of step: a chain's end where a step "
                                "was due")
            return None
        if status != OK:
            raise RingError("the previous stage failed on this step")
        return out

    def close(self):
        self.data = []
        for fd in (self.pipe_in, self.pipe_out):
            try:
                os.close(fd)
            except OSError:
                pass
        self.pipe_in = self.pipe_out = -1
        try:
            self.mm.close()
        except BufferError:            # a tensor still views it: the mapping goes with the last one
            pass
