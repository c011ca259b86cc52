"""Read an HF gpt-oss checkpoint as GGUF-convention tensors (names and layout of llama.cpp's `gpt-oss`).

This is the single place where the two conventions meet; `deploy.convert` writes what it returns:
- the fused expert projection `gate_up_proj` (HF: `[E, H, 2I]`, gate and up interleaved in the last
  dimension, i.e. gate = even output features) becomes `ffn_gate_exps` / `ffn_up_exps` `[E, I, H]`;
  `down_proj` `[E, I, H]` becomes `ffn_down_exps` `[E, H, I]`; the biases are split the same way;
- MXFP4 checkpoints store the experts as `*_blocks` `[E, rows, cols/32, 16]` u8 (two e2m1 codes a byte,
  low nibble = even element) and `*_scales` `[E, rows, cols/32]` u8 (e8m0), rows = output features.
  `get` dequantises them exactly (`LUT[code] · 2^(scale − 127)`, what transformers computes);
  `raw` repacks them bit for bit into GGML MXFP4 blocks (scale byte, then byte j = element j
  in the low nibble and j + 16 in the high) so that a converted GGUF holds the same numbers.
"""
from __future__ import annotations

import re

import numpy as np
import torch

from raymoe.stages.errors import ModelFormatError
from raymoe.stages.files.safetensors_dir import HFWeights, SafetensorsDir

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# GGUF suffix -> HF suffix under model.layers.N.
LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
}
GLOBAL_MAP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
# GGUF expert tensor -> (HF fused tensor, which rows of it: "even" (gate), "odd" (up) or "all")
EXPERT_MAP = {
    "ffn_gate_exps": ("gate_up_proj", "even"),
    "ffn_up_exps": ("gate_up_proj", "odd"),
    "ffn_down_exps": ("down_proj", "all"),
}


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF MXFP4 blocks [..., G, 16] u8 and scales [..., G] u8 -> float32 [..., G*32], exactly as
    transformers dequantises (`torch.ldexp(LUT[code], scale - 127)`)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32).long()
    values = torch.ldexp(lut[codes], (scales.to(torch.int32) - 127)[..., None])
    return values.reshape(*scales.shape[:-1], -1)


def mxfp4_to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """HF MXFP4 blocks [..., G, 16] + scales [..., G] -> GGML MXFP4 row bytes [..., G*17] (same values)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    blocks = blocks.to(torch.uint8)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)  # element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat((scales.to(torch.uint8)[..., None], packed), dim=-1)
    return out.reshape(*scales.shape[:-1], -1).contiguous().numpy()


class GptOssHFWeights(HFWeights):
    """`get(name)` of a GGUF-convention tensor; cfg is the checkpoint's `gptoss.GptOssConfig`."""

    def __init__(self, files: SafetensorsDir, cfg):
        super().__init__(files, cfg)
        if not files.has("model.embed_tokens.weight"):
            raise ModelFormatError(f"{files.path}: no model.embed_tokens.weight (not a gpt-oss checkpoint?)")
        quant = files.config.get("quantization_config") or {}
        method = quant.get("quant_method")
        if method not in (None, "mxfp4"):
            raise ModelFormatError(f"{files.path}: unsupported quantization {method!r} (supported: mxfp4, none)")

    def _split(self, name: str):
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if not m:
            raise ModelFormatError(f"{self.files.path}: no HF tensor for {name}")
        return f"model.layers.{m.group(1)}.", m.group(2)

    def get(self, name: str) -> torch.Tensor:
        if name in GLOBAL_MAP:
            return self._hf(GLOBAL_MAP[name])
        base, suffix = self._split(name)
        if suffix in LAYER_MAP:
            return self._hf(base + LAYER_MAP[suffix])
        stem, _, kind = suffix.rpartition(".")
        if stem not in EXPERT_MAP:
            raise ModelFormatError(f"{self.files.path}: no HF tensor for {name}")
        fused, rows = EXPERT_MAP[stem]
        hf = f"{base}mlp.experts.{fused}"
        if kind == "bias":
            return self._rows(self._hf(hf + "_bias"), rows)                 # [E, 2I] or [E, H]
        if self.files.has(hf + "_blocks"):                                  # MXFP4: rows are output features
            t = mxfp4_dequantize(self.files.get(hf + "_blocks"), self.files.get(hf + "_scales"))
        else:                                                               # float: [E, in, out]
            t = self._hf(hf).transpose(1, 2)
        return self._rows(t, rows).contiguous()

    @staticmethod
    def _rows(t: torch.Tensor, rows: str) -> torch.Tensor:
        return t[:, 0::2] if rows == "even" else t[:, 1::2] if rows == "odd" else t

    def raw(self, name: str, experts: range | None = None, loading=None):
        """(GGML MXFP4 bytes [E, rows, cols/32*17], GGMLQuantizationType.MXFP4) for an expert weight stored as
        MXFP4 (with `experts`, that slice of E), else None (the tensor is then read from `get`)."""
        from gguf import GGMLQuantizationType

        if name in GLOBAL_MAP:
            return None
        base, suffix = self._split(name)
        stem, _, kind = suffix.rpartition(".")
        if stem not in EXPERT_MAP or kind != "weight":
            return None
        fused, rows = EXPERT_MAP[stem]
        hf = f"{base}mlp.experts.{fused}"
        if not self.files.has(hf + "_blocks"):
            return None
        blocks = self._rows(self.files.get(hf + "_blocks"), rows)
        scales = self._rows(self.files.get(hf + "_scales"), rows)
        if experts is not None:
            blocks, scales = blocks[experts.start:experts.stop], scales[experts.start:experts.stop]
        return torch.from_numpy(mxfp4_to_ggml(blocks, scales)), GGMLQuantizationType.MXFP4
