"""One request's life: its tokens, how far the caches have got, what it has produced."""
from __future__ import annotations

import os

from raymoe.stages.text.detokenizer import Detokenizer
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.stages.runtime.sampler import ChunkSampling
from raymoe.stages.runtime.speculation import speculation_load


class Sequence:
    def __init__(self, seq_id: int, request_id, prompt_ids: list[int], params: SamplingParams,
                 tokenizer, eos_ids: set[int], context_length: int):
        self.seq_id, self.request_id = seq_id, request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        # unseeded requests get a random seed: every draw is a function of (seed, position)
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.tokenizer, self.eos_ids, self.context_length = tokenizer, eos_ids, context_length
        self.output_ids: list[int] = []
        self.stop_ids = frozenset(params.stop_token_ids)
        self._prompt_set: list[int] | None = None      # the prompt's distinct tokens (repetition_penalty)
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.n_cached = 0                # tokens whose effect is in every stage's cache
        self.cached_tokens = 0           # prompt tokens the prefix cache gave it (usage: not computed again)
        self.group: int | None = None    # its micro-batch group once admitted (stages/runtime/engine.py)
        self.cache_need: tuple | None = None   # bytes of cache per stage it was admitted with (CacheBudget)
        self.prefix_chain: list[bytes] | None = None     # its prompt's block names (stages/prefix/cache.py)
        self.prefix_restore: list[bytes] | None = None   # cached blocks its caches start from, until sent
        self.prefix_snapshot_at: int | None = None       # a block where it parts from a cached prompt
        self.finish_reason: str | None = None
        self.text = ""
        self.detokenizer = Detokenizer(tokenizer)
        self.cancelled = False           # set by the server when the client went away
        self.error: str | None = None
        self.script: list[int] | None = None   # test hook: tokens in place of the sampled ones (scripted_outputs)
        self.spec = None                 # its speculation state (stages/runtime/speculation.py), once it drafts
        self.draft_tokens = self.accepted_tokens = self.verify_steps = 0   # drafts sent and kept, steps (usage)

    @property
    def max_length(self) -> int:
        """The most tokens it can come to hold: its prompt and max_tokens, at most the context."""
        return min(len(self.prompt_ids) + self.params.max_tokens, self.context_length)

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, length: int) -> list[int]:
        n = len(self.prompt_ids)
        if start >= n:          # a decode step: no copy of the prompt
            return self.output_ids[start - n:start - n + length]
        return (self.prompt_ids + self.output_ids)[start:start + length]

    @property
    def prefilling(self) -> bool:
        """More than one token to run: the prompt, or everything again after a stage lost its caches."""
        return self.n_cached < self.n_tokens - 1

    def next_chunk(self, limit: int, grid: int) -> tuple[int, int]:
        """(start, length) of the next tokens to run: the rest of the prompt (up to limit), or one decode token.
        A chunk never crosses a multiple of `grid`, so a prefill is split at the same positions whether it
        starts at 0 or after a cached prefix (docs/prefix-cache.md)."""
        start = self.n_cached
        return start, min(limit, self.n_tokens - start, grid - start % grid)

    def sampling(self, start: int, length: int, row: int, logit_row: int) -> tuple[ChunkSampling, list[int]]:
        """What the last stage computes for the chunk (start, length), whose tokens are batch rows from `row`
        and whose logits will be those from `logit_row`: the logprobs of the prompt tokens it predicts that are
        not recorded yet (kept from before a recompute), and the next token at the tip. Returns it and the
        batch rows it needs logits of."""
        c = ChunkSampling(params=self.params, seed=self.seed, position=len(self.output_ids), first=logit_row,
                          seq_id=self.seq_id)
        if self.params.needs_history and start + length == self.n_tokens:
            # the history travels with the chunk: the last stage keeps no per-sequence state but a grammar's
            # matcher, which it rebuilds from this when out of step (stages/runtime/sampler.py)
            c.output_ids = list(self.output_ids)
            if self.params.repetition_penalty != 1:
                if self._prompt_set is None:
                    self._prompt_set = sorted(set(self.prompt_ids))
                c.prompt_ids = self._prompt_set
        rows = []
        if self.prompt_logprobs is not None:
            # row r predicts token start + r + 1; the next one to record is len(prompt_logprobs)
            first = max(len(self.prompt_logprobs), start + 1)
            c.targets = self.prompt_ids[first:min(start + length + 1, len(self.prompt_ids))]
            c.prompt_k = self.params.prompt_logprobs
            rows = list(range(row + first - start - 1, row + first - start - 1 + len(c.targets)))
        if start + length == self.n_tokens:
            c.tip = logit_row + len(rows)
            rows.append(row + length - 1)
        return c, rows

    def verify_sampling(self, drafts: list[int], logit_row: int) -> ChunkSampling:
        """What the last stage computes for a verify chunk (its next decode token, then `drafts`), whose logits are
        those from `logit_row`, one per token."""
        return ChunkSampling(params=self.params, seed=self.seed, position=len(self.output_ids), first=logit_row,
                             tip=logit_row, seq_id=self.seq_id, drafts=list(drafts))

    def record(self, length: int, token: int | list[int] | None, entry, prompt_entries: list[dict]):
        """Apply what the last stage returned for a chunk of `length` tokens (for a verify chunk: the drafts kept
        and the model's own token, with their entries)."""
        if isinstance(token, list):
            self.n_cached += len(token)
            self.draft_tokens += length - 1
            self.verify_steps += 1
            self.accepted_tokens += len(token) - 1
            for i, t in enumerate(token):
                self.append_token(t, None if entry is None else entry[i])
                if self.finish_reason is not None:
                    break
            return
        self.n_cached += length
        if prompt_entries:
            self.prompt_logprobs.extend(prompt_entries)
        if token is not None:
            if self.script is not None and len(self.output_ids) < len(self.script):
                token = self.script[len(self.output_ids)]
                entry = None if entry is None else {**entry, "token_id": token}
            self.append_token(token, entry)

    @property
    def end_ids(self) -> frozenset:
        """The tokens that end it when sampled (append_token): its stop tokens, and its end-of-text ones unless
        ignore_eos."""
        return self.stop_ids if self.params.ignore_eos else self.stop_ids | self.eos_ids

    def append_token(self, token: int, entry: dict | None = None):
        self.output_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(entry)
        if token in self.eos_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
            self.text += self.detokenizer.finish()
            return
        seen = len(self.text)
        self.text += self.detokenizer.add(token)
        # a stop token ends the sequence as vLLM's does: it stays in the output, its text too (none if special)
        stop_token = token in self.stop_ids
        done = (stop_token or len(self.output_ids) >= self.params.max_tokens
                or self.n_tokens >= self.context_length)
        if done:
            self.text += self.detokenizer.finish()
        if not self._stopped(seen) and done:
            self.finish_reason = "stop" if stop_token else "length"

    def _stopped(self, seen: int) -> bool:
        """Whether a stop string occurs in the text: only text added after `seen` can hold a new one (the
        first occurrence, as a full scan finds). The text is cut before it."""
        for stop in self.params.stop:
            at = self.text.find(stop, max(0, seen - len(stop) + 1))
            if at >= 0:
                self.text = self.text[:at]
                self.finish_reason = "stop"
                return True
        return False

    def speculation_usage(self) -> dict:
        """Its drafts' counts, for its usage (none without drafts)."""
        if not self.draft_tokens:
            return {}
        return {"speculation": speculation_load(self.draft_tokens, self.accepted_tokens, self.verify_steps)}

    def result(self) -> dict:
        if self.error:
            return {"id": self.request_id, "error": self.error}
        return {
            "id": self.request_id,
            "prompt_token_ids": self.prompt_ids,
            "token_ids": self.output_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.output_ids),
                      "cached_tokens": self.cached_tokens, **self.speculation_usage()},
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
        }
