"""One request's life: its tokens, how far the caches have got, what it has produced."""
from __future__ import annotations

import torch

from .sampling import Sampler, SamplingParams, logprob_entry


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (usually all of a: decoding one more token appends)."""
    if b.startswith(a):
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Sequence:
    def __init__(self, seq_id: int, request_id, prompt_ids: list[int], params: SamplingParams,
                 tokenizer, eos_ids: set[int], context_length: int):
        self.seq_id, self.request_id = seq_id, request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sampler = Sampler(params)
        self.tokenizer, self.eos_ids, self.context_length = tokenizer, eos_ids, context_length
        self.output_ids: list[int] = []
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.n_cached = 0                # tokens whose effect is in every stage's cache
        self.finish_reason: str | None = None
        self.text = ""
        self.cancelled = False           # set by the server when the client went away
        self.error: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefilling(self) -> bool:
        """More than one token to run: the prompt, or everything again after a stage lost its caches."""
        return self.n_cached < len(self.tokens) - 1

    def next_chunk(self, limit: int) -> tuple[int, int]:
        """(start, length) of the next tokens to run: the rest of the prompt (up to limit), or one decode token."""
        return self.n_cached, min(limit, len(self.tokens) - self.n_cached)

    def wants_all_rows(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def record_prompt_logprobs(self, start: int, logprobs: torch.Tensor):
        """logprobs[r] is the model's prediction after token start + r, i.e. of prompt token start + r + 1.
        Entries already recorded (before a recompute) are kept."""
        k = self.params.prompt_logprobs
        for r in range(logprobs.shape[0]):
            target = start + r + 1
            if target == len(self.prompt_logprobs) and target < len(self.prompt_ids):
                self.prompt_logprobs.append(logprob_entry(logprobs[r], self.prompt_ids[target], k))

    def append_token(self, logits: torch.Tensor):
        token = self.sampler.sample(logits)
        self.output_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob_entry(torch.log_softmax(logits, -1), token, self.params.logprobs))
        self._update_text_and_finish(token)

    def _update_text_and_finish(self, token: int):
        ends = token in self.eos_ids and not self.params.ignore_eos
        ids = self.output_ids[:-1] if ends else self.output_ids
        before, self.text = self.text, self.tokenizer.decode(ids, skip_special_tokens=True)
        if ends:
            self.finish_reason = "stop"
            return
        # No stop occurred in the text before this token, so a new occurrence ends after the part
        # both texts share: only that tail is scanned (the first occurrence, as a full scan finds).
        same = _common_prefix(before, self.text)
        for stop in self.params.stop:
            at = self.text.find(stop, max(0, same - len(stop) + 1))
            if at >= 0:
                self.text = self.text[:at]
                self.finish_reason = "stop"
                return
        if len(self.output_ids) >= self.params.max_tokens or len(self.tokens) >= self.context_length:
            self.finish_reason = "length"

    def result(self) -> dict:
        if self.error:
            return {"id": self.request_id, "error": self.error}
        return {
            "id": self.request_id,
            "prompt_token_ids": self.prompt_ids,
            "token_ids": self.output_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.output_ids)},
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
        }
