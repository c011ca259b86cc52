"""Sampling parameters as a request gives them, and their validation.

Validation bounds every value by what the arithmetic can bear: a temperature below
MIN_TEMPERATURE (but above 0) is greedy, as 0 is, since dividing by it would overflow;
max_tokens is at most the model's context; stop strings are at most MAX_STOPS strings of at
most MAX_STOP_CHARS characters each; logit_bias holds at most MAX_LOGIT_BIAS entries and
stop_token_ids at most MAX_STOP_TOKEN_IDS ids, each inside the vocabulary. The sampler that draws
with them runs on the last stage (stages/runtime/sampler.py).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, fields

from raymoe.stages.errors import RequestError

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
MAX_GRAMMAR_CHARS = 1024 * 1024     # a grammar's text (stages/text/structured.py compiles it)
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
    grammar: str | None = None        # a Lark grammar the output keeps to (stages/text/structured.py)

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
