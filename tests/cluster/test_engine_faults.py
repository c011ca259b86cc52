"""Issue 14, case 1: a failure inside the engine ends only the requests it concerns, and a stalled
engine says so. The coordinator runs in this process (no Ray) over the whole model in one stage."""
import asyncio
import time
from collections import deque

import pytest
from local_pipeline import coordinator, results_of

from raymoe.stages.errors import RaymoeError
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime import sampler as sampling

pytestmark = pytest.mark.cluster

GREEDY = {"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def model():
    return open_model("tiny-qwen35moe")


def test_a_failing_sequence_fails_alone(model, monkeypatch, caplog):
    sample = sampling.sample_token

    def faulty(logits, params, seed, position):
        if seed == 13:
            raise RuntimeError("injected sampling failure")
        return sample(logits, params, seed, position)

    monkeypatch.setattr(sampling, "sample_token", faulty)

    async def go():
        coord = coordinator(model)
        first = await results_of(coord, {"good": GREEDY, "bad": {**GREEDY, "temperature": 1.0, "seed": 13}})
        later = await results_of(coord, {"later": GREEDY})
        return first, later

    first, later = asyncio.run(go())
    assert first["bad"] == {"id": "bad", "error": "internal error: RuntimeError: injected sampling failure"}
    assert len(first["good"]["token_ids"]) == 4 and later["later"]["token_ids"] == first["good"]["token_ids"]
    assert sum("Traceback" in r.exc_text for r in caplog.records if r.exc_text) == 1


def test_a_scheduler_failure_fails_its_micro_batch_and_the_loop_goes_on(model, caplog):
    async def go():
        coord = coordinator(model, fail_for=1)          # sequence 1 is "bad" (its own micro-batch group)
        first = await results_of(coord, {"good": GREEDY, "bad": GREEDY})
        later = await results_of(coord, {"later": GREEDY})
        return first, later, coord.loop_task.done()

    first, later, loop_ended = asyncio.run(go())
    assert first["bad"] == {"id": "bad", "error": "internal error: RuntimeError: injected submit failure"}
    assert len(first["good"]["token_ids"]) == 4 and later["later"]["token_ids"] == first["good"]["token_ids"]
    assert not loop_ended
    assert [r.message for r in caplog.records if r.exc_text] == [
        "the scheduler failed; failing the sequences concerned and going on"]


def test_a_fault_that_comes_back_every_turn_does_not_spin_the_loop(model, caplog):
    async def go():
        coord, turns = coordinator(model), []

        def broken():
            turns.append(1)
            if len(turns) > 100:      # a loop that never yields: end it here (the test fails, it does not hang)
                raise asyncio.CancelledError
            raise RuntimeError("injected: every turn")
        coord._launch = broken
        coord._ensure_loop()
        await asyncio.sleep(1.5)
        coord.loop_task.cancel()
        return len(turns)

    turns = asyncio.run(go())
    assert 3 <= turns <= 12         # waits of 2, 4, 8, ... ms, then 1 s: not a turn per microsecond
    assert sum("injected: every turn" in (r.exc_text or "") for r in caplog.records) == turns


def test_a_stalled_engine_is_unhealthy(model):
    async def go():
        coord = coordinator(model, hang=True)
        coord.progress_at -= 3600                      # idle for an hour: not a stall
        coord.check_health()
        await coord.submit("r", GREEDY)
        coord.check_health()                           # work just arrived: the stall clock starts now
        await asyncio.sleep(0.8)
        with pytest.raises(RaymoeError, match=r"no step completed for \d+ s while requests wait"):
            coord.check_health()

    asyncio.run(go())


def test_a_working_engine_stays_healthy(model):
    async def go():
        coord = coordinator(model)
        await coord.submit("r", {**GREEDY, "max_tokens": 64, "ignore_eos": True})
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            coord.check_health()
            await asyncio.sleep(0.05)

    asyncio.run(go())


def test_restarts_are_counted_over_a_window(model):
    """MAX_RESTARTS restarts within RESTART_WINDOW are recovered from, as are as many again once those are
    older than the window; one more within the window gives up, with an error that says so."""
    from raymoe.cluster.coordinator import MAX_RESTARTS, RESTART_WINDOW

    async def go():
        coord = coordinator(model)
        coord.pipeline.restart = lambda: []
        for _ in range(MAX_RESTARTS):
            await coord._recover()
        assert coord.error is None
        coord.recent_restarts = deque(t - RESTART_WINDOW - 1 for t in coord.recent_restarts)   # 10 minutes on
        for _ in range(MAX_RESTARTS):
            await coord._recover()
        assert coord.error is None and coord.load()["restarts"] == 2 * MAX_RESTARTS
        await coord.submit("r", GREEDY)                 # still serving
        await coord._recover()
        assert coord.error == f"the pipeline failed {MAX_RESTARTS + 1} times within 10 minutes; giving up"
        with pytest.raises(RaymoeError, match="giving up"):
            coord.check_health()

    asyncio.run(go())
