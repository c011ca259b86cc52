"""The pre-norm residual block that every layer of every family is: a token mixer, then the feed-forward."""
from __future__ import annotations

import torch

from raymoe.kernels import token_calls
from raymoe.kernels.norms import rms_norm


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
