"""How many prompt tokens the steps in flight may hold while sequences decode: an inter-token latency target.

A decoding sequence's next token waits for every step queued ahead of its own. A step costs about
`t0 + c·p` seconds for `p` prompt tokens: `t0` for its decodes (on a CPU, mostly the weights read once),
`c` for each prompt token. Both are measured as steps complete (the gap between two completions, or
since the step was planned if the pipeline was idle). While any sequence decodes, the steps in flight
together hold at most the prompt tokens that keep that wait within the target, and at least MIN_PREFILL
when none holds any, so that prompts always progress (and measure `c` first). Until a decode step has
been seen, and with nothing decoding, steps fill their token budget as without a target.

Smaller prompt chunks read the weights more often per prompt token: time to first token grows as
inter-token latency falls (docs/serving.md measures the trade).
"""
from __future__ import annotations

import time

MIN_PREFILL = 16      # prompt tokens a step may always take when none are in flight
SMOOTHING = 0.25      # weight of the newest measurement in the running estimates


class PrefillBudget:
    def __init__(self, target_s: float, clock=time.perf_counter):
        self.target_s, self.clock = target_s, clock
        self.decode_s: float | None = None        # t0: a step's cost without prompt tokens
        self.token_s: float | None = None         # c: each prompt token's cost on top
        self.in_flight: dict[int, tuple[int, float]] = {}   # id(plan) -> (its prompt tokens, when planned)
        self.last_done: float | None = None

    def allowance(self, groups_busy: int) -> int | None:
        """Prompt tokens the next step may take while sequences decode (None: no bound yet), given how many
        micro-batch groups have sequences (each one's decode step is queued ahead of a token too)."""
        if self.decode_s is None:
            return None
        held = sum(p for p, _ in self.in_flight.values())
        if self.token_s is None:            # a small chunk measures what a prompt token costs
            total = 0
        else:
            total = int((self.target_s - groups_busy * self.decode_s) / max(self.token_s, 1e-9))
        return max(total - held, 0 if held else MIN_PREFILL)

    def planned(self, plan, prompt_tokens: int):
        self.in_flight[id(plan)] = (prompt_tokens, self.clock())

    def done(self, plan):
        """A planned step completed: update the cost estimates from how long it took."""
        if id(plan) not in self.in_flight:
            return
        prompt_tokens, planned_at = self.in_flight.pop(id(plan))
        now = self.clock()
        took = now - max(planned_at, self.last_done or planned_at)
        self.last_done = now
        if not prompt_tokens:
            self.decode_s = _smooth(self.decode_s, took)
        elif self.decode_s is not None:
            self.token_s = _smooth(self.token_s, max(took - self.decode_s, 0.0) / prompt_tokens)

    def forget(self, plan):
        """A planned step whose result is not used (stages/runtime/engine.py drop_ahead)."""
        self.in_flight.pop(id(plan), None)

    def forget_in_flight(self):
        """The steps in flight were dropped (a stage restarted): they will not complete."""
        self.in_flight.clear()
        self.last_done = None


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
