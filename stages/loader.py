"""Open a model (GGUF file, HF directory or embedded default name) without loading its weights.

`open_model` reads config and tokenizer only; a `Stage` then pulls just the tensors of its
own layers through `ModelFiles.weight`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kernels.int8 import quantize_rows

from .errors import ModelFormatError
from .gguf_file import GGUFFile

EMBEDDED_MODELS = ("tiny-qwen35moe", "tiny-gptoss")


def architectures() -> dict[str, ModuleType]:
    from . import gptoss, qwen35moe
    return {qwen35moe.ARCH: qwen35moe, gptoss.ARCH: gptoss}


HF_MODEL_TYPES = {"qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe", "gpt_oss": "gpt-oss"}


@dataclass
class ModelFiles:
    path: str
    arch: ModuleType
    config: Any
    source: Any               # get(name) -> float32 tensor in GGUF conventions; has(name)
    tokenizer: Any

    @property
    def n_layers(self) -> int:
        return self.config.n_layers

    def expected_shapes(self, layers: range, first: bool, last: bool) -> dict:
        shapes = {}
        for i in layers:
            shapes.update(self.arch.layer_tensor_shapes(self.config, i))
        glob = self.arch.global_tensor_shapes(self.config)
        if first or (last and not self.source.has("output.weight")):
            shapes["token_embd.weight"] = glob["token_embd.weight"]
        if last:
            shapes["output_norm.weight"] = glob["output_norm.weight"]
            if self.source.has("output.weight"):
                shapes["output.weight"] = glob["output.weight"]
        return shapes

    def weight(self, name: str, shape: tuple, dtype: torch.dtype, int8: bool = False):
        """The tensor in `dtype`; with int8, a weight matrix comes as an Int8Weight instead when
        the int8 kernel can take it (kernels/int8.py). Biases stay float: they are added, not multiplied."""
        t = self.source.get(name)
        if tuple(t.shape) != tuple(shape):
            raise ModelFormatError(f"{self.path}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        q = quantize_rows(t) if int8 and name.endswith(".weight") else None
        return q if q is not None else t.to(dtype).contiguous()


def resolve_model_path(model: str) -> str:
    if model in EMBEDDED_MODELS:
        from deploy.make_tiny import embedded_model_path
        return embedded_model_path(model)
    if not os.path.exists(model):
        raise ModelFormatError(f"{model}: no such file or directory (and not one of {', '.join(EMBEDDED_MODELS)})")
    return model


def open_model(model: str) -> ModelFiles:
    from .tokenizer import Tokenizer

    path = resolve_model_path(model)
    archs = architectures()
    if os.path.isdir(path):
        from .safetensors_dir import SafetensorsDir
        files = SafetensorsDir(path)
        model_type = files.config.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise ModelFormatError(f"{path}: unknown architecture (config.json model_type {model_type!r}; "
                                   f"supported: {', '.join(sorted(HF_MODEL_TYPES))})")
        arch = archs[HF_MODEL_TYPES[model_type]]
        config = arch.config_from_hf(files.config, path)
        source = arch.hf_weights(files, config)
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        gguf = GGUFFile(path)
        if gguf.architecture not in archs:
            raise ModelFormatError(f"{path}: unknown architecture {gguf.architecture!r} "
                                   f"(supported: {', '.join(sorted(archs))})")
        arch = archs[gguf.architecture]
        config = arch.config_from_gguf(gguf.metadata, path)
        source = gguf
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    return ModelFiles(path=path, arch=arch, config=config, source=source, tokenizer=tokenizer)
