"""A pipeline stage: a contiguous range of layers plus, on the ends, the embedding and the LM head.

The stage owns the caches of every sequence that passes through it, keyed by sequence id.
"""
from __future__ import annotations

import torch

from kernels.int8 import lookup_rows
from kernels.linear import linear, torch_threads_for
from kernels.norms import rms_norm

from .batch import StepBatch, StepContext
from .loader import ModelFiles


# --dtype: the activation dtype, and whether weight matrices are held as int8 rows (kernels/int8.py)
PRECISIONS = {"float32": (torch.float32, False), "bfloat16": (torch.bfloat16, False), "int8": (torch.float32, True)}


class Stage:
    def __init__(self, model: ModelFiles, layers: range, precision: str = "float32", remote_experts=None):
        """precision: a key of PRECISIONS. remote_experts(layer, x, ids) -> (slots, rows), when routed
        experts live in expert actors."""
        self.config = model.config
        self.layers_range = layers
        self.first = layers.start == 0
        self.last = layers.stop == model.n_layers
        dtype, int8 = PRECISIONS[precision]
        self.dtype, self.int8 = dtype, int8
        shapes = model.expected_shapes(layers, self.first, self.last)

        self.weight_bytes = 0

        def w(name, as_dtype=None):
            t = model.weight(name, shapes[name], as_dtype or dtype, int8=int8 and as_dtype is None)
            self.weight_bytes += t.nbytes
            return t

        self.embed = w("token_embd.weight") if "token_embd.weight" in shapes else None
        self.layers = [model.arch.Layer(model.config, w, i, remote_experts) for i in layers]
        if self.last:
            self.norm = w("output_norm.weight")
            self.head = w("output.weight") if "output.weight" in shapes else self.embed
        self.caches: dict[int, dict] = {}
        self.peak_cache_bytes = 0

    def parameter_bytes(self) -> int:
        """Bytes of the weights this stage holds (what it loaded, nothing of other stages)."""
        return self.weight_bytes

    def _caches_for(self, seq_id: int) -> dict:
        if seq_id not in self.caches:
            self.caches[seq_id] = {layer.index: layer.new_cache() for layer in self.layers}
        return self.caches[seq_id]

    def cache_bytes(self) -> int:
        return sum(c.nbytes() for caches in self.caches.values() for c in caches.values())

    def release(self, seq_id: int):
        self.caches.pop(seq_id, None)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """First stage takes batch.token_ids, later stages the previous stage's hidden states.

        Returns hidden states [T, H], or on the last stage float32 logits for batch.logit_rows.
        """
        x = (lookup_rows(self.embed, batch.token_ids) if self.first else hidden).to(self.dtype)
        ctx = StepContext(batch=batch, positions=batch.positions(),
                          caches={sid: self._caches_for(sid) for sid in batch.seq_ids})
        with torch_threads_for(self.dtype == torch.float32 and not self.int8, batch.n_tokens):
            for layer in self.layers:
                x = layer(x, ctx)
            # a few attribute reads per sequence and layer: negligible next to the step
            self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache_bytes())
            if not self.last:
                return x
            x = rms_norm(x[batch.logit_rows], self.norm, self.config.rms_eps)
            return linear(x, self.head).float()
