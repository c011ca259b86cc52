"""The pre-norm residual block both model families share."""
from __future__ import annotations

import torch

from kernels.norms import rms_norm


class Block:
    """`h = x + mixer(norm(x)); out = h + ffn(post_norm(h))` for layer `index`."""

    def __init__(self, w, index: int, eps: float, mixer, ffn):
        self.index, self.eps = index, eps
        self.attn_norm = w(f"blk.{index}.attn_norm.weight")
        self.post_norm = w(f"blk.{index}.post_attention_norm.weight")
        self.mixer, self.ffn = mixer, ffn

    def new_cache(self):
        return self.mixer.new_cache()

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor:
        h = x + self.mixer(rms_norm(x, self.attn_norm, self.eps), ctx, self.index)
        return h + self.ffn(rms_norm(h, self.post_norm, self.eps))
