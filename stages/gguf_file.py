"""GGUF access built on gguf-py's reader.

The reader parses metadata and the tensor table once; only plain values and each tensor's
type, shape and place in the file are kept (the reader's own objects take ~45 MB for a 32k
vocabulary). Tensor bytes are read when a stage asks for a tensor by name, so a pipeline
stage reads only its own layers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import ModelFormatError

GGUF_MAGIC = b"GGUF"


def metadata_dict(reader) -> dict[str, Any]:
    """GGUF key/value metadata as plain Python values (str, int, float, bool, lists)."""
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, np.generic):
            value = value.item()
        out[name] = value
    return out


def arch_key_reader(meta: dict, arch: str, where: str):
    """`key(name, default=None)`: the value of `<arch>.<name>`, its default, or a ModelFormatError."""
    def key(name, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelFormatError(f"{where}: missing metadata {arch}.{name}")
        return value
    return key


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: Any              # gguf.GGMLQuantizationType
    shape: tuple[int, ...]        # ggml order, fastest dimension first
    data_offset: int
    n_bytes: int


class GGUFFile:
    def __init__(self, path: str):
        import gguf

        if not os.path.isfile(path):
            raise ModelFormatError(f"{path}: no such file")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelFormatError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        try:
            reader = gguf.GGUFReader(path, "r")
        except Exception as e:  # gguf-py raises assorted errors on damaged files
            raise ModelFormatError(f"{path}: damaged or truncated GGUF file ({type(e).__name__}: {e})") from None
        self.path = path
        self.metadata = metadata_dict(reader)
        self.tensors = {t.name: TensorInfo(t.name, t.tensor_type, tuple(int(x) for x in t.shape), int(t.data_offset),
                                           int(t.n_bytes)) for t in reader.tensors}
        self._check_bounds()

    def _check_bounds(self):
        size = os.path.getsize(self.path)
        for t in self.tensors.values():
            if t.data_offset + t.n_bytes > size:
                raise ModelFormatError(f"{self.path}: truncated GGUF file (tensor {t.name} runs past the end)")

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(f"{self.path}: GGUF has no general.architecture")
        return arch

    def has(self, name: str) -> bool:
        return name in self.tensors

    def ggml_shape(self, name: str) -> tuple[int, ...]:
        """Shape in ggml order (fastest dimension first), as llama.cpp reports it."""
        return self.tensors[name].shape

    def get(self, name: str) -> torch.Tensor:
        """Dequantised float32 tensor in torch order (slowest dimension first).

        Bytes are read from the file rather than through the mmap, so a stage's resident memory
        is its weights, not its weights plus the mapped file pages it touched.
        """
        from gguf import GGMLQuantizationType

        from kernels.dequant import dequantize

        if name not in self.tensors:
            raise ModelFormatError(f"{self.path}: missing tensor {name}")
        t = self.tensors[name]
        shape = tuple(reversed(self.ggml_shape(name)))
        if t.tensor_type == GGMLQuantizationType.F32:
            out = torch.empty(shape, dtype=torch.float32)
            self._read_into(t, out.view(torch.uint8).reshape(-1))
            return out
        rows = max(1, int(np.prod(shape[:-1])))
        raw = torch.empty(rows, t.n_bytes // rows, dtype=torch.uint8)
        self._read_into(t, raw.reshape(-1))
        try:
            out = dequantize(raw, t.tensor_type)
        except NotImplementedError as e:
            raise ModelFormatError(f"{self.path}: tensor {name}: {e}") from None
        return out.reshape(shape)

    def _read_into(self, t, buf: torch.Tensor):
        with open(self.path, "rb") as f:
            f.seek(t.data_offset)
            if f.readinto(buf.numpy()) != t.n_bytes:
                raise ModelFormatError(f"{self.path}: truncated GGUF file (tensor {t.name})")
