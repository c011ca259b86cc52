"""The code a CUDA graph records for a decode step (stages/runtime/decode_graph.py), on the CPU, with the capture
stood in for by a "graph" whose replay runs that code again on the tensors it was captured with (as a
real replay does): the same bits as the ordinary decode step, through KV storage growing, sliding windows
moving their keys, sequences joining and leaving. The real capture and replay need a GPU (tests/gpu/run.py)."""
import json

import pytest
import torch

from raymoe.stages.runtime import decode_graph
from raymoe.stages.layers.cache import EMPTY_POSITION, KVCache
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.sampling_params import SamplingParams

# prompt lengths: storage grows at 16, 32 and 64 positions; tiny-gptoss's window is smaller than the longest
PROMPTS = [3, 14, 30, 9, 61]


class ReplayByRunning:
    """A stand-in for torch.cuda.CUDAGraph: replay() runs the step's code on the captured tensors."""

    def __init__(self, graphs, step, states):
        self.graphs, self.step, self.states = graphs, step, states

    def replay(self):
        self.step.out = self.step.body(self.graphs.layers, self.states)


def fake_capture(self, key, step, states):
    step.graph = ReplayByRunning(self, step, states)
    self.steps[key] = step
    self.captured += 1
    return step


def with_graphs(engine) -> list:
    """Every stage of the engine runs its decode steps through DecodeGraphs, captured by fake_capture."""
    runners = []
    for stage in engine.stages:
        stage.graphs = decode_graph.DecodeGraphs(stage.layers)
        stage.graphs.usable = lambda n: True        # the CPU's MoE reads routing on the host: no matter here
        stage.graphs._capture = fake_capture.__get__(stage.graphs)
        runners.append(stage.graphs)
    return runners


def run(engine) -> str:
    """PROMPTS, greedy and sampled with logprobs, their results as JSON text (equal text: equal bits)."""
    engine.eos_ids = set()
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i, n in enumerate(PROMPTS):
        ids = torch.randint(0, min(2000, engine.config.vocab), (n,), generator=g).tolist()
        params = SamplingParams(max_tokens=12 + 9 * i, temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=2)
        seqs.append(engine.add_request(f"r{i}", ids, params))
    engine.run_until_done()
    return json.dumps([s.result() for s in seqs])


def generate(model: str, mode: str, graph_path: bool, n_stages: int = 1) -> tuple[str, list]:
    engine = LocalEngine(open_model(model), n_stages=n_stages, mode=mode)
    runners = with_graphs(engine) if graph_path else []
    return run(engine), runners


@pytest.mark.parametrize("mode", ["float32", "auto"])
@pytest.mark.parametrize("model", ["tiny-qwen35moe", "tiny-gptoss"])
def test_graph_step_gives_the_decode_steps_bits(model, mode, monkeypatch):
    calls = []
    real = decode_graph.DecodeGraphs.__call__
    monkeypatch.setattr(decode_graph.DecodeGraphs, "__call__", lambda self, x, ctx: calls.append(1) or real(self, x, ctx))
    reference, _ = generate(model, mode, graph_path=False)
    assert not calls
    graphed, (runner,) = generate(model, mode, graph_path=True)
    # the decode steps went through the graph path, most of them replayed
    assert len(calls) > 40 and runner.replayed > 25 and runner.captured >= 5
    assert graphed == reference


def test_graph_step_at_pp2_gives_pp1s_bits():
    reference, _ = generate("tiny-gptoss", "float32", graph_path=False)
    graphed, runners = generate("tiny-gptoss", "float32", graph_path=True, n_stages=2)
    assert len(runners) == 2 and graphed == reference


def test_empty_rows_hold_a_position_no_query_reaches():
    cache = KVCache(window=4)
    for step in range(40):           # grows, then trims every few steps
        keys, values, pos = cache.extend(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), torch.tensor([step]))
        assert pos[-1] == step
        assert (cache.pos[cache.length:] == EMPTY_POSITION).all()
        cache.trim()
        assert (cache.pos[cache.length:] == EMPTY_POSITION).all()
    snap = cache.snapshot()
    restored = KVCache(window=4)
    restored.restore(snap)
    assert (restored.pos[restored.length:] == EMPTY_POSITION).all() and restored.length < restored.pos.shape[0]


def test_a_batch_is_captured_on_its_second_step_and_replayed_after():
    engine = LocalEngine(open_model("tiny-qwen35moe"), mode="float32")
    (graphs,) = with_graphs(engine)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0))
    engine.run_until_done()
    # 5 decode steps of one sequence in one KV storage (16 rows on the CPU), so of one key: the first eager
    # (its size's first), then captured and replayed 4 times
    assert (graphs.captured, graphs.replayed, len(graphs.steps)) == (1, 4, 1)


def test_failed_captures_leave_the_steps_eager(monkeypatch, caplog):
    """A capture that fails (here every one) costs nothing but the try: the step runs eagerly, the same bits;
    after FAILURES tries the stage stops trying."""
    def fail():
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", fail)
    reference, _ = generate("tiny-gptoss", "float32", graph_path=False)
    engine = LocalEngine(open_model("tiny-gptoss"), mode="float32")
    stage = engine.stages[0]
    stage.graphs = graphs = decode_graph.DecodeGraphs(stage.layers)
    assert run(engine) == reference
    assert graphs.failures == decode_graph.FAILURES and graphs.replayed == 0 and not graphs.usable(1)
    assert "capturing a decode step as a CUDA graph failed" in caplog.text
