"""Speculative decoding's decisions, taken by the engine core wherever it runs: which drafts a decoding
sequence sends with its next token, and how many (docs/speculative-decoding.md).

A step then runs the sequence's last token and its k drafts as one chunk of k + 1 rows (a verify chunk,
StepBatch.drafts): every product reads its weights once for all of them, while the mixers take the rows one
after another as k + 1 decode steps would (the same bits). The last stage keeps the drafts its model agrees
with and one token of its own (stages/runtime/sampler.py); the stages drop what the rejected rows left in
their caches at the sequence's next step (stages/layers/cache.py).

A drafter proposes tokens from what a sequence holds, `propose(seq, k)`: `NgramDrafter` looks its last tokens
up earlier in its prompt and output (prompt lookup); `MtpDrafter` hands out what the model's MTP head drafted on
the last stage right after it sampled the sequence's last token (stages/runtime/mtp.py), asked for with that
step (`asks`). A draft model or an EAGLE head would plug in the same way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from raymoe.stages.errors import RaymoeError

METHODS = ("ngram", "mtp")
# a step's decode and verify rows, at most: up to 8 rows the products compute each row as it would alone
# (docs/merged-steps.md), so a verify chunk's rows get the bits of the decode steps they stand for
ROWS_ALONE = 8
MAX_DRAFTS = ROWS_ALONE - 1
EMA = 0.2               # weight of a new measurement in the running estimates
PROBE_EVERY = 64        # steps without drafts after which a sequence tries one again (its acceptance may have changed)
FOLLOW_CALLS = 2        # calls sent ahead (plan_ahead) in a row for a sequence that had no drafts, before it looks again


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, as vLLM spells it: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m}, or {"method": "mtp", "num_speculative_tokens": k} with the
    model's own MTP head, or a GGUF of the head as llama.cpp's converter writes it with --mtp ("model": path)."""
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From the flag's JSON text (or a dict from a config file); None for no value. A bad one raises
        RaymoeError naming what is wrong."""
        if value in (None, "", {}):
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise RaymoeError(f"--speculative-config: not JSON ({e.msg})") from None
        if not isinstance(value, dict):
            raise RaymoeError("--speculative-config: expected a JSON object such as "
                              '{"method": "ngram", "num_speculative_tokens": 3}')
        method = value.get("method", "ngram")
        if method not in METHODS:
            raise RaymoeError(f"--speculative-config: method {method!r} is not supported (choose {', '.join(METHODS)})")
        known = {"method", "num_speculative_tokens"} | ({"model"} if method == "mtp" else
                                                        {"prompt_lookup_max", "prompt_lookup_min"})
        unknown = sorted(set(value) - known)
        if unknown:
            raise RaymoeError(f"--speculative-config: unknown field {unknown[0]!r} for method {method!r}")
        model = value.get("model")
        if model is not None and not (isinstance(model, str) and model):
            raise RaymoeError(f"--speculative-config: model must be the path of the MTP head's GGUF, not {model!r}")
        fields = {k: v for k, v in value.items() if k not in ("method", "model")}
        for name, v in fields.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise RaymoeError(f"--speculative-config: {name} must be a positive integer, not {v!r}")
        config = cls(method=method, model=model, **fields)
        if config.num_speculative_tokens > MAX_DRAFTS:
            raise RaymoeError(f"--speculative-config: num_speculative_tokens {config.num_speculative_tokens} is "
                              f"more than {MAX_DRAFTS}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise RaymoeError("--speculative-config: prompt_lookup_min is more than prompt_lookup_max")
        return config


class NgramIndex:
    """A sequence's tokens, and where each of their n-grams (n in [low, high]) last occurred, kept up to date as
    tokens are added: {n-gram: the position of the token after it}."""

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high
        self.tokens: list[int] = []
        self.seen: dict[tuple, int] = {}

    def extend(self, new: list[int]):
        """Add tokens; index the n-grams that end before each of them (the last token has none after it yet)."""
        tokens, start = self.tokens, len(self.tokens)
        tokens += new
        for i in range(max(start, 1), len(tokens)):
            for n in range(self.low, min(self.high, i) + 1):
                self.seen[tuple(tokens[i - n:i])] = i

    def follow(self, k: int) -> list[int]:
        """k tokens after the latest earlier occurrence of the tokens' last n-gram, the longest n that occurred; an
        occurrence closer than k tokens repeats what it copies (a loop of a few tokens goes on); none without one."""
        tokens = self.tokens
        for n in range(min(self.high, len(tokens) - 1), self.low - 1, -1):
            at = self.seen.get(tuple(tokens[-n:]))
            if at is not None:
                out: list[int] = []
                for i in range(at, at + k):
                    out.append(tokens[i] if i < len(tokens) else out[i - len(tokens)])
                return out
        return []


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of a sequence's last n tokens, the
    longest n from prompt_lookup_max down to prompt_lookup_min that occurs (vLLM's `ngram`, llama.cpp's
    `ngram-simple`). No model runs: greedy text that repeats itself, code edits and quoted documents are what
    it predicts."""

    def __init__(self, config: SpeculativeConfig):
        self.low, self.high = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seq, k: int) -> list[int]:
        index = seq.spec.index
        if index is None:
            index = seq.spec.index = NgramIndex(self.low, self.high)
        known = len(index.tokens)
        index.extend(seq.token_slice(known, seq.n_tokens - known))     # only what it has not seen
        return index.follow(k)


class MtpDrafter:
    """The drafts the model's MTP head made on the last stage after the sequence's last token (stages/runtime/mtp.py),
    when the step that sampled it asked for them (Speculation.asks)."""

    def propose(self, seq, k: int) -> list[int]:
        state = seq.spec
        return state.proposed[:k] if state.proposed_at == seq.n_tokens else []


class SequenceSpeculation:
    """A sequence's speculation state: its drafter's index, the acceptance estimate, steps since it last drafted."""

    def __init__(self, acceptance: float = 0.5):
        self.index = None
        self.proposed: list[int] = []       # an MTP head's drafts, after its token number proposed_at
        self.proposed_at = -1
        self.acceptance = acceptance    # the chance that a draft is kept, given the ones before it were (running)
        self.idle = 0
        self.quiet = False          # its last step had no drafts
        self.follows = 0            # calls sent ahead for it since


class Speculation:
    """The engine's speculation: the drafter, the cost of a step by its rows (measured, a running average), and
    the counts a run reports. `drafts(seq, rows)` picks how many drafts a sequence sends in a step that already
    holds `rows` decode rows: the k that maximises the tokens it expects per second, 1 + a + a^2 + ... + a^k
    over the step's time with k more rows, a the sequence's running acceptance estimate (a new sequence starts from
    the engine's). A step's time is measured, never assumed: a verify step on a CPU reads the experts that any of its
    rows routes to, so its rows cost what the model's routing makes them cost. A step without drafts is measured
    first; a row count with no measurement is taken to cost what the nearest fewer measured rows cost, so it gets
    tried. The table and the acceptance outlive a sequence: what a first request learns, later ones start from."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.drafter = MtpDrafter() if config.method == "mtp" else NgramDrafter(config)
        self.step_s: dict[int, float] = {}       # decode steps' seconds by their rows
        self.acceptance = 0.5                    # over every sequence's drafts (a running estimate)
        self.drafted = self.accepted = self.verify_steps = 0

    def _state(self, seq) -> SequenceSpeculation:
        if seq.spec is None:
            seq.spec = SequenceSpeculation(self.acceptance)
        return seq.spec

    def _room(self, seq, later: int = 0) -> int:
        """The most drafts the sequence may send with its next token, or with the one `later` tokens after (0:
        none, as its sampling needs its history)."""
        p = seq.params
        if p.needs_history or seq.script is not None:
            return 0
        return min(self.config.num_speculative_tokens, p.max_tokens - len(seq.output_ids) - 1 - later,
                   seq.context_length - seq.n_tokens - 1 - later)

    def drafts(self, seq, rows: int) -> list[int]:
        """The drafts `seq` sends with its next token (none: a plain decode row)."""
        state, room = self._state(seq), self._room(seq)
        if room < 1:
            return []
        state.follows = 0
        k = self.length(state.acceptance, rows, room)
        if k == 0:
            state.idle += 1
            state.quiet = state.idle < PROBE_EVERY
            if state.quiet:
                return []
            k = 1
        state.idle = 0
        drafts = self.drafter.propose(seq, k)
        state.quiet = not drafts
        return drafts

    def asks(self, seq, rows: int) -> int:
        """With an MTP head: how many drafts the last stage makes after the token the step now planned samples for
        `seq`, for its next step (0: none, which costs nothing), as `drafts` would choose them now."""
        if self.config.method != "mtp":
            return 0
        state, room = self._state(seq), self._room(seq, later=1)
        if room < 1:
            return 0
        k = self.length(state.acceptance, rows, room)
        k = k if k or state.idle + 1 < PROBE_EVERY else 1
        if k:       # its next step waits for these drafts: none is sent ahead of them (may_follow)
            state.quiet = False
        return k

    def proposed(self, seq, drafts: list[int]):
        """The MTP head's drafts after the sequence's last token (a chunk's result brought them)."""
        state = self._state(seq)
        state.proposed, state.proposed_at = drafts, seq.n_tokens

    def may_follow(self, seq) -> bool:
        """Whether a step may be sent ahead for `seq` (stages/runtime/engine.py plan_ahead), before its token is back:
        only after a step without drafts, and FOLLOW_CALLS such calls in a row at most, so that it looks for drafts
        again every few tokens. Its drafts need the token they follow."""
        state = seq.spec
        if state is None or not state.quiet or state.follows >= FOLLOW_CALLS:
            return False
        state.follows += 1
        return True

    def length(self, acceptance: float, rows: int, most: int) -> int:
        """The draft length with the most expected tokens per second, for a row that joins `rows` others."""
        if rows + 1 not in self.step_s:     # what a step costs without drafts: measured first
            return 0
        best, best_rate, expected, gain = 0, 0.0, 0.0, 1.0
        for k in range(most + 1):
            if k:
                gain *= acceptance
                expected += gain
            rate = (1 + expected) / self.cost(rows + 1 + k)
            if rate > best_rate * 1.02:     # a longer draft must pay back more than noise
                best, best_rate = k, rate
        return best

    def cost(self, rows: int) -> float:
        known = [r for r in self.step_s if r <= rows]
        if not known:
            return min(self.step_s.values()) if self.step_s else 1.0
        return self.step_s[max(known)]

    def observe(self, rows: int, seconds: float):
        """A decode or verify step of `rows` rows (no prompt chunk) took `seconds`, planned to consumed."""
        old = self.step_s.get(rows)
        self.step_s[rows] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def verified(self, seq, drafted: int, accepted: int):
        """A verify step kept `accepted` of the sequence's `drafted` drafts."""
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        # a kept draft says "agreed" once; the first rejected one "disagreed" once; those after it say nothing
        agreed, tried = accepted, accepted + (accepted < drafted)
        for i in range(tried):
            agree = 1.0 if i < agreed else 0.0
            seq.spec.acceptance = (1 - EMA) * seq.spec.acceptance + EMA * agree
            self.acceptance = (1 - EMA) * self.acceptance + EMA * agree

    def load(self) -> dict:
        return speculation_load(self.drafted, self.accepted, self.verify_steps)


def speculation_load(drafted: int, accepted: int, verify_steps: int) -> dict:
    """The counts a run reports: drafts sent and kept, verify steps, the acceptance rate (kept / sent) and the
    mean accepted length (tokens a verify step gave, its own included)."""
    return {"draft_tokens": drafted, "accepted_tokens": accepted, "verify_steps": verify_steps,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "mean_accepted_length": round(1 + accepted / verify_steps, 4) if verify_steps else 0.0}
