"""Sampling parameters, their validation, and per-sequence samplers.

The last pipeline stage samples (sample_chunks). Each draw is a function of the sequence's seed
and the token's position (uniform), so a seeded request draws the same tokens whatever else shares
its batch and whichever PP degree, expert placement or transport runs it. Logprobs are the log-softmax of the raw logits (before
temperature, top-k or top-p).

Validation bounds every value by what the arithmetic can bear: a temperature below
MIN_TEMPERATURE (but above 0) is greedy, as 0 is, since dividing by it would overflow;
max_tokens is at most the model's context; stop strings are at most MAX_STOPS strings of at
most MAX_STOP_CHARS characters each.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

import torch

from .errors import RequestError

log = logging.getLogger("raymoe.sampling")
MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-5     # below it (and above 0) sampling is greedy: logits / temperature would overflow
MAX_STOPS = 16
MAX_STOP_CHARS = 256
NUCLEUS_GUESSES = (256, 4096)   # top-p looks for its nucleus among this many best tokens before sorting them all


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1: no top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False          # run to max_tokens through end tokens (as vLLM's; for benchmarks)

    @classmethod
    def from_dict(cls, values: dict, defaults: "SamplingParams | None" = None,
                  context_length: int | None = None) -> "SamplingParams":
        """Defaults overridden by the known keys of `values`; every value is checked (see validate)."""
        base = {f.name: getattr(defaults or cls(), f.name) for f in fields(cls)}
        for name in base:
            if name in values and values[name] is not None:
                base[name] = values[name]
        params = cls(**base)
        params.validate(context_length)
        return params

    def validate(self, context_length: int | None = None):
        """Raise RequestError (one line naming the field and its limit) for any value out of bounds;
        with context_length, max_tokens may not exceed the model's context."""
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {_short(self.max_tokens)}")
        if not is_num(self.temperature) or not 0 <= self.temperature <= 100:
            raise RequestError(f"temperature must be a number in [0, 100], got {_short(self.temperature)}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1], got {_short(self.top_p)}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise RequestError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {_short(self.top_k)}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2 ** 63):
            raise RequestError(f"seed must be a non-negative integer, got {_short(self.seed)}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError(f"stop must be a non-empty string or a list of them, got {_short(self.stop)}")
        if len(self.stop) > MAX_STOPS:
            raise RequestError(f"stop has {len(self.stop)} strings; at most {MAX_STOPS} are allowed")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise RequestError(f"stop strings may have at most {MAX_STOP_CHARS} characters, got one of {longest}")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be a boolean, got {_short(self.ignore_eos)}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {_short(v)}")
        # last, so that a request is refused for the same field whether or not the context is known yet
        if context_length is not None and self.max_tokens > context_length:
            raise RequestError(f"max_tokens must be at most the model's context ({context_length} tokens), "
                               f"got {self.max_tokens}")


def _short(value, limit: int = 80) -> str:
    """repr() cut to `limit` characters: an error message never echoes a huge value."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def logprob_entry(logprobs: torch.Tensor, token: int, k: int) -> dict:
    """{"token_id", "logprob", "top": [[id, logprob], ...]} with the k best alternatives."""
    top = []
    if k:
        values, ids = torch.topk(logprobs, k)
        top = [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist())]
    return {"token_id": int(token), "logprob": float(logprobs[token]), "top": top}


MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int) -> float:
    """The random number in [0, 1) of a sequence's token `position`: a counter-based stream (splitmix64
    of seed and position), so that whichever stage samples, after whatever restart, the same seed
    draws the same value for the same position."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((z ^ (z >> 31)) >> 11) / 2.0 ** 53


def sample_token(logits: torch.Tensor, p: SamplingParams, seed: int, position: int) -> int:
    """One token from a float32 logits row [V]: greedy below MIN_TEMPERATURE, else temperature, top-k and
    top-p, then the token where uniform(seed, position) falls in the cumulative distribution."""
    if p.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    # relative to the best logit, so the scaled values are <= 0 and never overflow to +inf
    scaled = (logits - logits.max()) / p.temperature
    if p.top_k > 0 and p.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1:
        # the nucleus usually lies within the few hundred best tokens: sort those, not a 248k vocabulary
        for k in NUCLEUS_GUESSES:
            sorted_probs, order = torch.topk(probs, min(k, probs.shape[0]))
            if k >= probs.shape[0] or sorted_probs.sum() >= p.top_p:
                break
        else:
            sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop[0] = False            # a top_p that is 0 in float32 (5e-324) still keeps the best token
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    cdf = probs.double().cumsum(0)
    token = int(torch.searchsorted(cdf, uniform(seed, position) * float(cdf[-1]), right=True))
    # the product can round up to the total: then the last token that has any probability
    return token if token < len(cdf) else int(probs.nonzero()[-1])


@dataclass
class ChunkSampling:
    """What the last stage does with one chunk's logits (Sequence.sampling builds it). `targets` are the
    prompt tokens whose logprobs are wanted, predicted by the logit rows from `first`; `tip` is the logit row
    of the chunk's last token when a new token follows it (else None)."""
    first: int = 0
    targets: list[int] = field(default_factory=list)
    prompt_k: int = 0
    tip: int | None = None
    params: SamplingParams | None = None
    seed: int = 0
    position: int = 0              # how many tokens the sequence has generated before this one


def sample_chunks(logits: torch.Tensor, chunks: list[ChunkSampling]) -> list:
    """Per chunk (token or None, its logprob entry or None, [prompt logprob entries]), or a one-line error
    message when that chunk's sampling raised (a bug or bad numbers: its sequence alone fails, the step
    does not). Greedy chunks without logprobs (the common case) share one argmax over their rows."""
    plain = [c.tip for c in chunks if c.tip is not None and c.params.temperature < MIN_TEMPERATURE
             and c.params.logprobs is None]
    best = dict(zip(plain, torch.argmax(logits[plain], -1).tolist())) if plain else {}
    out = []
    for c in chunks:
        try:
            out.append((best[c.tip], None, []) if c.tip in best and not c.targets else _sample_chunk(logits, c))
        except Exception as e:
            log.exception("sampling failed (seed %s, position %s)", c.seed, c.position)
            out.append(f"{type(e).__name__}: {e}")
    return out


def _sample_chunk(logits: torch.Tensor, c: ChunkSampling) -> tuple:
    prompt = []
    if c.targets:
        rows = torch.log_softmax(logits[c.first:c.first + len(c.targets)], -1)
        prompt = [logprob_entry(rows[r], t, c.prompt_k) for r, t in enumerate(c.targets)]
    token = entry = None
    if c.tip is not None:
        row = logits[c.tip]
        token = sample_token(row, c.params, c.seed, c.position)
        if c.params.logprobs is not None:
            entry = logprob_entry(torch.log_softmax(row, -1), token, c.params.logprobs)
    return token, entry, prompt
