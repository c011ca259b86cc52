"""Steps sent ahead (cluster/coordinator.py _launch_ahead): with one sequence running on a one-stage pipeline, its
next step goes to the stage before the token it continues from is back. The outputs are the in-process engine's,
bit for bit, whether the sequence ends by its length or by a stop string (a step sent for nothing)."""
import pytest

from cluster.engine import ClusterEngine, EngineArgs
from stages.engine import EngineCore, LocalEngine
from stages.loader import open_model
from stages.requests import prompt_ids, sampling_params
from stages.sampling import SamplingParams

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
@pytest.mark.parametrize("model", ["tiny-qwen35moe", "tiny-gptoss"])
def test_steps_sent_ahead_give_the_same_outputs(model):
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

    engine = ClusterEngine(EngineArgs(model, pp=1))
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
    # every token after the first of the first three came from a step sent ahead; the stop string's one more
    assert stats["ahead_steps"] - stats["ahead_dropped"] == sum(len(r["token_ids"]) - 1 for r in expected[:3])
    assert stats["ahead_dropped"] == 1


def test_only_a_lone_sequence_is_planned_ahead():
    files = open_model("tiny-qwen35moe")
    core = EngineCore(files.config, files.tokenizer)
    seq = core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    batch, plan = core.next_batch(0)
    ahead, ahead_plan = core.plan_ahead(plan)
    assert ahead.follow and ahead.token_ids is None
    assert (ahead.seq_ids, ahead.start_pos, ahead.lengths) == ([seq.seq_id], [3], [1])
    assert ahead.sampling[0].position == 1 and ahead_plan[0].start == 3
    core.add_request("b", [8, 9], SamplingParams(max_tokens=4))
    assert core.plan_ahead(plan) is None             # another waits: the next batch may take it in
    core.finish(seq, "abort")
    penalised = core.add_request("c", [5, 6], SamplingParams(max_tokens=4, presence_penalty=0.5))
    core.finish(core.sequences[1], "abort")
    _, plan = core.next_batch(0)
    assert [c.seq for c in plan] == [penalised] and core.plan_ahead(plan) is None
