"""Read an HF Qwen3.5-MoE checkpoint as GGUF-convention tensors (names and math of docs/model-formats.md §2).

This is the single place where the two conventions meet; `deploy.convert` writes what it
returns, and the model reads it exactly as it reads a GGUF file:
- V heads go from grouped order (HF: V head vh reads K head vh // r) to tiled order
  (GGUF: V head vh reads K head vh % n_k), in every tensor indexed by V head;
- zero-centred RMSNorm weights get their +1 (all norms except the DeltaNet output norm);
- `ssm_a = -exp(A_log)`; conv1d `[C, 1, K]` squeezed to `[C, K]`; fused experts split.
"""
from __future__ import annotations

import re

import torch

from raymoe.stages.errors import ModelFormatError
from raymoe.stages.files.safetensors_dir import HFWeights, SafetensorsDir

# GGUF suffix -> (HF suffix under model.layers.N., transform name)
LAYER_MAP = {
    "attn_norm.weight": ("input_layernorm.weight", "plus_one"),
    "post_attention_norm.weight": ("post_attention_layernorm.weight", "plus_one"),
    "attn_q.weight": ("self_attn.q_proj.weight", None),
    "attn_k.weight": ("self_attn.k_proj.weight", None),
    "attn_v.weight": ("self_attn.v_proj.weight", None),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", "plus_one"),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", "plus_one"),
    "attn_output.weight": ("self_attn.o_proj.weight", None),
    "attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", "tile_v_rows_after_qk"),
    "attn_gate.weight": ("linear_attn.in_proj_z.weight", "tile_v_rows"),
    "ssm_conv1d.weight": ("linear_attn.conv1d.weight", "conv"),
    "ssm_dt.bias": ("linear_attn.dt_bias", "tile_v_rows"),
    "ssm_a": ("linear_attn.A_log", "neg_exp"),
    "ssm_beta.weight": ("linear_attn.in_proj_b.weight", "tile_v_rows"),
    "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", "tile_v_rows"),
    "ssm_norm.weight": ("linear_attn.norm.weight", None),
    "ssm_out.weight": ("linear_attn.out_proj.weight", "tile_v_cols"),
    "ffn_gate_inp.weight": ("mlp.gate.weight", None),
    "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight", "flatten"),
    "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", None),
    "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", None),
    "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", None),
    "ffn_gate.weight": ("mlp.gate_proj.weight", None),       # a dense layer's (Qwen3-Next's mlp_only_layers)
    "ffn_up.weight": ("mlp.up_proj.weight", None),
    "ffn_down.weight": ("mlp.down_proj.weight", None),
}
GLOBAL_MAP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight"}
# the MTP head's own tensors (GGUF suffix under blk.{n_layers}.) -> HF name under `mtp.`; its layer is `mtp.layers.0.`
MTP_MAP = {"nextn.eh_proj.weight": ("fc.weight", None),
           "nextn.enorm.weight": ("pre_fc_norm_embedding.weight", "plus_one"),
           "nextn.hnorm.weight": ("pre_fc_norm_hidden.weight", "plus_one"),
           "nextn.shared_head_norm.weight": ("norm.weight", "plus_one")}
EXPERT_NAMES = {"ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}


def grouped_to_tiled(t: torch.Tensor, n_k: int, n_v: int) -> torch.Tensor:
    """Reorder dim 0 (n_v head blocks) from grouped (k-head major) to tiled (repeat major)."""
    r = n_v // n_k
    return t.reshape(n_k, r, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


class Qwen35MoeHFWeights(HFWeights):
    """`get(name)` of a GGUF-convention tensor; cfg is the checkpoint's `qwen35moe.Qwen35MoeConfig`."""

    def __init__(self, files: SafetensorsDir, cfg):
        super().__init__(files, cfg)
        self.prefix = "model.language_model." if files.has("model.language_model.embed_tokens.weight") else "model."
        if not files.has(self.prefix + "embed_tokens.weight"):
            raise ModelFormatError(f"{files.path}: no embed_tokens tensor (not a Qwen3.5-MoE checkpoint?)")
        # the MTP head: `mtp.*` beside the model (transformers skips it); Qwen3-Next's config does not count its layers
        self.mtp_prefix = "model.mtp." if files.has("model.mtp.fc.weight") else "mtp."
        layers = re.compile(re.escape(self.mtp_prefix) + r"layers\.(\d+)\.")
        held = len({m.group(1) for m in map(layers.match, files.file_of) if m})
        # transformers' save_pretrained drops the head while the config still counts it: what the files hold counts
        cfg.mtp_layers = held if files.has(self.mtp_prefix + "fc.weight") else 0

    def has(self, name: str) -> bool:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m is None or int(m.group(1)) < self.cfg.n_layers:
            return super().has(name)
        suffix = m.group(2)
        if suffix in MTP_MAP:
            return self.files.has(self.mtp_prefix + MTP_MAP[suffix][0])
        return self.files.has(self.mtp_prefix + "layers.0.input_layernorm.weight")

    def get(self, name: str) -> torch.Tensor:
        if name == "output.weight":
            return self._hf("lm_head.weight")
        if name in GLOBAL_MAP:
            t = self._hf(self.prefix + GLOBAL_MAP[name])
            return t + 1.0 if name == "output_norm.weight" else t
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if not m:
            raise ModelFormatError(f"{self.files.path}: no HF tensor for {name}")
        layer, suffix = int(m.group(1)), m.group(2)
        base = f"{self.prefix}layers.{layer}."
        if layer >= self.cfg.n_layers:      # the MTP head's block
            if suffix in MTP_MAP:
                hf_name, transform = MTP_MAP[suffix]
                return self._transform(self._hf(self.mtp_prefix + hf_name), transform)
            base = f"{self.mtp_prefix}layers.{layer - self.cfg.n_layers}."
        if suffix in EXPERT_NAMES:
            return self._experts(base, suffix)
        if suffix not in LAYER_MAP:
            raise ModelFormatError(f"{self.files.path}: no HF tensor for {name}")
        hf_suffix, transform = LAYER_MAP[suffix]
        return self._transform(self._hf(base + hf_suffix), transform)

    def _transform(self, t: torch.Tensor, how: str | None) -> torch.Tensor:
        c = self.cfg
        if how is None:
            return t
        if how == "plus_one":
            return t + 1.0
        if how == "neg_exp":
            return grouped_to_tiled(-torch.exp(t), c.n_k_heads, c.n_v_heads)
        if how == "flatten":
            return t.reshape(-1)
        if how == "tile_v_rows":
            return grouped_to_tiled(t, c.n_k_heads, c.n_v_heads)
        if how == "tile_v_rows_after_qk":
            qk, v = t[:2 * c.k_head_dim * c.n_k_heads], t[2 * c.k_head_dim * c.n_k_heads:]
            return torch.cat((qk, grouped_to_tiled(v, c.n_k_heads, c.n_v_heads)))
        if how == "conv":
            return self._transform(t.reshape(t.shape[0], -1), "tile_v_rows_after_qk")
        if how == "tile_v_cols":
            return grouped_to_tiled(t.T, c.n_k_heads, c.n_v_heads).T.contiguous()
        raise AssertionError(how)

    def _experts(self, base: str, suffix: str) -> torch.Tensor:
        mlp = base + "mlp.experts."
        F = self.cfg.expert_ff
        if self.files.has(mlp + "gate_up_proj"):          # fused [E, 2F, H], gate first; down [E, H, F]
            if suffix == "ffn_down_exps.weight":
                return self._hf(mlp + "down_proj")
            gate_up = self._hf(mlp + "gate_up_proj")
            return gate_up[:, :F] if suffix == "ffn_gate_exps.weight" else gate_up[:, F:]
        proj = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                "ffn_down_exps.weight": "down_proj"}[suffix]
        return torch.stack([self._hf(f"{mlp}{e}.{proj}.weight") for e in range(self.cfg.n_expert)])
