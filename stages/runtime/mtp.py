"""The multi-token prediction (MTP) head of Qwen3.5-MoE and Qwen3-Next on the last stage: it drafts the tokens
after the one the stage just sampled (speculative decoding, docs/speculative-decoding.md).

The head is one more decoder block (full attention + MoE) that predicts the token after next. Its row for
position p joins the model's final hidden state at p - 1 (after the output norm) with the embedding of token p:
`eh_proj(cat(enorm(embedding), hnorm(hidden)))`, then the block, then its own norm and the model's LM head. It keeps
a KV cache of its own per sequence, one row per position of the sequence.

Every step the last stage runs the head over the rows it computed that are real (a prompt chunk's, a decode
row's, a verify chunk's kept ones), each paired with the token after it (the next row's token, or the one just
sampled), so that its cache follows the sequence; a decode row that asks for no drafts is left out. Where the
coordinator asks for k drafts (`ChunkSampling.mtp`), the row of the token just sampled gives the first draft (the
argmax of its logits), and the head runs k - 1 more rows on its own output, each from the draft before; then those
rows leave its cache again. The embedding and the LM head are the model's: on a last stage that does not embed, the
stage loads the embedding too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raymoe.kernels.linear import linear, lookup_rows
from raymoe.kernels.norms import rms_norm

from raymoe.stages.layers.block import Block
from raymoe.stages.layers.cache import KVCache
from raymoe.stages.runtime.batch import StepBatch, StepContext


class MtpState:
    """A sequence's head: its KV cache and the hidden state of its last row whose next token a later chunk brings
    (position, state), or None."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.pending: tuple[int, torch.Tensor] | None = None


class MtpHead:
    """The head of a model whose config is `cfg`, read through `w` (stages.runtime.stage.StageWeights over the file
    that holds it); `embed`, `head` and `out_norm` are the model's embedding, LM head and output norm."""

    def __init__(self, family, cfg, w, embed, head, out_norm: torch.Tensor):
        self.index, self.eps = cfg.n_layers, cfg.rms_eps
        p = f"blk.{self.index}."
        self.eh_proj = w.matrix(p + "nextn.eh_proj.weight")
        self.enorm, self.hnorm = w(p + "nextn.enorm.weight"), w(p + "nextn.hnorm.weight")
        # llama.cpp falls back to the output norm where a file has no norm of the head's own
        self.norm = w(p + "nextn.shared_head_norm.weight") if p + "nextn.shared_head_norm.weight" in w.shapes \
            else out_norm
        mixer = family.mtp_mixer(cfg).build(w, p, cfg.rms_eps, family.rope(cfg), cfg.context_length)
        ffn = family.layer_ffn(cfg, self.index).build(w, self.index, None)     # its experts stay here
        self.block = Block(w, self.index, cfg.rms_eps, mixer, ffn)
        self.embed, self.head = embed, head
        self.states: dict[int, MtpState] = {}

    def cache_bytes(self) -> int:
        return sum(s.cache.nbytes() for s in self.states.values())

    def release(self, seq_id: int):
        self.states.pop(seq_id, None)

    def rows(self, seq_ids: list[int], starts: list[int], lengths: list[int], tokens: list[int],
             hidden: torch.Tensor) -> torch.Tensor:
        """Run the head over rows: per sequence `lengths` rows from position `starts`, token ids `tokens` and the
        model's hidden states `hidden` [T, H] before them (flat, sequence after sequence); returns its normed states
        [T, H], each the input of its logits and of the next draft's row. The rows join the sequences' caches."""
        e = lookup_rows(self.embed, torch.as_tensor(tokens, device=hidden.device))
        x = linear(torch.cat((rms_norm(e, self.enorm, self.eps), rms_norm(hidden, self.hnorm, self.eps)), -1),
                   self.eh_proj)
        batch = StepBatch(seq_ids=seq_ids, start_pos=starts, lengths=lengths)
        caches = {sid: {self.index: self.states[sid].cache} for sid in seq_ids}
        x = self.block(x, StepContext(batch=batch, positions=batch.positions().to(x.device), caches=caches))
        return rms_norm(x, self.norm, self.eps)

    def best(self, states: torch.Tensor) -> list[int]:
        """The argmax token of each state's logits."""
        return torch.argmax(linear(states, self.head), -1).tolist()

    def step(self, batch: StepBatch, hidden: torch.Tensor, results: list) -> list[list[int] | None]:
        """After the last stage sampled `results` for `batch`, whose rows' final hidden states (after the output
        norm) are `hidden`: the head takes the real rows into its caches, then drafts for each chunk that asks
        (per chunk: the drafts, or None)."""
        tokens = batch.token_ids.tolist() if isinstance(batch.token_ids, torch.Tensor) else batch.token_ids
        seq_ids, starts, lengths, pair_tokens, pair_hidden, asks = [], [], [], [], [], []
        for i, (sid, rows, start) in enumerate(batch.segments()):
            c, result = batch.sampling[i], results[i]
            state = self.states.setdefault(sid, MtpState(self.block.new_cache()))
            chunk = None if tokens is None else tokens[rows]
            n = rows.stop - rows.start
            # its sampling failed (the sequence ends), or a decode row that asks for no drafts: its row is left out
            # (the head attends over fewer positions when the sequence drafts again), so that a sequence whose drafts
            # do not pay costs the head nothing
            if isinstance(result, str) or not (c.mtp or n > 1):
                continue
            if isinstance(result[0], list):     # a verify chunk: the drafts kept, then the model's token
                nexts = result[0]
            else:
                nexts = (chunk[1:] if n > 1 else []) + ([result[0]] if c.tip is not None else [])
            first, parts = start + 1, [hidden[rows.start:rows.start + len(nexts)]]
            if state.pending is not None and state.pending[0] == start - 1 and chunk is not None:
                first, parts, nexts = start, [state.pending[1][None], *parts], chunk[:1] + nexts
            # a prompt chunk's last row pairs with the next chunk's first token
            state.pending = (start + n - 1, hidden[rows.stop - 1].clone()) if c.tip is None else None
            state.cache.truncate(first)     # what rejected drafts or the last drafts left
            if not nexts:
                continue
            seq_ids.append(sid)
            starts.append(first)
            lengths.append(len(nexts))
            pair_tokens += nexts
            pair_hidden += parts
            if c.tip is not None and c.mtp:     # drafts from the row of the token just sampled (its last)
                asks.append(Ask(i, sid, len(pair_tokens) - 1, first + len(nexts) - 1, c.mtp))
        drafts: list[list[int] | None] = [None] * len(results)
        if not seq_ids:
            return drafts
        states = self.rows(seq_ids, starts, lengths, pair_tokens, torch.cat(pair_hidden))
        going = list(zip(asks, states[[a.row for a in asks]]))
        for d in range(max((a.k for a in asks), default=0)):
            if d:       # the next row of each: the draft before, with the head's state before it
                out = self.rows([a.seq_id for a, _ in going], [a.position + d for a, _ in going], [1] * len(going),
                                [drafts[a.chunk][-1] for a, _ in going], torch.stack([s for _, s in going]))
                going = [(a, s) for (a, _), s in zip(going, out)]
            for (a, _), token in zip(going, self.best(torch.stack([s for _, s in going]))):
                drafts[a.chunk] = (drafts[a.chunk] or []) + [token]
            going = [(a, s) for a, s in going if a.k > d + 1]
        for a in asks:      # the drafts' rows leave the caches: the next step brings the real ones
            self.states[a.seq_id].cache.truncate(a.position + 1)
        return drafts


@dataclass
class Ask:
    """A chunk that asks for k drafts: its index, sequence, the flat row of the token just sampled among the head's
    rows, and that row's position."""
    chunk: int
    seq_id: int
    row: int
    position: int
    k: int
