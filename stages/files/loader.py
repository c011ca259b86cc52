"""Open a model (GGUF file, HF directory or embedded default name) without loading its weights.

`open_model` reads config and tokenizer only; a `Stage` then pulls just the tensors of its
own layers through `ModelFiles.weight`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from raymoe.kernels.int8 import quantize_rows
from raymoe.kernels.weights import BLOCK_TYPES, F32, BlockWeight, ConcatWeight, DenseWeight, Loading, cat_weights
from raymoe.models import EMBEDDED, embedded_model_path

from raymoe.stages.errors import ModelFormatError
from raymoe.stages.families.contract import Family, global_tensor_shapes
from raymoe.stages.families.registry import find_family
from raymoe.stages.files.gguf_file import GGUFFile

EMBEDDED_MODELS = tuple(EMBEDDED)

# --dtype: how weight matrices compute. Activations are float32 in every mode.
MODES = {
    "auto": "each weight in its file's format; quantised ones take 8-bit activations in few-row products",
    "float32": "exact: float32 activations against the exactly dequantised weight values",
    "int8": "every weight matrix requantised to int8 rows at load",
}


def mode_device_error(mode: str, device: str) -> str | None:
    """Why --dtype `mode` cannot run on --device `device`, or None (decided here only)."""
    if str(device).startswith("cuda") and mode == "int8":
        return "--dtype int8 is a CPU mode (int8 rows); with --device cuda use auto or float32"
    return None


# llama.cpp's GGUF keys of sampling defaults (gguf.Keys.General.SAMPLING_*) -> SamplingParams fields
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                      "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


def sampling_defaults(path: str, metadata: dict | None = None) -> dict:
    """The sampling defaults a model gives: an HF directory's generation_config.json (temperature, top_p,
    top_k, min_p, repetition_penalty, as vLLM reads them), a GGUF file's general.sampling.* keys. Values
    that a request could not hold are left out with a warning (stages.text.sampling_params.model_defaults)."""
    from raymoe.stages.text.sampling_params import model_defaults
    if metadata is None:
        file = os.path.join(path, "generation_config.json")
        if not os.path.isfile(file):
            return {}
        try:
            with open(file, encoding="utf-8") as f:
                values = json.load(f)
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{file}: invalid JSON ({e})") from None
        if not isinstance(values, dict):
            raise ModelFormatError(f"{file}: not a JSON object")
        return model_defaults(values, file)
    values = {name: metadata[key] for key, name in GGUF_SAMPLING_KEYS.items() if key in metadata}
    return model_defaults(values, path)


class TensorSource(Protocol):
    """Where a model's tensors come from, under their GGUF names in the GGUF conventions: a GGUF file
    (gguf_file.GGUFFile) or an HF checkpoint through its family's adapter (safetensors_dir.HFWeights)."""
    in_file_format: bool    # weights are the file's own bytes, read for them (joining two would copy them)

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor:
        """The tensor's values, float32, in torch order."""

    def raw(self, name: str, experts: range | None = None, loading: Loading | None = None) -> tuple | None:
        """Its bytes in a GGML type, uint8 [..., rows, bytes per row], and the type (with `experts`, that slice
        of the leading dimension; with `loading`, the bytes may still be arriving until it waits), or None
        where the source holds its values only."""

    def shape(self, name: str) -> tuple | None:
        """The shape of its values in torch order where the source knows it without reading them, else None."""

    def stored_bytes(self, name: str, shape: tuple) -> int:
        """What a stage holds of it in the auto and float32 modes."""

    def prefetch(self, names) -> None:
        """A hint: these tensors are read next."""


@dataclass
class ModelFiles:
    path: str
    family: Family
    config: Any
    source: TensorSource
    tokenizer: Any
    # the model's own sampling defaults (SamplingParams field -> value), used where a request gives none
    sampling_defaults: dict = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return self.config.n_layers

    def expected_shapes(self, layers: range, first: bool, last: bool) -> dict:
        shapes = {}
        for i in layers:
            shapes.update(self.family.layer_tensor_shapes(self.config, i))
        glob = global_tensor_shapes(self.config)
        if first or (last and not self.source.has("output.weight")):
            shapes["token_embd.weight"] = glob["token_embd.weight"]
        if last:
            shapes["output_norm.weight"] = glob["output_norm.weight"]
            if self.source.has("output.weight"):
                shapes["output.weight"] = glob["output.weight"]
        return shapes

    def check_tensors(self):
        """Every tensor the stages will read is in the model's files, with the shape they expect where the
        source knows it unread (GGUF's tensor table): checked before anything starts, so that such a model is
        refused at once rather than when a stage loads (which checks again as it reads)."""
        for name, shape in self.expected_shapes(range(self.n_layers), first=True, last=True).items():
            if not self.source.has(name):
                raise ModelFormatError(f"{self.path}: missing tensor {name}")
            stored = self.source.shape(name)
            if stored is not None:
                self._check_shape(name, stored, shape)

    def tensor(self, name: str, shape: tuple, experts: range | None = None) -> torch.Tensor:
        """A tensor used as values (norms, biases, convolution taps), as float32; with `experts`, only
        that slice of its leading (expert) dimension."""
        t = self.source.get(name)
        self._check_shape(name, t.shape, shape)
        if experts is not None:
            t = t[experts.start:experts.stop].clone()
        return t.float().contiguous()

    def matrix(self, name: str, shape: tuple, mode: str, experts: range | None = None,
               loading: Loading | None = None):
        """A weight matrix (or stack of them) for products, in the form `mode` asks (see MODES); with
        `experts`, only that slice of its leading (expert) dimension. With `loading`, its bytes may
        still be arriving on return (until loading.wait())."""
        if mode == "int8":
            t = self.tensor(name, shape, experts)
            return quantize_rows(t) or DenseWeight(t)
        raw = self.source.raw(name, experts, loading)
        if raw is None:
            return DenseWeight(self.tensor(name, shape, experts))
        data, ggml_type = raw
        self._check_shape(name, _stored_shape(data, ggml_type),
                          shape if experts is None else (len(experts), *shape[1:]))
        return self._weight(name, data, ggml_type, shape[-1], mode)

    def fused_matrix(self, names: list[str], shapes: list[tuple], mode: str, dim: int, experts: range | None = None,
                     loading: Loading | None = None):
        """Weights joined along output dimension `dim`, as kernels.weights.cat_weights joins them; but
        expert stacks (dim 1) that are a file's own bytes stay one weight per tensor (joining gate and up
        experts would copy two thirds of a MoE file at load): a ConcatWeight, whose two block weights the
        CPU kernels still multiply in one call (docs/memory.md)."""
        parts = [self.matrix(n, s, mode, experts, loading) for n, s in zip(names, shapes)]
        if dim == 1 and len(names) > 1 and mode != "int8" and self.source.in_file_format:
            return ConcatWeight(parts, dim)
        return cat_weights(parts, dim, loading)

    def _weight(self, name: str, data: torch.Tensor, ggml_type: int, k: int, mode: str):
        if int(ggml_type) == F32:
            return DenseWeight(data.view(torch.float32).reshape(*data.shape[:-1], k))
        if int(ggml_type) not in BLOCK_TYPES:
            raise ModelFormatError(f"{self.path}: tensor {name} has ggml type {_type_name(ggml_type)}, which raymoe "
                                   f"cannot compute with")
        return BlockWeight(data, int(ggml_type), k, quantize_activations=mode == "auto")

    def _check_shape(self, name: str, got, expected):
        if tuple(got) != tuple(expected):
            raise ModelFormatError(f"{self.path}: tensor {name} has shape {list(got)}, expected {list(expected)}")


def open_mtp_head(model: ModelFiles, path: str | None = None) -> ModelFiles:
    """The files that hold `model`'s MTP head (stages/runtime/mtp.py): its own (the head in the model's file or
    checkpoint), or a separate GGUF at `path` as llama.cpp's converter writes it with `--mtp` (the head's block
    and the shared tensors, the model's metadata). Refused in one line where there is none or it does not fit."""
    family, cfg = model.family, model.config
    if family.mtp_mixer is None:
        raise ModelFormatError(f"{model.path}: {family.arch} models have no MTP head (use the ngram method)")
    if path is None:
        head = model
    else:
        if not os.path.isfile(path):
            raise ModelFormatError(f"{path}: no such file (the MTP head's GGUF)")
        gguf = GGUFFile(path)
        if gguf.architecture != family.arch:
            raise ModelFormatError(f"{path}: a {gguf.architecture} file, not the {family.arch} model's MTP head")
        head = ModelFiles(path=path, family=family, config=family.config_from_gguf(gguf.metadata, path), source=gguf,
                          tokenizer=model.tokenizer)
        theirs = head.config
        if (theirs.n_layers, theirs.hidden, theirs.vocab) != (cfg.n_layers, cfg.hidden, cfg.vocab):
            raise ModelFormatError(f"{path}: its MTP head is for a model of {theirs.n_layers} layers, hidden "
                                   f"{theirs.hidden}, vocabulary {theirs.vocab}; {model.path} has {cfg.n_layers}, "
                                   f"{cfg.hidden}, {cfg.vocab}")
        head.config.context_length = cfg.context_length
    shapes = family.mtp_tensor_shapes(head.config)
    optional = f"blk.{cfg.n_layers}.nextn.shared_head_norm.weight"
    if not head.config.mtp_layers or not head.source.has(f"blk.{cfg.n_layers}.nextn.eh_proj.weight"):
        raise ModelFormatError(f"{head.path}: no MTP head (no nextn_predict_layers and blk.{cfg.n_layers}.nextn.* "
                               f"tensors in a GGUF, no mtp.* tensors in a checkpoint); use the ngram method, or a "
                               f"GGUF of the head as the speculative config's \"model\"")
    for name, shape in shapes.items():
        if not head.source.has(name):
            if name == optional:
                continue
            raise ModelFormatError(f"{head.path}: its MTP head has no tensor {name}")
        stored = head.source.shape(name)
        if stored is not None:
            head._check_shape(name, stored, shape)
    return head


def mtp_shapes(head: ModelFiles) -> dict:
    """The tensors of the head that its files hold (the head's own output norm may be missing)."""
    return {n: s for n, s in head.family.mtp_tensor_shapes(head.config).items() if head.source.has(n)}


def _stored_shape(data: torch.Tensor, ggml_type: int) -> tuple:
    """The shape (torch order) of the values that bytes [..., rows, bytes per row] of a GGML type hold."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]
    return (*data.shape[:-1], data.shape[-1] // size * block)


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType
    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return str(int(ggml_type))


def resolve_model_path(model: str) -> str:
    if model in EMBEDDED_MODELS:
        path = embedded_model_path(model)
        if not os.path.isfile(path):
            raise ModelFormatError(f"{model}: its file {path} is missing (the embedded models ship in models/)")
        return path
    if not os.path.exists(model):
        raise ModelFormatError(f"{model}: no such file or directory (and not one of {', '.join(EMBEDDED_MODELS)})")
    return model


DEFAULT_MAX_MODEL_LEN = 8192


def open_model(model: str, max_model_len: int | None = DEFAULT_MAX_MODEL_LEN) -> ModelFiles:
    """The model's config, tokenizer and tensor table; its context is bounded by max_model_len
    (None: the file's own), which sizes the caches."""
    from raymoe.stages.text.tokenizer import Tokenizer

    path = resolve_model_path(model)
    if os.path.isdir(path):
        from raymoe.stages.files.safetensors_dir import SafetensorsDir
        files = SafetensorsDir(path)
        family = find_family(path, hf_model_type=files.config.get("model_type"))
        config = family.config_from_hf(files.config, path)
        source = family.hf_weights(files, config)
        tokenizer = Tokenizer.from_hf_dir(path)
        defaults = sampling_defaults(path)
    else:
        gguf = GGUFFile(path)
        family = find_family(path, gguf_arch=gguf.architecture)
        # before the architecture loops over its layers: a damaged count must not run for billions
        n_blocks = gguf.metadata.get(f"{gguf.architecture}.block_count")
        held = {name.split(".")[1] for name in gguf.tensors if name.startswith("blk.")}
        if isinstance(n_blocks, int) and n_blocks > len(held):
            raise ModelFormatError(f"{path}: block_count {n_blocks}, but the file holds tensors of {len(held)} blocks")
        config = family.config_from_gguf(gguf.metadata, path)
        source = gguf
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
        defaults = sampling_defaults(path, gguf.metadata)
    tokenizer.family_chat_format = family.chat_format
    if max_model_len is not None and max_model_len < 2:
        raise ModelFormatError(f"--max-model-len {max_model_len} must be at least 2")
    if max_model_len is not None:
        config.context_length = min(config.context_length, max_model_len)
    return ModelFiles(path=path, family=family, config=config, source=source, tokenizer=tokenizer,
                      sampling_defaults=defaults)
