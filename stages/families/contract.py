"""What a model family is: the `Family` contract every family module fills in, the config fields all
families have and the tensors outside the layers. The registry of families is registry.py;
docs/families.md says how to add a family."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Generic, Protocol, TypeVar, Union

import torch

from raymoe.stages.errors import ModelFormatError
from raymoe.stages.files.safetensors_dir import HFWeights, SafetensorsDir
from raymoe.stages.layers.cache import KVCache
from raymoe.stages.layers.block import Block
from raymoe.stages.layers.dense_ffn import DenseFFNSpec
from raymoe.stages.layers.moe import MoESpec


@dataclass
class ModelConfig:
    """The fields of every family's config; a family's config adds its own fields and checks."""
    n_layers: int
    hidden: int
    vocab: int
    n_head: int
    n_kv_head: int
    head_dim: int
    rms_eps: float
    rope_base: float
    n_expert: int
    n_expert_used: int
    expert_ff: int
    context_length: int

    POSITIVE: ClassVar[tuple[str, ...]] = ("n_layers", "hidden", "vocab", "n_head", "n_kv_head", "head_dim",
                                           "n_expert", "n_expert_used", "expert_ff", "context_length")

    def validate(self, where: str):
        for name in self.POSITIVE:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ModelFormatError(f"{where}: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_head % self.n_kv_head:
            raise ModelFormatError(f"{where}: {self.n_head} attention heads do not divide into {self.n_kv_head} KV heads")
        if self.n_expert_used > self.n_expert:
            raise ModelFormatError(f"{where}: expert_used_count {self.n_expert_used} > expert_count {self.n_expert}")

    def gguf_metadata(self) -> dict:
        """The `<arch>.*` GGUF keys of these fields (the inverse of `fields_from_gguf`); an MTP head (a family
        config's `mtp_layers`) is a block after the layers, as llama.cpp counts it."""
        mtp = {"nextn_predict_layers": 1} if getattr(self, "mtp_layers", 0) else {}
        return {
            **mtp, "block_count": self.n_layers + len(mtp), "context_length": self.context_length,
            "embedding_length": self.hidden,
            "feed_forward_length": self.expert_ff, "expert_feed_forward_length": self.expert_ff,
            "vocab_size": self.vocab, "attention.head_count": self.n_head, "attention.head_count_kv": self.n_kv_head,
            "attention.key_length": self.head_dim, "attention.value_length": self.head_dim,
            "attention.layer_norm_rms_epsilon": self.rms_eps, "rope.freq_base": self.rope_base,
            "expert_count": self.n_expert, "expert_used_count": self.n_expert_used,
        }


def fields_from_gguf(meta: dict, key) -> dict:
    """ModelConfig's fields but n_layers and expert_ff (which families read differently) from GGUF metadata;
    `key` reads the family's keys (gguf_file.arch_key_reader)."""
    n_embd = key("embedding_length")
    n_head = key("attention.head_count", positive=True)
    tokens = meta.get("tokenizer.ggml.tokens")
    return dict(hidden=n_embd, vocab=key("vocab_size", len(tokens) if tokens else None), n_head=n_head,
                n_kv_head=key("attention.head_count_kv"), head_dim=key("attention.key_length", n_embd // n_head),
                rms_eps=float(key("attention.layer_norm_rms_epsilon")), rope_base=float(key("rope.freq_base", 10000.0)),
                n_expert=key("expert_count"), n_expert_used=key("expert_used_count"),
                context_length=key("context_length"))


def global_tensor_shapes(cfg: ModelConfig) -> dict:
    """The tensors outside the layers, with their shapes in torch order."""
    return {"token_embd.weight": (cfg.vocab, cfg.hidden), "output_norm.weight": (cfg.hidden,),
            "output.weight": (cfg.vocab, cfg.hidden)}


class MixerSpec(Protocol):
    """What a layer's token mixer declares (stages.layers.attention.AttentionSpec,
    stages.layers.deltanet.DeltaNetSpec)."""

    def tensor_shapes(self, p: str, hidden: int) -> dict: ...

    def cache_bytes(self, positions: int, chunk: int) -> int:
        """The most one sequence's cache takes when it holds at most `positions` positions and a step
        brings at most `chunk` tokens of it."""

    def prefix_bytes(self, block: int) -> tuple[int, int]:
        """(bytes per cached block, bytes per snapshot at a block's end) in the prefix cache."""

    def build(self, w, p: str, eps: float, rope: tuple[torch.Tensor, float], max_len: int):
        """The mixer of the layer whose tensors start with `p` (see Block for what it provides)."""


C = TypeVar("C", bound=ModelConfig)     # a family's own config
FFNSpec = Union[MoESpec, DenseFFNSpec]   # what a layer's feed-forward is


@dataclass(frozen=True)
class Family(Generic[C]):
    """Everything a model family provides; the loader, stages, memory planning, expert actors and the
    converter read a family only through this. Tensors use llama.cpp's GGUF names and conventions for
    `arch`; `hf_weights` maps an HF checkpoint onto them."""
    arch: str                           # GGUF general.architecture
    hf_model_types: tuple[str, ...]     # config.json model_type values it reads
    tokenizer_pre: str                  # tokenizer.ggml.pre that deploy.convert writes
    # its chat format's name (stages/text/formats/registry.py), for a chat template that does not show one
    chat_format: str
    # (metadata, where) -> its config
    config_from_gguf: Callable[[dict, str], C]
    # (config.json, where) -> its config
    config_from_hf: Callable[[dict, str], C]
    # config -> its `<arch>.*` GGUF keys (the inverse of config_from_gguf)
    gguf_metadata: Callable[[C], dict]
    # (the checkpoint, config) -> its tensors under GGUF names
    hf_weights: Callable[[SafetensorsDir, C], HFWeights]
    # (config, layer) -> its token mixer: the one place a layer's kind is decided
    layer_mixer: Callable[[C, int], MixerSpec]
    # config -> (inverse frequencies, cos/sin multiplier) of its attention
    rope: Callable[[C], tuple[torch.Tensor, float]]
    # (config, layer) -> its feed-forward: routed experts (MoESpec) or dense (DenseFFNSpec)
    layer_ffn: Callable[[C, int], FFNSpec]
    # config -> the attention of its multi-token prediction head (stages/runtime/mtp.py); None: it has none
    mtp_mixer: Callable[[C], MixerSpec] | None = None

    def layer_tensor_shapes(self, cfg: C, i: int) -> dict:
        """Every tensor of layer i with its shape in torch order (GGUF ne reversed)."""
        p = f"blk.{i}."
        return {**Block.norm_shapes(i, cfg.hidden), **self.layer_mixer(cfg, i).tensor_shapes(p, cfg.hidden),
                **self.layer_ffn(cfg, i).tensor_shapes(p, cfg.hidden)}

    def mtp_tensor_shapes(self, cfg: C) -> dict:
        """The tensors of its MTP head, the block after the layers (`blk.{n_layers}.`), as llama.cpp names them:
        the layer's own (full attention and the feed-forward) and `nextn.*`: `eh_proj` joins the normed token
        embedding and hidden state, `enorm`/`hnorm` norm them, `shared_head_norm` is the norm before the LM head."""
        if self.mtp_mixer is None:
            raise ModelFormatError(f"{self.arch} models have no MTP head")
        i, h = cfg.n_layers, cfg.hidden
        p = f"blk.{i}."
        return {**Block.norm_shapes(i, h), **self.mtp_mixer(cfg).tensor_shapes(p, h),
                **self.layer_ffn(cfg, i).tensor_shapes(p, h), p + "nextn.eh_proj.weight": (h, 2 * h),
                **{f"{p}nextn.{norm}.weight": (h,) for norm in ("enorm", "hnorm", "shared_head_norm")}}

    def layer_cache_bytes(self, cfg: C, i: int, length: int | None = None, chunk: int = 512) -> int:
        """The most one sequence's cache of layer i takes: for a full context, or for a sequence never longer
        than `length`; `chunk`: the most tokens of one sequence a step holds."""
        positions = cfg.context_length if length is None else KVCache.capacity_bound(length, cfg.context_length)
        return self.layer_mixer(cfg, i).cache_bytes(positions, chunk)

    def layer_prefix_bytes(self, cfg: C, i: int, block: int) -> tuple[int, int]:
        """(bytes per cached block, bytes per snapshot) of layer i in the prefix cache."""
        return self.layer_mixer(cfg, i).prefix_bytes(block)

    def build_layer(self, cfg: C, w, i: int, remote_experts=None) -> Block:
        """Layer i: its mixer and its feed-forward in the shared pre-norm block."""
        mixer = self.layer_mixer(cfg, i).build(w, f"blk.{i}.", cfg.rms_eps, self.rope(cfg), cfg.context_length)
        return Block(w, i, cfg.rms_eps, mixer, self.layer_ffn(cfg, i).build(w, i, remote_experts))
