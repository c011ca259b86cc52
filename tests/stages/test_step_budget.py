"""The inter-token latency bound (stages/runtime/step_budget.py): while sequences decode, the prompt tokens of the steps
ahead of their next token are cut to what the measured step costs allow, and prompts still progress. The
embedded model runs for real; the clock is a model of a CPU step's cost (t0 + c per prompt token), so that
what the bound does is exact and repeatable."""
import pytest

from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.stages.runtime.scheduler import Scheduler
from raymoe.stages.runtime.step_budget import MIN_PREFILL, PrefillBudget

DECODE_S, TOKEN_S = 0.5, 0.02        # the modelled step: 0.5 s plus 20 ms per prompt token (a 256-chunk: 5.6 s)


class StepClock:
    """Time that advances, for each step the stages run, by the modelled cost of its prompt tokens."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def run(self, batch):
        self.now += DECODE_S + TOKEN_S * sum(n for n in batch.lengths if n > 1)


def test_allowance_follows_the_measured_costs():
    clock = StepClock()
    budget = PrefillBudget(2.0, clock=clock)
    assert budget.allowance(1) is None                   # nothing measured yet: no bound
    for prompt_tokens, took in ((0, 0.5), (100, 2.5)):   # a decode step, then a step with 100 prompt tokens
        plan = object()
        budget.planned(plan, prompt_tokens)
        clock.now += took
        budget.done(plan)
        if not prompt_tokens:                            # a prompt token's cost is measured on a small chunk
            assert budget.allowance(1) == MIN_PREFILL
    assert budget.decode_s == pytest.approx(0.5) and budget.token_s == pytest.approx(0.02)
    assert budget.allowance(1) == 75                     # (2.0 - 0.5) / 0.02
    assert budget.allowance(2) == 50                     # another group's decode step is queued ahead too
    held = object()
    budget.planned(held, 60)
    assert budget.allowance(1) == 15                     # what steps in flight hold counts against it
    budget.planned(object(), 15)
    assert budget.allowance(1) == 0
    assert PrefillBudget(0.1, clock=clock).allowance(1) is None
    tight = PrefillBudget(0.1, clock=clock)
    tight.decode_s, tight.token_s = 0.5, 0.02            # even a decode alone misses it: prompts still progress
    assert tight.allowance(1) == MIN_PREFILL
    tight.planned(object(), MIN_PREFILL)
    assert tight.allowance(1) == 0


@pytest.mark.parametrize("target_s", [None, 2.0])
def test_a_long_prompt_does_not_hold_up_a_decoding_sequence(target_s):
    """One sequence decodes while a 700-token prompt arrives. Without a target, its 256-token chunks make the
    decoding sequence wait 5.6 s per token; with a 2 s target every step stays within it (the first takes a
    small chunk to measure a prompt token's cost), and the prompt still completes and answers."""
    clock = StepClock()
    engine = LocalEngine(open_model("tiny-qwen35moe"), scheduler=Scheduler(512, 256))
    engine.eos_ids = set()
    if target_s:
        engine.prefill_budget = PrefillBudget(target_s, clock=clock)
    for stage in engine.stages:
        forward = stage.forward
        stage.forward = lambda batch, x, forward=forward: (clock.run(batch), forward(batch, x))[1]
    decoding = engine.add_request("a", list(range(10, 18)), SamplingParams(max_tokens=60, temperature=0))
    for _ in range(3):
        engine.step()
    long = engine.add_request("b", [(7 * i) % 500 + 3 for i in range(700)], SamplingParams(max_tokens=2,
                                                                                           temperature=0))
    gaps = []
    while long.finish_reason is None:
        before, tokens = clock.now, len(decoding.output_ids)
        engine.step()
        assert len(decoding.output_ids) == tokens + 1          # a token every step
        gaps.append(clock.now - before)
    assert len(long.output_ids) == 2
    if target_s is None:
        assert max(gaps) == pytest.approx(DECODE_S + TOKEN_S * 256)
    else:
        assert gaps[0] == pytest.approx(DECODE_S + TOKEN_S * MIN_PREFILL)
        assert max(gaps) <= target_s + 1e-9, gaps
        assert max(gaps[1:]) >= target_s - TOKEN_S - 1e-9     # the bound is used, not undershot
