"""Read an HF Qwen3-Next checkpoint as llama.cpp `qwen3next` tensors (docs/model-formats.md §7).

Its DeltaNet tensors change as llama.cpp's converter changes them (conversion/qwen.py, Qwen3NextModel):
- `in_proj_qkvz` holds, per K head, that head's q, k, and its V heads' v and z; it becomes `attn_qkv`
  (every q, every k, every v) and `attn_gate` (every z), V heads keeping HF's grouped order;
- `in_proj_ba` is `ssm_ba` as it is (per K head, its V heads' b then a); `ssm_a = -exp(A_log)`;
  conv1d `[C, 1, K]` squeezed to `[C, K]`; no tensor is reordered by V head;
- the output norm's weight stays as it is (the other norms get their +1, as in Qwen3.5-MoE).
Attention, norm, router, shared-expert and expert tensors are named and stored as in Qwen3.5-MoE, so
qwen35moe_hf reads those.
"""
from __future__ import annotations

import re

import torch

from raymoe.stages.families.qwen35moe_hf import Qwen35MoeHFWeights

# GGUF suffix -> HF suffix under model.layers.N.linear_attn. (the tensors read as they are)
DELTANET_MAP = {"ssm_ba.weight": "in_proj_ba.weight", "ssm_dt.bias": "dt_bias", "ssm_norm.weight": "norm.weight",
                "ssm_out.weight": "out_proj.weight"}

DELTANET_NAME = re.compile(r"blk\.(\d+)\.(attn_qkv\.weight|attn_gate\.weight|ssm_a|ssm_conv1d\.weight|"
                           + "|".join(re.escape(s) for s in DELTANET_MAP) + ")")


class Qwen3NextHFWeights(Qwen35MoeHFWeights):
    """`get(name)` of a llama.cpp qwen3next tensor; cfg is the checkpoint's `qwen3next.Qwen3NextConfig`."""

    def get(self, name: str) -> torch.Tensor:
        m = DELTANET_NAME.fullmatch(name)
        if not m:
            return super().get(name)
        base, suffix = f"{self.prefix}layers.{m.group(1)}.linear_attn.", m.group(2)
        if suffix in DELTANET_MAP:
            return self._hf(base + DELTANET_MAP[suffix])
        if suffix == "ssm_a":
            return -torch.exp(self._hf(base + "A_log"))
        if suffix == "ssm_conv1d.weight":
            t = self._hf(base + "conv1d.weight")
            return t.reshape(t.shape[0], -1)
        qkv, z = self._split_qkvz(self._hf(base + "in_proj_qkvz.weight"))
        return qkv if suffix == "attn_qkv.weight" else z

    def _split_qkvz(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[q | k | v | z] per K head -> ([every q | every k | every v], every z), rows in that order."""
        c = self.cfg
        vz = c.n_v_heads // c.n_k_heads * c.v_head_dim
        q, k, v, z = t.reshape(c.n_k_heads, -1, t.shape[-1]).split([c.k_head_dim, c.k_head_dim, vz, vz], dim=1)
        rows = [part.reshape(-1, t.shape[-1]) for part in (q, k, v, z)]
        return torch.cat(rows[:3]), rows[3]
