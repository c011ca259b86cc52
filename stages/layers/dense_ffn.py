"""A dense feed-forward layer, `down(act(gate(x)) * up(x))`: what a family declares for the layers that have no
experts (Qwen3-Next's `mlp_only_layers`). Its tensors are llama.cpp's `ffn_gate`, `ffn_up`, `ffn_down`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from raymoe.kernels.linear import linear
from raymoe.kernels.moe import swiglu


@dataclass(frozen=True)
class DenseFFNSpec:
    ff: int                             # the inner width
    activation: Callable = swiglu       # of [gate | up]

    def tensor_shapes(self, p: str, hidden: int) -> dict:
        return {p + "ffn_gate.weight": (self.ff, hidden), p + "ffn_up.weight": (self.ff, hidden),
                p + "ffn_down.weight": (hidden, self.ff)}

    def build(self, w, layer: int, remote_experts=None) -> DenseFFN:
        return DenseFFN(self, w, layer)


class DenseFFN:
    """The feed-forward of one dense layer: one product for gate and up, one for down."""

    def __init__(self, spec: DenseFFNSpec, w, layer: int):
        p = f"blk.{layer}."
        self.activation = spec.activation
        self.gate_up = w.matrices([p + "ffn_gate.weight", p + "ffn_up.weight"], 0)
        self.down = w.matrix(p + "ffn_down.weight")

    def __call__(self, x: torch.Tensor, decoding: bool = False) -> torch.Tensor:
        return linear(self.activation(linear(x, self.gate_up)), self.down)

    def host_free(self, n: int) -> bool:
        """A decode step of n rows needs nothing from the host (a CUDA graph can replay it)."""
        return True
