"""What a model family is: the `Family` contract every family module fills in (and the one registry of
them), the config fields all families have, the tensors outside the layers, and the pre-norm residual
block each layer is. docs/families.md says how to add a family."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from kernels import token_calls
from kernels.norms import rms_norm

from .cache import KVCache
from .errors import ModelFormatError
from .moe import MoE, MoESpec


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

    POSITIVE = ("n_layers", "hidden", "vocab", "n_head", "n_kv_head", "head_dim", "n_expert", "n_expert_used",
                "expert_ff", "context_length")

    def validate(self, where: str):
        for name in self.POSITIVE:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ModelFormatError(f"{where}: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_head % self.n_kv_head:
            raise ModelFormatError(f"{where}: {self.n_head} attention heads do not divide into {self.n_kv_head} KV heads")
        if self.n_expert_used > self.n_expert:
            raise ModelFormatError(f"{where}: expert_used_count {self.n_expert_used} > expert_count {self.n_expert}")

    def gguf_metadata(self) -> dict:
        """The `<arch>.*` GGUF keys of these fields (the inverse of `fields_from_gguf`)."""
        return {
            "block_count": self.n_layers, "context_length": self.context_length, "embedding_length": self.hidden,
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


class Block:
    """`h = x + mixer(norm(x)); out = h + ffn(post_norm(h))` for layer `index`.

    A decode step (one token of each sequence) runs in three parts: the mixer's host bookkeeping
    (`decode_inputs`: caches as tensors), `decode` (tensors in and out, no host synchronisation: what
    torch.compile can trace whole) and the bookkeeping after (`decode_done`)."""

    def __init__(self, w, index: int, eps: float, mixer, ffn):
        self.index, self.eps = index, eps
        self.attn_norm = w(f"blk.{index}.attn_norm.weight")
        self.post_norm = w(f"blk.{index}.post_attention_norm.weight")
        self.mixer, self.ffn = mixer, ffn
        self._calls = None     # _token_calls, made on first use

    @staticmethod
    def norm_shapes(index: int, hidden: int) -> dict:
        return {f"blk.{index}.attn_norm.weight": (hidden,), f"blk.{index}.post_attention_norm.weight": (hidden,)}

    def new_cache(self):
        return self.mixer.new_cache()

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if ctx.batch.decoding:
            x = self.decode(x, self.mixer.decode_inputs(ctx, self.index))
            self.mixer.decode_done(ctx, self.index)
            return x
        h = x + self.mixer(rms_norm(x, self.attn_norm, self.eps), ctx, self.index)
        return h + self.ffn(rms_norm(h, self.post_norm, self.eps))

    def decode(self, x: torch.Tensor, caches) -> torch.Tensor:
        """One token of each of x's rows, caches what the mixer's decode_inputs gave (updated in place)."""
        mixer, ffn = self._token_calls(x)
        if mixer is not None and mixer.takes(x, caches):     # a few tokens on the CPU: the calls below, made from C
            h = mixer(x, caches)
        else:
            h = x + self.mixer.decode(rms_norm(x, self.attn_norm, self.eps), caches)
        out = ffn(h) if ffn is not None and ffn.takes(h) else None      # None: tied router scores
        return out if out is not None else h + self.ffn(rms_norm(h, self.post_norm, self.eps), decoding=True)

    def _token_calls(self, x: torch.Tensor) -> tuple:
        """(mixer, feed-forward) of an eager CPU decode step of a few sequences as one C call each
        (kernels/token_calls.py, made on first use), None for a part that has none; (None, None) for other steps."""
        if x.shape[0] > token_calls.MAX_ROWS or not x.is_cpu or torch.compiler.is_compiling():
            return None, None
        if self._calls is None:
            mixer, ffn = getattr(self.mixer, "token_call", None), getattr(self.ffn, "token_ffn", None)
            self._calls = (None if mixer is None else mixer(self.attn_norm, self.eps),
                           None if ffn is None else ffn(self.post_norm, self.eps))
        return self._calls


class MixerSpec(Protocol):
    """What a layer's token mixer declares (stages.attention.AttentionSpec, stages.deltanet.DeltaNetSpec)."""

    def tensor_shapes(self, p: str, hidden: int) -> dict: ...

    def cache_bytes(self, positions: int, chunk: int) -> int:
        """The most one sequence's cache takes when it holds at most `positions` positions and a step
        brings at most `chunk` tokens of it."""

    def prefix_bytes(self, block: int) -> tuple[int, int]:
        """(bytes per cached block, bytes per snapshot at a block's end) in the prefix cache."""

    def build(self, w, p: str, eps: float, rope: tuple[torch.Tensor, float], max_len: int):
        """The mixer of the layer whose tensors start with `p` (see Block for what it provides)."""


@dataclass(frozen=True)
class Family:
    """Everything a model family provides; the loader, stages, memory planning, expert actors and the
    converter read a family only through this. Tensors use llama.cpp's GGUF names and conventions for
    `arch`; `hf_weights` maps an HF checkpoint onto them."""
    arch: str                           # GGUF general.architecture
    hf_model_types: tuple[str, ...]     # config.json model_type values it reads
    tokenizer_pre: str                  # tokenizer.ggml.pre that deploy.convert writes
    config_from_gguf: Callable          # (metadata, where) -> config (a ModelConfig)
    config_from_hf: Callable            # (config.json dict, where) -> config
    gguf_metadata: Callable             # config -> its `<arch>.*` GGUF keys (the inverse of config_from_gguf)
    hf_weights: Callable                # (SafetensorsDir, config) -> its tensor source (a safetensors_dir.HFWeights)
    layer_mixer: Callable               # (config, layer) -> MixerSpec: the one place a layer's kind is decided
    rope: Callable                      # config -> (inverse frequencies, cos/sin multiplier) of its attention
    moe_spec: Callable                  # config -> MoESpec of every layer's feed-forward

    def layer_tensor_shapes(self, cfg: ModelConfig, i: int) -> dict:
        """Every tensor of layer i with its shape in torch order (GGUF ne reversed)."""
        p = f"blk.{i}."
        return {**Block.norm_shapes(i, cfg.hidden), **self.layer_mixer(cfg, i).tensor_shapes(p, cfg.hidden),
                **self.moe_spec(cfg).tensor_shapes(p, cfg.hidden)}

    def layer_cache_bytes(self, cfg: ModelConfig, i: int, length: int | None = None, chunk: int = 512) -> int:
        """The most one sequence's cache of layer i takes: for a full context, or for a sequence never longer
        than `length`; `chunk`: the most tokens of one sequence a step holds."""
        positions = cfg.context_length if length is None else KVCache.capacity_bound(length, cfg.context_length)
        return self.layer_mixer(cfg, i).cache_bytes(positions, chunk)

    def layer_prefix_bytes(self, cfg: ModelConfig, i: int, block: int) -> tuple[int, int]:
        """(bytes per cached block, bytes per snapshot) of layer i in the prefix cache."""
        return self.layer_mixer(cfg, i).prefix_bytes(block)

    def build_layer(self, cfg: ModelConfig, w, i: int, remote_experts=None) -> Block:
        """Layer i: its mixer and the MoE feed-forward in the shared pre-norm block."""
        mixer = self.layer_mixer(cfg, i).build(w, f"blk.{i}.", cfg.rms_eps, self.rope(cfg), cfg.context_length)
        return Block(w, i, cfg.rms_eps, mixer, MoE(self.moe_spec(cfg), w, i, remote_experts))


def families() -> tuple[Family, ...]:
    """Every family raymoe runs: the one registry (imported when asked: each family module imports this one)."""
    from . import gptoss, qwen35moe, qwen3next
    return qwen35moe.FAMILY, gptoss.FAMILY, qwen3next.FAMILY


def find_family(where: str, gguf_arch: str | None = None, hf_model_type: str | None = None) -> Family:
    """The family of a GGUF architecture or of an HF config.json model_type, or a ModelFormatError naming
    the ones supported."""
    for family in families():
        if (gguf_arch is not None and gguf_arch == family.arch) or hf_model_type in family.hf_model_types:
            return family
    if gguf_arch is not None:
        supported = sorted(f.arch for f in families())
        raise ModelFormatError(f"{where}: unknown architecture {gguf_arch!r} (supported: {', '.join(supported)})")
    supported = sorted(t for f in families() for t in f.hf_model_types)
    raise ModelFormatError(f"{where}: unknown architecture (config.json model_type {hf_model_type!r}; "
                           f"supported: {', '.join(supported)})")
