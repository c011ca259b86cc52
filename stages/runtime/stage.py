"""A pipeline stage: a contiguous range of layers plus, on the ends, the embedding and the LM head.

The stage owns the caches of every sequence that passes through it, keyed by sequence id.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from raymoe.kernels import gpu_ops
from raymoe.kernels.allocator import keep_freed_memory
from raymoe.kernels.linear import linear, lookup_rows, take_rows
from raymoe.kernels.norms import rms_norm
from raymoe.kernels.threads import loading_threads, torch_threads_for
from raymoe.kernels.weights import Loading, cat_weights

from raymoe.stages.runtime import decode_graph
from raymoe.stages.runtime.batch import StepBatch, StepContext
from raymoe.stages.runtime.mtp import MtpHead
from raymoe.stages.errors import ModelFormatError
from raymoe.stages.families.contract import global_tensor_shapes
from raymoe.stages.files.loader import MODES, ModelFiles, mode_device_error, mtp_shapes
from raymoe.stages.prefix.store import PrefixStore
from raymoe.stages.runtime.sampler import sample_chunks
from raymoe.stages.text.structured import Matchers


def check_device(device: str, mode: str) -> torch.device:
    """The torch device for --device, refused in one line where this machine or mode cannot run it."""
    if str(device).split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: not supported (choose cpu or cuda)")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible here (torch.cuda.is_available() is False); "
                             "use --device cpu")
        if mode_device_error(mode, device.type):
            raise ValueError(mode_device_error(mode, device.type))
    return device


def next_input(start: int, length: int, result) -> tuple[int, int | None]:
    """(position, token) of the token the next step of a chunk's sequence inputs: the one it sampled (None where
    its sampling failed), after the chunk, or after the drafts a verify chunk kept (its result holds a list)."""
    if isinstance(result, str):
        return start + length, None
    token = result[0]
    if isinstance(token, list):
        return start + len(token), token[-1]
    return start + length, token


class StageWeights:
    """What layer builders read: `w(name)` a tensor of values (float32), `w.matrix(name)` a weight for
    products in the stage's mode (kernels/weights.py); either with `experts`, a slice of the leading
    dimension. Everything is on `device`. Counts the bytes it hands out."""

    def __init__(self, model: ModelFiles, shapes: dict, mode: str, progress=None, device: str = "cpu"):
        self.model, self.shapes, self.mode, self.progress = model, shapes, mode, progress
        self.device = torch.device(device)
        self.nbytes = 0
        self.loading = Loading()        # reads still filling weights handed out, and joins behind them (see finish)
        model.source.prefetch(shapes)

    def __call__(self, name: str, experts: range | None = None) -> torch.Tensor:
        return self._count(self.model.tensor(name, self.shapes[name], experts))

    def matrix(self, name: str, experts: range | None = None):
        return self._count(self.model.matrix(name, self.shapes[name], self.mode, experts, self.loading))

    def matrices(self, names: list[str], dim: int, experts: range | None = None):
        """Weights joined along output dimension `dim` (see ModelFiles.fused_matrix)."""
        return self._count(self.model.fused_matrix(names, [self.shapes[n] for n in names], self.mode, dim, experts,
                                                   self.loading))

    def join(self, weights: list, dim: int = 0):
        """Weights handed out, joined along output dimension `dim` (kernels.weights.cat_weights); their
        bytes may still be arriving, so the join waits with them (see finish)."""
        return cat_weights(weights, dim, self.loading)

    def finish(self) -> None:
        """Waits until every weight handed out holds its bytes: call it before using them. Reading
        the next tensors while the disk still fills the last ones keeps the disk busy. A file that
        ended first (cut short after it was opened) is refused here."""
        if not self.loading.wait():
            raise ModelFormatError(f"{self.model.path}: truncated GGUF file")

    def _count(self, t):
        if self.device.type != "cpu":
            self.finish()
            t = t.to(self.device)
        self.nbytes += t.nbytes
        if self.progress:
            self.progress(self.nbytes)
        return t


class Stage:
    def __init__(self, model: ModelFiles, layers: range, mode: str = "auto", remote_experts=None, progress=None,
                 device: str = "cpu", mtp: ModelFiles | None = None):
        """mode: a key of stages.files.loader.MODES. remote_experts(layer, x, ids) -> (slots, rows), when routed
        experts live in expert actors. progress(bytes) is called as weights are read. device: where the
        weights, caches and activations live ("cpu", or "cuda" for the GPU this process sees). mtp: the files
        of the model's MTP head (stages.files.loader.open_mtp_head), which the last stage runs to draft tokens."""
        if mode not in MODES:
            raise ValueError(f"unknown --dtype {mode!r} (choose from {', '.join(MODES)})")
        self.device = check_device(device, mode)
        self.config = model.config
        self.layers_range = layers
        self.first = layers.start == 0
        self.last = layers.stop == model.n_layers
        self.mode = mode
        shapes = model.expected_shapes(layers, self.first, self.last)
        mtp = mtp if self.last else None
        if mtp is not None:         # the head embeds the tokens it drafts from
            shapes.setdefault("token_embd.weight", global_tensor_shapes(model.config)["token_embd.weight"])
        self.mtp = self.mtp_weights = None
        with loading_threads(mode):
            w = self.weights = StageWeights(model, shapes, mode, progress, device)
            self.embed = w.matrix("token_embd.weight") if "token_embd.weight" in shapes else None
            self.layers = [model.family.build_layer(model.config, w, i, remote_experts) for i in layers]
            if self.last:
                self.norm = w("output_norm.weight")
                self.head = w.matrix("output.weight") if "output.weight" in shapes else self.embed
            if mtp is not None:
                self.mtp_weights = StageWeights(mtp, mtp_shapes(mtp), mode, device=device)
                self.mtp = MtpHead(model.family, mtp.config, self.mtp_weights, self.embed, self.head, self.norm)
                self.mtp_weights.finish()
            w.finish()
        if self.device.type == "cpu":
            keep_freed_memory()
        self.caches: dict[int, dict] = {}
        self.peak_cache_bytes = 0
        self.prefix = PrefixStore()       # its layers' share of the prefix cache
        # the last stage samples: its sequences' grammar matchers (structured outputs)
        self.matchers = Matchers(model.tokenizer, model.config.vocab) if self.last else None
        # a stage that embeds and samples: the token it sampled last per sequence (StepBatch.follow)
        self.sampled: dict[int, int] = {}
        # sequences whose last step was a verify chunk: their caches settle at their next step (stages/layers/cache.py)
        self.unsettled: set[int] = set()
        # one stage of several on a node: its link to the others (cluster/chain.py), which carries a follow
        # batch's steps from stage to stage and the last stage's tokens back to the first
        self.link = None
        # on a GPU, decode steps replay as CUDA graphs where they can (stages/runtime/decode_graph.py)
        self.graphs = decode_graph.DecodeGraphs(self.layers) if self.device.type == "cuda" and \
            gpu_ops.CUDA_GRAPHS else None

    def parameter_bytes(self) -> int:
        """Bytes of the weights this stage holds (what it loaded, nothing of other stages)."""
        return self.weights.nbytes + (self.mtp_weights.nbytes if self.mtp_weights is not None else 0)

    def _new_caches(self) -> dict:
        return {layer.index: layer.new_cache() for layer in self.layers}

    def _caches_for(self, seq_id: int) -> dict:
        if seq_id not in self.caches:
            self.caches[seq_id] = self._new_caches()
        return self.caches[seq_id]

    def reset(self):
        """Forget every sequence's caches and the prefix cache (the coordinator forgets its index too)."""
        self.caches.clear()
        self.sampled.clear()
        self.unsettled.clear()
        self.prefix.clear()
        if self.matchers is not None:
            self.matchers.clear()
        if self.mtp is not None:
            self.mtp.states.clear()

    def cache_bytes(self) -> int:
        mtp = self.mtp.cache_bytes() if self.mtp is not None else 0
        return mtp + sum(c.nbytes() for caches in self.caches.values() for c in caches.values())

    def release(self, seq_id: int):
        self.caches.pop(seq_id, None)
        self.sampled.pop(seq_id, None)
        self.unsettled.discard(seq_id)
        if self.link is not None:
            self.link.forget(seq_id)
        if self.matchers is not None:
            self.matchers.release(seq_id)
        if self.mtp is not None:
            self.mtp.release(seq_id)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """First stage takes batch.token_ids, later stages the previous stage's hidden states.

        Returns hidden states [T, H]; on the last stage, per chunk what batch.sampling asks for (tokens and
        logprobs, see stages.runtime.sampler.sample_chunks), or without it the float32 logits of batch.logit_rows.
        A follow batch gives one such result per step it ran (StepBatch.steps).
        """
        if batch.follow:
            return self._follow(batch)
        return self._step(batch, hidden)

    def _follow(self, batch: StepBatch) -> list:
        """batch.steps decode steps of its sequences, each row from the token its row sampled the step before. It
        stops after a step where a row sampled a token of its end_ids or failed its sampling, and runs none when a
        token it would continue from ended its sequence (the call was sent before the coordinator knew). On a stage
        of several, every stage runs the steps in turn over self.link (the first stage decides where they stop);
        the last returns the results, each step's rows in turn."""
        if not (self.first and self.last or self.link is not None):
            raise ValueError("a follow batch runs on a stage that embeds and samples, or over a link")
        results = []
        for i in range(batch.steps):
            step = replace(batch, start_pos=[p + i for p in batch.start_pos], prefix=batch.prefix if i == 0 else None,
                           sampling=[replace(c, position=c.position + i) for c in batch.sampling])
            if self.first:
                tokens = self._followed_tokens(step)
                x = None if tokens is None else self._step(replace(step, token_ids=tokens))
            else:
                x = self.link.recv(end_ok=True)
                if x is not None:
                    x = self._step(step, x)
            if x is None:       # a sequence ended: so do the later stages' steps
                if not self.last:
                    self.link.end()
                break
            if not self.last:
                self.link.send(x)
                continue
            results += x
        return results

    def _followed_tokens(self, step: StepBatch) -> list[int] | None:
        """First stage: the tokens a follow step embeds, a row's from the token its sequence sampled last; None
        where a sequence ended before it (a token of its end_ids, or a failed sampling)."""
        if not self.last:
            return self.link.next_tokens(step.seq_ids, step.start_pos, step.end_ids)
        tokens = []
        for sid, ends in zip(step.seq_ids, step.end_ids):
            if sid not in self.sampled:
                raise RuntimeError(f"no sampled token to continue sequence {sid} from")
            token = self.sampled[sid]
            if token is None or token in ends:
                return None
            tokens.append(token)
        return tokens

    def _step(self, batch: StepBatch, hidden: torch.Tensor | None = None):
        if self.first:
            x = lookup_rows(self.embed, torch.as_tensor(batch.token_ids, device=self.device))
        else:       # a transport that stages through the host hands a CPU tensor to a GPU stage
            x = hidden.to(self.device)
        ops = batch.prefix
        if ops:     # restore before dropping: a block this step evicts may be one a sequence starts from
            if ops.clear:
                self.prefix.clear()
            self.caches.update(self.prefix.restore(ops, self._new_caches))
            self.prefix.drop(ops.drop)
        ctx = StepContext(batch=batch, positions=batch.positions().to(self.device),
                          caches={sid: self._caches_for(sid) for sid in batch.seq_ids})
        if self.unsettled:
            self._settle(batch, ctx.caches)
        with torch_threads_for(batch.n_tokens):
            if self.graphs is not None and batch.decoding and not ops and self.graphs.usable(len(batch.seq_ids)):
                x = self.graphs(x, ctx)
            else:
                for layer in self.layers:
                    x = layer(x, ctx)
            if batch.drafts:
                self.unsettled.update(sid for i, sid in enumerate(batch.seq_ids) if batch.verifies(i))
            if ops:
                self.prefix.store(ops, self.caches)
            # a few attribute reads per sequence and layer: negligible next to the step
            self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache_bytes())
            if not self.last:
                return x
            rows = batch.logit_rows       # decode: every row, with no index to copy to a GPU (which waits for it)
            logits = linear(rms_norm(take_rows(x, rows), self.norm, self.config.rms_eps), self.head).float()
        if batch.sampling is None:
            return logits.cpu()
        results = sample_chunks(logits, batch.sampling, self.matchers)
        if self.mtp is not None:    # the head follows the sequences and drafts where asked: a fourth item
            with torch_threads_for(batch.n_tokens):
                drafts = self.mtp.step(batch, rms_norm(x, self.norm, self.config.rms_eps), results)
            results = [r if d is None else (*r, d) for r, d in zip(results, drafts)]
        # the next step may be planned before these tokens reach the coordinator: the stage that embeds it keeps them
        if self.first:      # None for a failed sampling: a follow step stops there
            for c, start, n, result in zip(batch.sampling, batch.start_pos, batch.lengths, results):
                if c.tip is not None:
                    self.sampled[c.seq_id] = next_input(start, n, result)[1]
        elif self.link is not None:
            self.link.pass_back([(c.seq_id, *next_input(start, n, result))
                                 for c, start, n, result in zip(batch.sampling, batch.start_pos, batch.lengths, results)
                                 if c.tip is not None])
        return results

    def _settle(self, batch: StepBatch, caches: dict):
        """Drop what rejected drafts left in the caches of the batch's sequences whose last step verified drafts."""
        for sid, start in zip(batch.seq_ids, batch.start_pos):
            if sid in self.unsettled:
                self.unsettled.discard(sid)
                for cache in caches[sid].values():
                    cache.settle(start)
