"""Admission by memory (stages/runtime/memory.py CacheBudget): a sequence runs only while every stage has room for
the cache its own bound (prompt + max_tokens, at most the context) can come to, the stages' real caches
never exceed that charge, one that could never fit is refused naming the limit, and plan_memory reserves
full contexts but lets more, shorter sequences run in them."""
import pytest

from raymoe.cluster.engine_args import EngineArgs

from raymoe.stages.runtime.engine import EngineCore, LocalEngine, split_layers
from raymoe.stages.errors import RequestError
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.memory import CacheBudget, stage_need
from raymoe.stages.text.sampling_params import SamplingParams

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def model():
    return open_model("tiny-qwen35moe", 512)     # a 512-token context: full contexts are few, short ones many


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("name", ["tiny-qwen35moe", "tiny-gptoss"])
def test_real_caches_stay_within_the_charge(name, monkeypatch):
    """Two stages, prompts and max_tokens of every kind (a chunked prefill, decode across a doubling,
    up to the full context; gpt-oss's sliding layers too): at every release, each sequence's cache on
    each stage is at most what it was admitted with."""
    model = open_model(name, 512)
    engine = LocalEngine(model, n_stages=2)
    ranges = split_layers(model.n_layers, 2)
    engine.cache_budget = CacheBudget(model, ranges, [4 * stage_need(model, r, "auto").cache_bytes_per_sequence
                                                      for r in ranges])
    seen = []
    for i, stage in enumerate(engine.stages):
        release = stage.release

        def checked(seq_id, stage=stage, i=i, release=release):
            held = sum(c.nbytes() for c in stage.caches[seq_id].values())
            need = engine.sequences.get(seq_id) or finished[seq_id]
            seen.append((held, need[i]))
            release(seq_id)
        monkeypatch.setattr(stage, "release", checked)
    finished = {}
    original_finish = engine.finish

    def finish(seq, reason=None):
        finished[seq.seq_id] = seq.cache_need
        original_finish(seq, reason)
    monkeypatch.setattr(engine, "finish", finish)
    for prompt, max_tokens in [(3, 1), (5, 12), (17, 15), (40, 200), (300, 20), (100, 411), (2, 509)]:
        engine.add_request(f"{prompt}+{max_tokens}", [7 + j % 50 for j in range(prompt)], greedy(max_tokens))
    engine.run_until_done()
    assert len(seen) == 2 * 7
    assert all(0 < held <= need for held, need in seen), seen
    assert engine.cache_budget.used == [0, 0]


def test_admission_waits_for_memory_first_come_first_served(model):
    """With room for two full contexts, six short sequences run at once; a full-context one waits until
    finished ones leave room for it, and one behind it waits too (first come, first served)."""
    full = sum(model.family.layer_cache_bytes(model.config, i) for i in range(model.n_layers))
    core = EngineCore(model.config, model.tokenizer, n_groups=1, max_running=64)
    budget = core.cache_budget = CacheBudget(model, [range(model.n_layers)], [2 * full])
    short = [core.add_request(f"s{i}", [5, 6, 7], greedy(20)) for i in range(6)]
    long_ = core.add_request("long", [5, 6, 7], greedy(509))
    late = core.add_request("late", [5, 6, 7], greedy(20))
    assert budget.need(long_.max_length) == (full,) and 6 * budget.need(23)[0] + full > 2 * full
    core.next_batch(0)
    assert all(s.group == 0 for s in short) and core.running() == 6
    assert long_.group is None and late.group is None and budget.fits(budget.need(late.max_length))
    for s in short:                     # they finish one by one: the long one runs as soon as it fits
        if long_.group is None:
            fits = budget.fits(budget.need(long_.max_length))
            core.next_batch(0)
            assert (long_.group == 0) == fits and late.group is None
        assert budget.used[0] <= 2 * full
        core.finish(s, "abort")
    assert long_.group == 0
    core.finish(long_, "abort")
    core.next_batch(0)
    assert late.group == 0
    core.finish(late, "abort")
    assert budget.used == [0]


def test_a_request_that_can_never_fit_is_refused_naming_the_limit(model):
    full = sum(model.family.layer_cache_bytes(model.config, i) for i in range(model.n_layers))
    core = EngineCore(model.config, model.tokenizer)
    core.cache_budget = CacheBudget(model, [range(model.n_layers)], [full // 2])
    core.add_request("short", [5, 6, 7], greedy(20))
    with pytest.raises(RequestError, match=r"^max_tokens is more than memory allows: prompt \+ max_tokens \(512 "
                                           r"tokens\) needs .* MiB of cache on stage 0, which has .* MiB for caches"):
        core.add_request("long", [5, 6, 7], greedy(509))


def test_plan_memory_reserves_full_contexts_and_runs_more_short_ones(model, monkeypatch):
    import ray

    from raymoe.cluster.engine import DEFAULT_MAX_RUNNING, plan_memory
    from raymoe.cluster.pipeline import PipelineSpec
    from raymoe.stages.runtime.memory import RUNTIME_BYTES

    need = stage_need(model, range(model.n_layers), "auto")
    node = need.weight_bytes + RUNTIME_BYTES + 5 * need.cache_bytes_per_sequence + 1000     # 5 full contexts fit
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"memory": node}}])
    # without a prefix cache, which takes a share of what is left (test_prefix_cache.py)
    spec = PipelineSpec(EngineArgs(model.path, prefix_cache_gb=0), model.n_layers, model.config.n_expert)
    plan_memory(model, spec)
    assert spec.args.max_running == DEFAULT_MAX_RUNNING
    assert spec.cache_budget == [5 * need.cache_bytes_per_sequence] and spec.stage_memory == [need.total(5)]
    spec = PipelineSpec(EngineArgs(model.path, max_running=3, prefix_cache_gb=0), model.n_layers,
                        model.config.n_expert)
    plan_memory(model, spec)
    assert spec.args.max_running == 3                                 # asked for: exactly that
    assert spec.cache_budget == [3 * need.cache_bytes_per_sequence]


def test_the_coordinator_admits_by_memory_and_every_request_completes():
    """Through the coordinator (in this process, one stage): with room for two full contexts, short
    requests run many at once, a full-context one waits for room, every request completes, and
    load() reports the memory in use, never above the budget."""
    import asyncio

    from raymoe.cluster.coordinator import Coordinator
    from raymoe.cluster.pipeline import PipelineSpec
    from local_pipeline import LocalPipeline

    model = open_model("tiny-qwen35moe", 512)
    full = stage_need(model, range(model.n_layers), "auto").cache_bytes_per_sequence
    args = EngineArgs(model.path, max_model_len=512, microbatches=1, max_running=64).resolved()
    spec = PipelineSpec(args, model.n_layers, model.config.n_expert, cache_budget=[2 * full])
    coord = Coordinator.__ray_metadata__.modified_class(spec)
    coord.pipeline = LocalPipeline(model)
    requests = {f"s{i}": {"prompt_token_ids": [5, 6, 7], "max_tokens": 8, "ignore_eos": True} for i in range(8)}
    requests["long"] = {"prompt_token_ids": [5, 6, 7], "max_tokens": 300, "ignore_eos": True}
    requests.update({f"t{i}": {"prompt_token_ids": [5, 6, 7], "max_tokens": 8, "ignore_eos": True} for i in range(4)})

    async def go():
        ids = {await coord.submit(rid, req): rid for rid, req in requests.items()}
        out, most_running, most_used = {}, 0, 0.0
        while len(out) < len(ids):
            load = coord.load()
            most_running, most_used = max(most_running, load["running"]), max(most_used, load["cache_used"])
            for sid, result in await coord.wait_finished(timeout=0.01):
                out[ids[sid]] = result
        return out, most_running, most_used, coord.load()

    out, most_running, most_used, idle = asyncio.run(go())
    assert {rid: len(r["token_ids"]) for rid, r in out.items()} == {rid: q["max_tokens"] for rid, q in requests.items()}
    assert most_running > 2 and 0 < most_used <= 1
    assert idle["cache_used"] == 0 and idle["running"] == 0
