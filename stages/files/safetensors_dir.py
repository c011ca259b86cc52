"""Lazy access to an HF checkpoint directory: config.json plus (sharded) safetensors.

Tensors are read one at a time through safetensors' memory map, so a stage that asks
only for its own layers never reads the others.
"""
from __future__ import annotations

import json
import math
import os

import torch

from raymoe.stages.errors import ModelFormatError


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def hf_key_reader(hf: dict, where: str):
    """`key(name, default=None)`: the value of config.json's `name`, its default, or a ModelFormatError."""
    def key(name, default=None):
        value = hf.get(name, default)
        if value is None:
            raise ModelFormatError(f"{where}: config.json has no {name}")
        return value
    return key


class SafetensorsDir:
    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        self.config = read_json(os.path.join(path, "config.json"))
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelFormatError(f"{index_path}: no weight_map")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise ModelFormatError(f"{path}: no .safetensors files")
            weight_map = None
        self._handles = {}
        self.file_of: dict[str, str] = {}
        for name in files:
            full = os.path.join(path, os.path.basename(name))
            try:
                handle = safe_open(full, framework="pt")
            except FileNotFoundError:
                raise ModelFormatError(f"{full}: shard listed in the index is missing") from None
            except Exception as e:
                raise ModelFormatError(f"{full}: not a readable safetensors file ({e})") from None
            self._handles[name] = handle
            for key in handle.keys():
                self.file_of[key] = name
        if weight_map is not None:
            missing = [k for k, f in weight_map.items() if self.file_of.get(k) != f]
            if missing:
                raise ModelFormatError(f"{path}: tensor {missing[0]} listed in the index is not in {weight_map[missing[0]]}")

    def has(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise ModelFormatError(f"{self.path}: missing tensor {name}")
        try:
            return self._handles[self.file_of[name]].get_tensor(name)
        except Exception as e:
            raise ModelFormatError(f"{self.path}: tensor {name} cannot be read ({e})") from None


class HFWeights:
    """A family's view of an HF checkpoint as a tensor source (stages.files.loader.TensorSource): a subclass gives
    `get(name)`, the tensor under its GGUF name in the GGUF conventions, as float32 values, and `raw` for
    what the checkpoint holds in a GGML type. Only the LM head may be absent (tied to the embedding)."""
    in_file_format = False      # tensors are made for the stage, not the file's bytes

    def __init__(self, files: SafetensorsDir, cfg):
        self.files, self.cfg = files, cfg

    def _hf(self, name: str) -> torch.Tensor:
        return self.files.get(name).float()

    def has(self, name: str) -> bool:
        return self.files.has("lm_head.weight") if name == "output.weight" else True

    def raw(self, name: str, experts: range | None = None, loading=None) -> tuple[torch.Tensor, int] | None:
        """None: the checkpoint holds the tensor's values only (get)."""
        return None

    def shape(self, name: str) -> None:
        """Unknown until read: the family's adapter may split or reorder the checkpoint's tensors."""
        return None

    def stored_bytes(self, name: str, shape: tuple) -> int:
        return 4 * math.prod(shape)         # float32 values

    def prefetch(self, names) -> None:
        pass
