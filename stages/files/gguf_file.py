"""GGUF files: metadata, the tensor table, and each tensor's bytes exactly as stored.

The header is parsed here rather than by gguf-py's reader: every count and length is checked
against the bytes that remain before anything is allocated or looped over, so a damaged file
is refused at once with one line (a huge 64-bit count made the reader run for minutes), and
only plain values are kept. Tensor bytes are read when a stage asks for a tensor by name, so
a pipeline stage reads only its own layers. Split models (`NAME-00001-of-00003.gguf`, as
llama.cpp's gguf-split writes them) open from their first part.
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from raymoe.stages.files.direct_io import DIRECT_MIN, read_bytes
from raymoe.stages.errors import ModelFormatError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# value type -> (struct format, numpy dtype) of GGUF's scalar metadata types
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


def arch_key_reader(meta: dict, arch: str, where: str):
    """`key(name, default=None, positive=False)`: the value of `<arch>.<name>`, its default, or a
    ModelFormatError; `positive` asks for a positive integer (a value that is divided by)."""
    def key(name, default=None, positive=False):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelFormatError(f"{where}: missing metadata {arch}.{name}")
        if positive and (type(value) is not int or value <= 0):
            raise ModelFormatError(f"{where}: metadata {arch}.{name} must be a positive integer, got {value!r}")
        return value
    return key


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: int              # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]        # ggml order, fastest dimension first, trailing unit dimensions dropped
    path: str                     # the file (split part) that holds it
    data_offset: int
    n_bytes: int

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


_U64 = struct.Struct("<Q")


class _Header:
    """A bounds-checked cursor over the mapped header bytes."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos = buf, path, 0

    def fail(self, what: str):
        raise ModelFormatError(f"{self.path}: damaged or truncated GGUF file ({what} at byte {self.pos})")

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            self.fail(f"{n} bytes needed past the end")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, vtype: int):
        fmt = _SCALARS[vtype][0]
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def u32(self) -> int:
        return self.scalar(4)

    def u64(self) -> int:
        return self.scalar(10)

    def string(self) -> str:
        n = self.u64()
        start = self.take(n)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            self.fail("a string that is not UTF-8")

    def strings(self, count: int) -> list[str]:
        """count strings in a row: string() in one tight loop (a vocabulary holds ~200k of them)."""
        buf, end, pos, out = self.buf, len(self.buf), self.pos, []
        for _ in range(count):
            self.pos = pos
            if pos + 8 > end:
                self.fail("8 bytes needed past the end")
            n = _U64.unpack_from(buf, pos)[0]
            self.pos = pos = pos + 8
            if pos + n > end:
                self.fail(f"{n} bytes needed past the end")
            try:
                out.append(str(buf[pos:pos + n], "utf-8"))
            except UnicodeDecodeError:
                self.pos = pos + n
                self.fail("a string that is not UTF-8")
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.scalar(vtype)
        if vtype != _ARRAY:
            self.fail(f"unknown metadata value type {vtype}")
        item, count = self.u32(), self.u64()
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, count, start).tolist()
        if item == _STRING:
            if count * 8 > len(self.buf) - self.pos:     # each string needs at least its length field
                self.fail(f"an array of {count} strings longer than the file")
            return self.strings(count)
        if item == _ARRAY and count == 0:
            return []
        self.fail(f"an array of value type {item}")


def _parse(path: str) -> tuple[dict[str, Any], list[TensorInfo]]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = os.path.getsize(path)
    if size < 24:
        raise ModelFormatError(f"{path}: not a GGUF file ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        view = memoryview(buf)
        h = _Header(view, path)
        try:
            magic = bytes(view[h.take(4):4])
            if magic != GGUF_MAGIC:
                raise ModelFormatError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
            version = h.u32()
            if version not in (2, 3):
                h.fail(f"unsupported GGUF version {version}")
            n_tensors, n_kv = h.u64(), h.u64()
            if n_tensors + n_kv > size:       # every entry takes at least a byte
                h.fail(f"{n_tensors} tensors and {n_kv} metadata entries claimed")
            metadata = {}
            for _ in range(n_kv):
                key = h.string()
                metadata[key] = h.value(h.u32())
            raw_infos = []
            for _ in range(n_tensors):
                name, n_dims = h.string(), h.u32()
                if n_dims > 8:
                    h.fail(f"tensor {name} with {n_dims} dimensions")
                dims = tuple(h.u64() for _ in range(n_dims))
                raw_infos.append((name, dims, h.u32(), h.u64()))
            alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
            if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
                h.fail(f"general.alignment {alignment!r}")
            data_start = -(-h.pos // alignment) * alignment
        finally:
            view.release()     # before the map closes
    tensors = []
    for name, dims, ttype, offset in raw_infos:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise ModelFormatError(f"{path}: tensor {name} has unknown ggml type {ttype}") from None
        if not dims or any(d <= 0 for d in dims) or dims[0] % block:
            raise ModelFormatError(f"{path}: tensor {name} has invalid shape {list(dims)} for its type")
        n_elements = int(np.prod(dims, dtype=object))
        n_bytes = n_elements // block * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise ModelFormatError(f"{path}: truncated GGUF file (tensor {name} runs past the end)")
        # llama.cpp treats trailing unit dimensions as absent (an F32 file stores a vector as [n, 1])
        while len(dims) > 1 and dims[-1] == 1:
            dims = dims[:-1]
        tensors.append(TensorInfo(name, ttype, dims, path, start, n_bytes))
    return metadata, tensors


def split_parts(path: str) -> list[str]:
    """The files of a split model named by its first part, or [path]."""
    m = SPLIT_NAME.match(path)
    if not m:
        return [path]
    if int(m["no"]) != 1:
        raise ModelFormatError(f"{path}: a split model opens from its first part "
                               f"({m['prefix']}-00001-of-{m['count']}.gguf)")
    parts = [f"{m['prefix']}-{i:05d}-of-{m['count']}.gguf" for i in range(1, int(m["count"]) + 1)]
    missing = [p for p in parts if not os.path.isfile(p)]
    if missing:
        raise ModelFormatError(f"{path}: split model part {missing[0]} is missing")
    return parts


class GGUFFile:
    """A GGUF file as a tensor source (stages.files.loader.TensorSource)."""
    in_file_format = True       # weights are the file's bytes as read for them

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise ModelFormatError(f"{path}: no such file")
        self.path = path
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for part in split_parts(path):
            metadata, tensors = _parse(part)
            if part == path:
                self.metadata = {k: v for k, v in metadata.items() if not k.startswith("split.")}
            for t in tensors:
                if t.name in self.tensors:
                    raise ModelFormatError(f"{part}: tensor {t.name} appears twice")
                self.tensors[t.name] = t

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(f"{self.path}: GGUF has no general.architecture")
        return arch

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise ModelFormatError(f"{self.path}: missing tensor {name}")
        return self.tensors[name]

    def ggml_shape(self, name: str) -> tuple[int, ...]:
        """Shape in ggml order (fastest dimension first), as llama.cpp reports it."""
        return self.info(name).shape

    def raw(self, name: str, leading: range | None = None, loading=None) -> tuple[torch.Tensor, int]:
        """The tensor's bytes as stored, uint8 [..., rows, bytes per row] in torch order, and its ggml
        type; with `leading`, only that slice of the slowest dimension (the experts an expert actor
        holds: one contiguous range of the file); with `loading` (kernels.weights.Loading), large reads
        may still be running on return, as read_bytes leaves them.

        Read from the file rather than mapped: a stage's resident memory is then exactly its
        weights, and decode runs faster from it (see docs/memory.md)."""
        t = self.info(name)
        shape = t.torch_shape
        row_bytes = t.n_bytes // max(int(np.prod(shape[:-1], dtype=np.int64)), 1)
        raw_shape, first = (*shape[:-1], row_bytes), 0
        if leading is not None:
            if len(shape) < 2 or not 0 <= leading.start < leading.stop <= shape[0]:
                raise ModelFormatError(f"{self.path}: tensor {name} {list(shape)} has no slice {leading}")
            raw_shape, first = (len(leading), *raw_shape[1:]), leading.start
        per_leading = t.n_bytes // shape[0] if len(shape) > 1 else t.n_bytes
        data = read_bytes(t.path, t.data_offset + first * per_leading, int(np.prod(raw_shape, dtype=np.int64)), loading)
        if data is None:
            raise ModelFormatError(f"{t.path}: truncated GGUF file (tensor {name})")
        return data.view(raw_shape), t.tensor_type

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of its values in torch order, from the tensor table."""
        return self.info(name).torch_shape

    def stored_bytes(self, name: str, shape: tuple) -> int:
        """What a stage holds of the tensor as the file stores it: its bytes."""
        return self.info(name).n_bytes

    def prefetch(self, names) -> None:
        """Starts the kernel reading the small tensors among `names` into the page cache: they are read
        through it one at a time later, and each would otherwise wait for the disk behind the large reads
        (measured: 4.3 s of a 14 s load for Qwen3.5's ~500 small tensors)."""
        if not hasattr(os, "posix_fadvise"):
            return
        small: dict[str, list[TensorInfo]] = {}
        for name in names:
            t = self.tensors.get(name)
            if t is not None and t.n_bytes < DIRECT_MIN:
                small.setdefault(t.path, []).append(t)
        for path, infos in small.items():
            fd = os.open(path, os.O_RDONLY)
            try:
                for t in infos:
                    os.posix_fadvise(fd, t.data_offset, t.n_bytes, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def get(self, name: str) -> torch.Tensor:
        """Dequantised float32 tensor in torch order (slowest dimension first)."""
        from raymoe.kernels.dequant import dequantize

        t = self.info(name)
        raw, ttype = self.raw(name)
        if ttype == 0:     # F32: the bytes are the values
            return raw.view(torch.float32).reshape(t.torch_shape)
        try:
            out = dequantize(raw.reshape(-1, raw.shape[-1]), ttype)
        except NotImplementedError as e:
            raise ModelFormatError(f"{self.path}: tensor {name}: {e}") from None
        return out.reshape(t.torch_shape)
