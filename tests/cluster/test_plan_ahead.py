"""Steps sent ahead (cluster/coordinator.py _launch_ahead): with the running sequences decoding on a one-stage
pipeline (or stages linked by shm rings), their next step goes to the stages before the tokens it continues from
are back, and with --steps-per-call N one call runs N decode steps. The outputs are the in-process engine's, bit for
bit, whether a sequence ends by its length, a stop token or a stop string (steps computed for nothing)."""
import math
from dataclasses import replace

import pytest

from raymoe.cluster.engine import ClusterEngine, EngineArgs
from raymoe.stages.runtime.engine import EngineCore, LocalEngine
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.requests import prompt_ids, sampling_params
from raymoe.stages.text.sampling_params import SamplingParams

KEYS = ("token_ids", "text", "finish_reason", "logprobs", "prompt_logprobs")


def local_results(model: str, requests: list[dict]) -> list[dict]:
    """Each request alone through the engine in this process, as the coordinator reads it."""
    files = open_model(model)
    defaults = SamplingParams.from_dict(files.sampling_defaults)
    engine, out = LocalEngine(files), []
    for i, request in enumerate(requests):
        params = sampling_params(request, defaults, files.config.context_length, files.config.vocab)
        seq = engine.add_request(i, prompt_ids(request, files.tokenizer), params)
        engine.run_until_done()
        out.append(seq.result())
    return out


@pytest.mark.cluster
@pytest.mark.parametrize("model,steps_per_call,pp", [("tiny-qwen35moe", 1, 1), ("tiny-gptoss", 1, 1),
                                                      ("tiny-qwen35moe", 3, 1), ("tiny-gptoss", 4, 1),
                                                      ("tiny-qwen35moe", 1, 2), ("tiny-gptoss", 4, 3)])
def test_steps_sent_ahead_give_the_same_outputs(model, steps_per_call, pp):
    """At PP > 1 the default transport links the stages of the one node with shm rings, and the steps chain through
    them (cluster/chain.py)."""
    greedy = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    text = local_results(model, [greedy])[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]      # ends the greedy output early: its step ahead is not used
    requests = [
        greedy,
        {**greedy, "stop": [stop]},
        {"prompt": "The little dog", "max_tokens": 9, "temperature": 0.9, "top_p": 0.9, "seed": 7, "logprobs": 2,
         "prompt_logprobs": 1},
        {"prompt": "Hello", "max_tokens": 1, "temperature": 0},                 # one token: nothing to send ahead
        {"prompt": "She said", "max_tokens": 6, "temperature": 0, "repetition_penalty": 1.3},   # needs its history
    ]
    expected = local_results(model, requests)
    assert expected[1]["finish_reason"] == "stop" and len(expected[1]["token_ids"]) < 12

    engine = ClusterEngine(EngineArgs(model, pp=pp, steps_per_call=steps_per_call))
    try:
        results = []
        for i, request in enumerate(requests):      # one at a time: the only sequence running
            seq_id = engine.submit(i, request)
            finished = []
            while not finished:
                finished = engine.wait_finished(timeout=5)
            assert [s for s, _ in finished] == [seq_id]
            results.append(finished[0][1])
        stats = engine.stats()
    finally:
        engine.shutdown()
    for got, want in zip(results, expected):
        assert {k: got[k] for k in KEYS} == {k: want[k] for k in KEYS}
    assert stats["transport"] == ("shm" if pp > 1 else "object_store")
    # the first three (and the one-token one): one call for the prompt, then calls of up to steps_per_call tokens;
    # the penalised one a call a token
    n = [len(r["token_ids"]) for r in expected]
    assert stats["steps"] == sum(1 + math.ceil((k - 1) / steps_per_call) for k in n[:4]) + n[4]
    # the stop string's call after the one that ended it was not used
    if steps_per_call == 1:     # and every token after the first of the first three came from a step sent ahead
        assert stats["ahead_steps"] - stats["ahead_dropped"] == sum(k - 1 for k in n[:3])
        assert stats["ahead_dropped"] == 1
    assert stats["ahead_dropped"] >= 1


@pytest.mark.cluster
@pytest.mark.parametrize("model,pp", [("tiny-qwen35moe", 1), ("tiny-gptoss", 2)])
def test_several_sequences_sent_ahead_give_the_same_outputs(model, pp):
    """Several sequences at once: their decode steps go ahead together as one call of several rows (4 steps a
    call, the default), stopped early where one ends by a stop token, with rows of sequences that a stop string
    ended or a cancel took computed for nothing; each sequence's outputs are its own alone, bit for bit."""
    greedy = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    alone = local_results(model, [greedy])[0]
    stop = alone["text"][len(alone["text"]) // 2:len(alone["text"]) // 2 + 2]
    tokens = alone["token_ids"]
    stop_token = next(tokens[i] for i in range(5, len(tokens)) if tokens[i] not in tokens[:i])
    requests = [
        greedy,
        {**greedy, "stop_token_ids": [stop_token]},       # its stop token comes mid-call
        {**greedy, "stop": [stop]},
        {"prompt": "The little dog", "max_tokens": 17, "temperature": 0.9, "top_p": 0.9, "seed": 7, "logprobs": 2},
    ]
    expected = local_results(model, requests)
    assert expected[1]["finish_reason"] == "stop" and expected[2]["finish_reason"] == "stop"

    engine = ClusterEngine(EngineArgs(model, pp=pp))
    try:
        seq_ids = [engine.submit(i, r) for i, r in enumerate(requests)]
        cancelled = engine.submit("c", {"prompt": "Cancel me", "max_tokens": 3000, "ignore_eos": True})
        results = {}
        while len(results) < len(requests) + 1:
            results.update(engine.wait_finished(timeout=5))
            if results and cancelled not in results:     # while the others decode with it
                engine.cancel(cancelled)
        stats = engine.stats()
    finally:
        engine.shutdown()
    for seq_id, want in zip(seq_ids, expected):
        assert {k: results[seq_id][k] for k in KEYS} == {k: want[k] for k in KEYS}
    assert results[cancelled]["finish_reason"] == "abort" and len(results[cancelled]["token_ids"]) < 3000
    # more of the sequences' steps came from calls sent ahead than any one sequence has tokens: the calls were
    # of several sequences
    assert stats["ahead_steps"] - stats["ahead_dropped"] > max(len(r["token_ids"]) for r in expected), stats


def test_what_is_planned_ahead():
    files = open_model("tiny-qwen35moe")
    core = EngineCore(files.config, files.tokenizer, max_running=2)
    a = core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    batch, plan = core.next_batch(0)
    ahead, ahead_plan = core.plan_ahead(plan)
    assert ahead.follow and ahead.token_ids is None
    assert (ahead.seq_ids, ahead.start_pos, ahead.lengths) == ([a.seq_id], [3], [1])
    assert ahead.sampling[0].position == 1 and ahead_plan[0].start == 3
    b = core.add_request("b", [8, 9], SamplingParams(max_tokens=4))
    assert core.plan_ahead(plan) is None             # another waits, and there is room: the next batch takes it in
    core.consume([(11, None, [])], plan)
    _, plan = core.next_batch(0)
    assert sorted((c.seq.seq_id, c.start, c.length) for c in plan) == [(a.seq_id, 3, 1), (b.seq_id, 0, 2)]
    assert core.plan_ahead(plan) is None                    # two rows, but one computed alone
    core.add_request("c", [4], SamplingParams(max_tokens=4))     # waits, with no room for it
    ahead, ahead_plan = core.plan_ahead(plan, steps=5, max_rows=2)
    rows = list(dict.fromkeys(c.seq for c in plan))
    start = {a: 4, b: 2}
    # a has 2 tokens to come after the one in flight, b 3: the call ends where a's max_tokens does
    assert (ahead.seq_ids, ahead.start_pos, ahead.steps) == ([s.seq_id for s in rows], [start[s] for s in rows], 2)
    assert [(c.seq, c.start) for c in ahead_plan] == [(s, start[s] + i) for i in range(2) for s in rows]
    assert [c.position for c in ahead.sampling] == [{a: 2, b: 1}[s] for s in rows]
    assert [c.tip for c in ahead.sampling] == [0, 1] and ahead.logit_rows == [0, 1]
    for seq in list(core.sequences.values()):
        core.finish(seq, "abort")
    penalised = core.add_request("d", [5, 6], SamplingParams(max_tokens=4, presence_penalty=0.5))
    _, plan = core.next_batch(0)
    assert [c.seq for c in plan] == [penalised] and core.plan_ahead(plan) is None


def test_several_steps_a_call_stop_at_an_end_token():
    """A follow batch of several steps gives the tokens the engine gives one step at a time, and stops after a token
    of its end_ids; a call sent after that token runs no step."""
    files = open_model("tiny-qwen35moe")
    reference = LocalEngine(files)
    want = reference.add_request("r", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0))
    reference.run_until_done()
    tokens = want.output_ids
    end = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])    # its first appearance

    engine = LocalEngine(files)
    stage = engine.stages[0]
    seq = engine.add_request("s", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0))
    batch, plan = engine.next_batch(0)
    first = stage.forward(batch)
    ahead, ahead_plan = engine.plan_ahead(plan, steps=20)
    assert ahead.steps == 9 and [c.start for c in ahead_plan] == list(range(3, 12))     # max_tokens caps it
    assert ahead.sampling[0].position == 1
    ahead.end_ids = [frozenset([tokens[end]])]
    results = stage.forward(ahead)
    assert [first[0][0]] + [r[0] for r in results] == tokens[:end + 1]
    engine.consume(first, plan)
    engine.consume(results, ahead_plan[:len(results)])
    assert seq.output_ids == tokens[:end + 1]
    after = replace(ahead, start_pos=[3 + len(results)], steps=2)     # sent before the end token was known
    assert stage.forward(after) == []
