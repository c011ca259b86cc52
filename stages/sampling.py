"""Sampling parameters, their validation, and per-sequence samplers.

The last pipeline stage samples (sample_chunks). Each draw is a function of the sequence's seed
and the token's position (uniform), so a seeded request draws the same tokens whatever else shares
its batch and whichever PP degree, expert placement or transport runs it. Logprobs are the log-softmax of the raw logits (before
logit_bias, penalties, temperature, top-k, min-p or top-p: vLLM's default).

Before temperature, a row's logits may be adjusted (adjust_logits, in vLLM's order): logit_bias
added, then the repetition penalty on every token seen in the prompt or the output, then the
frequency and presence penalties from the output's token counts. The sequence's history travels
with its ChunkSampling (only when a penalty is set), so the last stage keeps no state of its own and
a restarted stage samples the same. A grammar (structured outputs, stages/structured.py) then leaves
only the tokens it allows: its matcher lives on the last stage but is rebuilt from the same history
whenever it is not in step with it. After temperature and top-k, min_p drops the tokens whose
probability is below min_p times the best token's; then top-p. Greedy (temperature 0) takes the
argmax of the adjusted row.

Validation bounds every value by what the arithmetic can bear: a temperature below
MIN_TEMPERATURE (but above 0) is greedy, as 0 is, since dividing by it would overflow;
max_tokens is at most the model's context; stop strings are at most MAX_STOPS strings of at
most MAX_STOP_CHARS characters each; logit_bias holds at most MAX_LOGIT_BIAS entries and
stop_token_ids at most MAX_STOP_TOKEN_IDS ids, each inside the vocabulary.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, fields

import torch

from kernels.linear import take_rows

from .errors import RequestError

log = logging.getLogger("raymoe.sampling")
MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-5     # below it (and above 0) sampling is greedy: logits / temperature would overflow
MAX_STOPS = 16
MAX_STOP_CHARS = 256
NUCLEUS_GUESSES = (256, 4096)   # top-p looks for its nucleus among this many best tokens before sorting them all
MAX_LOGIT_BIAS = 300            # entries of logit_bias (as OpenAI)
MAX_BIAS = 100.0                # |bias| of one logit_bias entry (as OpenAI)
MAX_PENALTY = 2.0               # |presence_penalty|, |frequency_penalty| (as OpenAI)
REPETITION_RANGE = (0.01, 100.0)   # repetition_penalty (1: off); adjust_logits keeps the row finite
MAX_STOP_TOKEN_IDS = 256
MAX_N = 16                      # choices of one HTTP request (deploy/openai_api.py)
MAX_GRAMMAR_CHARS = 1024 * 1024     # a grammar's text (stages/structured.py compiles it)
# the fields a model's generation_config.json (or GGUF general.sampling.*) may give defaults for
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_TOKEN_KEY = re.compile(r"-?[0-9]{1,19}")


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
    presence_penalty: float = 0.0     # subtracted from the logit of every token the output holds (OpenAI)
    frequency_penalty: float = 0.0    # times the token's count in the output, subtracted (OpenAI)
    repetition_penalty: float = 1.0   # tokens of prompt or output: logit / it when positive, * it else (vLLM, HF)
    min_p: float = 0.0                # drop tokens less likely than min_p times the best one
    logit_bias: dict = field(default_factory=dict)      # token id -> added to its logit
    stop_token_ids: list = field(default_factory=list)  # tokens that end the sequence ("stop")
    grammar: str | None = None        # a Lark grammar the output keeps to (stages/structured.py)

    @classmethod
    def from_dict(cls, values: dict, defaults: "SamplingParams | None" = None,
                  context_length: int | None = None, vocab: int | None = None) -> "SamplingParams":
        """Defaults overridden by the known keys of `values`; every value is checked (see validate)."""
        base = {f.name: getattr(defaults or cls(), f.name) for f in fields(cls)}
        for name in base:
            if name in values and values[name] is not None:
                base[name] = values[name]
        params = cls(**base)
        params.validate(context_length, vocab)
        return params

    @property
    def penalized(self) -> bool:
        """Whether a penalty needs the sequence's history (ChunkSampling.output_ids)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_history(self) -> bool:
        """Whether the last stage needs the tokens generated so far (ChunkSampling.output_ids): for a
        penalty, or to advance the grammar's matcher."""
        return self.penalized or self.grammar is not None

    @property
    def adjusts_logits(self) -> bool:
        return self.penalized or bool(self.logit_bias)

    def validate(self, context_length: int | None = None, vocab: int | None = None):
        """Raise RequestError (one line naming the field and its limit) for any value out of bounds;
        with context_length, max_tokens may not exceed the model's context; with vocab, the token ids of
        logit_bias and stop_token_ids must be in it. logit_bias becomes {int id: float bias} (JSON gives
        string keys) and stop_token_ids a list."""
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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise RequestError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {_short(v)}")
        low, high = REPETITION_RANGE
        if not is_num(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise RequestError(f"repetition_penalty must be a number in [{low:g}, {high:g}] (1: none), "
                               f"got {_short(self.repetition_penalty)}")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be a number in [0, 1], got {_short(self.min_p)}")
        self.logit_bias = _check_logit_bias(self.logit_bias, vocab)
        self.stop_token_ids = _check_stop_token_ids(self.stop_token_ids, vocab)
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or len(self.grammar) > MAX_GRAMMAR_CHARS:
                raise RequestError(f"grammar must be a string of at most {MAX_GRAMMAR_CHARS} characters "
                                   f"(a Lark grammar in llguidance's syntax)")
            if self.ignore_eos:       # the grammar ends the output with an end token
                raise RequestError("ignore_eos cannot be combined with structured output (response_format, "
                                   "a forced tool call or a grammar)")
        # last, so that a request is refused for the same field whether or not the context is known yet
        if context_length is not None and self.max_tokens > context_length:
            raise RequestError(f"max_tokens must be at most the model's context ({context_length} tokens), "
                               f"got {self.max_tokens}")


def _token_id(value, field: str, vocab: int | None, strings: bool = False) -> int:
    """A token id of a request's field: an int (with `strings`, also its decimal string: JSON object keys)
    inside the vocabulary."""
    if strings and isinstance(value, str) and _TOKEN_KEY.fullmatch(value):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{field} must hold token ids (integers), got {_short(value)}")
    if value < 0 or (vocab is not None and value >= vocab):
        bound = f"0..{vocab - 1}" if vocab is not None else ">= 0"
        raise RequestError(f"{field} token id {value} is outside the vocabulary ({bound})")
    return value


def _check_logit_bias(bias, vocab: int | None) -> dict:
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must be an object mapping token ids to biases, got {_short(bias)}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out = {}
    for key, value in bias.items():
        token = _token_id(key, "logit_bias", vocab, strings=True)
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not -MAX_BIAS <= value <= MAX_BIAS):
            raise RequestError(f"logit_bias values must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got "
                               f"{_short(value)} for token {token}")
        if token in out:
            raise RequestError(f"logit_bias names token {token} twice")
        out[token] = float(value)
    return out


def _check_stop_token_ids(ids, vocab: int | None) -> list:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise RequestError(f"stop_token_ids must be a list of token ids, got {_short(ids)}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
    return [_token_id(t, "stop_token_ids", vocab) for t in ids]


def model_defaults(values: dict, where: str) -> dict:
    """The sampling defaults a model file gives (MODEL_DEFAULT_FIELDS present in `values`), each checked
    alone; a value the validation refuses is left out with a warning (the built-in default then applies)."""
    out = {}
    for name in MODEL_DEFAULT_FIELDS:
        value = values.get(name)
        if value is None:
            continue
        if name == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)
        try:
            SamplingParams.from_dict({name: value})
        except RequestError as e:
            log.warning("%s: ignoring the default %s: %s", where, name, e)
            continue
        out[name] = value
    return out


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


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with n choices: the request's own for the first (so n=1 and
    choice 0 agree), a splitmix64 mix of (seed, index) for the others, in [0, 2**63)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) >> 1


def adjust_logits(logits: torch.Tensor, p: SamplingParams, output_ids=(), prompt_ids=()) -> torch.Tensor:
    """A float32 row [V] with the request's logit_bias and penalties applied (a new tensor), in vLLM's order:
    the bias added; then every token in prompt_ids or output_ids divided by repetition_penalty where its
    logit is positive and multiplied by it where not; then frequency_penalty times the token's count in
    output_ids and presence_penalty (once) subtracted for every token of output_ids. Values stay finite."""
    row = logits.clone()
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
    if p.repetition_penalty != 1 and (len(output_ids) or len(prompt_ids)):
        seen = torch.unique(torch.tensor([*prompt_ids, *output_ids], dtype=torch.long))
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and len(output_ids):
        ids, counts = torch.unique(torch.tensor(list(output_ids), dtype=torch.long), return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    # a huge logit times a penalty may leave float32: keep the row finite (softmax of +-inf is NaN)
    limit = torch.finfo(row.dtype).max
    return row.clamp_(-limit, limit)


def sample_token(logits: torch.Tensor, p: SamplingParams, seed: int, position: int) -> int:
    """One token from a float32 logits row [V] (already adjusted, see adjust_logits): greedy below
    MIN_TEMPERATURE, else temperature, top-k, min-p and top-p, then the token where uniform(seed, position)
    falls in the cumulative distribution."""
    if p.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    # relative to the best logit, so the scaled values are <= 0 and never overflow to +inf
    scaled = (logits - logits.max()) / p.temperature
    if p.top_k > 0 and p.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.min_p > 0:
        # the best token's probability is the largest: relative to it (and renormalised, for top-p)
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0)
        probs = probs / probs.sum()
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
    seq_id: int = 0                # whose grammar matcher (stages/structured.py Matchers) to use
    # what the penalties and a grammar need (only set when the params have one, and a token is sampled):
    # the tokens generated so far, and (repetition_penalty) the prompt's distinct tokens
    output_ids: list[int] | None = None
    prompt_ids: list[int] | None = None


def sample_chunks(logits: torch.Tensor, chunks: list[ChunkSampling], matchers=None) -> list:
    """Per chunk (token or None, its logprob entry or None, [prompt logprob entries]), or a one-line error
    message when that chunk's sampling raised (a bug or bad numbers: its sequence alone fails, the step
    does not). Greedy chunks without logprobs (the common case) share one argmax over their rows, on the
    logits' device (a GPU's: only the token ids come to the host); the others sample on the host.
    `matchers` (stages.structured.Matchers) gives the masks of the chunks with a grammar, all at once."""
    plain = [c.tip for c in chunks if c.tip is not None and c.params.temperature < MIN_TEMPERATURE
             and c.params.logprobs is None and not c.params.adjusts_logits and c.params.grammar is None]
    # a decode step's rows are all of the logits' rows: no copy of them (1 MB a row at 248k tokens)
    best = dict(zip(plain, torch.argmax(take_rows(logits, plain), -1).tolist())) if plain else {}
    if logits.device.type != "cpu" and any((c.tip is not None and c.tip not in best) or c.targets for c in chunks):
        logits = logits.cpu()       # the rest samples on the host (its generators are the CPU's)
    constrained = [c for c in chunks if c.tip is not None and c.params.grammar is not None]
    masks = matchers.masks([(c.seq_id, c.params.grammar, c.output_ids or []) for c in constrained]) \
        if constrained else []
    allowed = {id(c): mask for c, mask in zip(constrained, masks)}
    out = []
    for c in chunks:
        try:
            out.append((best[c.tip], None, []) if c.tip in best and not c.targets
                       else _sample_chunk(logits, c, allowed.get(id(c))))
        except Exception as e:
            log.exception("sampling failed (seed %s, position %s)", c.seed, c.position)
            out.append(f"{type(e).__name__}: {e}")
    return out


def _sample_chunk(logits: torch.Tensor, c: ChunkSampling, allowed=None) -> tuple:
    """`allowed`: with a grammar, the mask of the tokens it allows (or why there is none)."""
    prompt = []
    if c.targets:
        rows = torch.log_softmax(logits[c.first:c.first + len(c.targets)], -1)
        prompt = [logprob_entry(rows[r], t, c.prompt_k) for r, t in enumerate(c.targets)]
    token = entry = None
    if c.tip is not None:
        row = logits[c.tip]
        adjusted = row
        if c.params.adjusts_logits:
            adjusted = adjust_logits(row, c.params, c.output_ids or (), c.prompt_ids or ())
        if c.params.grammar is not None:
            if isinstance(allowed, str):
                raise RuntimeError(allowed)
            adjusted = adjusted.masked_fill(~allowed, float("-inf"))
        token = sample_token(adjusted, c.params, c.seed, c.position)
        if c.params.logprobs is not None:        # of the raw logits (module doc)
            entry = logprob_entry(torch.log_softmax(row, -1), token, c.params.logprobs)
    return token, entry, prompt
