"""Decode steps chained through the stages (cluster/chain.py), without Ray: the stages of one pipeline, each on
a thread as each would be in its actor, linked by real shm rings. A call of several steps of its sequences gives
the tokens the one-stage engine gives each alone, every stage stops where the first sees an end token, a call sent
after that token runs no step, and a stage that fails a step leaves none of the others waiting."""
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from raymoe.cluster.chain import ChainLink
from raymoe.cluster.shm import SHM_DIR, SLOTS, Ring, RingError, unlink
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.sampling_params import SamplingParams

MAX_TOKENS = 64


@pytest.fixture
def linked():
    """linked(model, n) -> a LocalEngine whose n stages are linked as a pipeline's over shm, and their links."""
    made = []

    def link(model: str, n: int):
        engine = LocalEngine(open_model(model), n_stages=n)
        links = [ChainLink() for _ in range(n)]
        prefix = f"{SHM_DIR}/raymoe-test-{uuid.uuid4().hex[:8]}"
        hidden = engine.config.hidden * 4 * MAX_TOKENS
        for i in range(n - 1):
            path = f"{prefix}-{i}"
            made.append(path)
            links[i + 1].ring_in = Ring.create(path, SLOTS, hidden)
            links[i].ring_out = Ring.attach(path, SLOTS, hidden)
        made.append(f"{prefix}-back")
        links[0].back = Ring.create(made[-1], 6, 24 * MAX_TOKENS)
        links[-1].back = Ring.attach(made[-1], 6, 24 * MAX_TOKENS)
        for stage, one in zip(engine.stages, links):
            stage.link = one
        return engine, links

    yield link
    for path in made:
        unlink(path)


def call(engine, links, batch, timeout=120):
    """What every stage's actor does with one call, at once; the last stage's result."""
    with ThreadPoolExecutor(len(links)) as pool:
        done = [pool.submit(link.forward, batch, stage.forward) for stage, link in zip(engine.stages, links)]
        return [f.result(timeout=timeout) for f in done][-1]


def greedy_tokens(model: str, prompt: list[int], n: int) -> list[int]:
    engine = LocalEngine(open_model(model))
    seq = engine.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0))
    engine.run_until_done()
    return seq.output_ids


@pytest.mark.parametrize("model, n_stages", [("tiny-qwen35moe", 2), ("tiny-gptoss", 3)])
def test_chained_steps_give_the_engines_tokens_and_stop_at_an_end_token(linked, model, n_stages):
    tokens = greedy_tokens(model, [5, 6, 7], 10)
    end = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])    # its first appearance
    engine, links = linked(model, n_stages)
    seq = engine.add_request("s", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0))
    batch, plan = engine.next_batch(0)
    first = call(engine, links, batch)       # the prompt, one call; its token goes back to the first stage
    ahead, ahead_plan = engine.plan_ahead(plan, steps=20)
    assert ahead.follow and ahead.steps == 9
    ahead.end_ids = [frozenset([tokens[end]])]
    results = call(engine, links, ahead)
    assert [first[0][0]] + [r[0] for r in results] == tokens[:end + 1]
    engine.consume(first, plan)
    engine.consume(results, ahead_plan[:len(results)])
    assert seq.output_ids == tokens[:end + 1]
    after = replace(ahead, start_pos=[3 + len(results)], steps=2)     # sent before the end token was known
    assert call(engine, links, after) == []

    # the rings are still in step: another sequence's prompt and chained steps, after plain steps of its own
    engine.finish(seq, "stop")
    for stage in engine.stages:
        stage.release(seq.seq_id)
    prompt = [9, 4, 2, 8]
    want = greedy_tokens(model, prompt, 7)
    other = engine.add_request("t", prompt, SamplingParams(max_tokens=7, temperature=0))
    for _ in range(2):
        batch, plan = engine.next_batch(0)
        engine.consume(call(engine, links, batch), plan)
    batch, plan = engine.next_batch(0)
    results = call(engine, links, batch)
    ahead, ahead_plan = engine.plan_ahead(plan, steps=8)
    engine.consume(results, plan)
    assert ahead.steps == 4
    engine.consume(call(engine, links, ahead), ahead_plan)
    assert other.output_ids == want and other.finish_reason == "length"


@pytest.mark.parametrize("n_stages", [1, 2])
def test_a_chain_of_several_sequences_stops_where_one_ends(linked, n_stages):
    """Three sequences in one follow call: each row gets its tokens alone; the call stops after the step where one
    samples an end token, the others' later steps not computed, and the call sent before that was known runs no
    step (it asks for positions the others never reach)."""
    model = "tiny-gptoss"
    prompts = [[5, 6, 7], [9, 4, 2, 8], [3, 1]]
    wants = [greedy_tokens(model, p, 10) for p in prompts]
    end = next(i for i in range(3, 9) if wants[1][i] not in wants[1][:i])     # the middle one ends here
    if n_stages == 1:
        engine = LocalEngine(open_model(model))

        def run(batch):
            return engine.stages[0].forward(batch)
    else:
        engine, links = linked(model, n_stages)

        def run(batch):
            return call(engine, links, batch)
    seqs = [engine.add_request(i, p, SamplingParams(max_tokens=10, temperature=0,
                                                    stop_token_ids=[wants[1][end]] if i == 1 else []))
            for i, p in enumerate(prompts)]
    batch, plan = engine.next_batch(0)          # the three prompts in one step
    first = run(batch)
    assert engine.plan_ahead(plan, steps=20, max_rows=2) is None      # more rows than computed alone
    ahead, ahead_plan = engine.plan_ahead(plan, steps=20, max_rows=8)
    assert ahead.seq_ids == [s.seq_id for s in seqs] and ahead.steps == 9
    assert ahead.end_ids[1] >= {wants[1][end]}
    results = run(ahead)
    assert len(results) == 3 * end           # steps 1..end, three rows each
    engine.consume(first, plan)
    finished = engine.consume(results, ahead_plan, follow=True)
    assert finished == [seqs[1]]
    assert [s.output_ids for s in seqs] == [w[:end + 1] for w in wants]
    after = replace(ahead, start_pos=[p + 9 for p in ahead.start_pos], steps=3)   # sent before the end was known
    assert run(after) == []
    for stage in engine.stages:         # the two others go on in plain steps (and the rings are still in step)
        stage.release(seqs[1].seq_id)
    while engine.has_work():
        batch, plan = engine.next_batch(0)
        engine.consume(run(batch), plan)
    assert [seqs[0].output_ids, seqs[2].output_ids] == [wants[0], wants[2]]


def test_a_stage_that_fails_in_a_chain_leaves_no_stage_waiting(linked):
    engine, links = linked("tiny-qwen35moe", 3)
    engine.add_request("s", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0))
    batch, plan = engine.next_batch(0)
    call(engine, links, batch)
    ahead, _ = engine.plan_ahead(plan, steps=6)
    last, step, calls = engine.stages[-1], engine.stages[-1]._step, []

    def fails_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected")
        return step(*args)
    last._step = fails_third
    with ThreadPoolExecutor(3) as pool:
        done = [pool.submit(link.forward, ahead, stage.forward) for stage, link in zip(engine.stages, links)]
        errors = [f.exception(timeout=60) for f in done]      # each ends (none waits for ever)
    assert isinstance(errors[2], MemoryError)
    assert isinstance(errors[0], RingError)        # the first stage waited for the third token: told it failed
    assert isinstance(errors[1], RingError)        # the middle one waited for the first's fourth step


def test_tokens_of_released_sequences_are_not_kept():
    path = f"{SHM_DIR}/raymoe-test-{uuid.uuid4().hex[:8]}"
    try:
        first, last = ChainLink(), ChainLink()
        first.back = Ring.create(path, 4, 24 * MAX_TOKENS)
        last.back = Ring.attach(path, 4, 24 * MAX_TOKENS)
        first.holds = {1, 3}.__contains__       # sequence 2 was released before its last token came back
        last.pass_back([(1, 9, 42), (2, 5, 7), (3, 4, None)])
        first.drain()
        assert first.tokens == {1: (9, 42), 3: (4, None)}
        assert first.next_tokens([1], [9], [frozenset()]) == [42]
        assert first.next_tokens([1, 3], [9, 4], [frozenset()] * 2) is None      # 3's sampling failed
    finally:
        unlink(path)
