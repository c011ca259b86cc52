"""The prefix cache (docs/prefix-cache.md): a turn that extends the last one's history starts after the cached
prefix, prefills fewer tokens, and gives the same bits (tokens, logprobs) as a run without the cache, for both
embedded models, both modes, in process and on the cluster at PP=1 and PP=2; eviction under a small budget
never takes a block a sequence is about to restore, and outputs stay exact; a stage restart empties the cache
without changing outputs; /health and /metrics show it."""
import asyncio
import json
import re

import pytest
import torch

from raymoe.stages.runtime.engine import LocalEngine, split_layers
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.memory import prefix_block_bytes, prefix_shares
from raymoe.stages.prefix.index import PrefixIndex
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.stages.runtime.scheduler import Scheduler

MODELS = ["tiny-qwen35moe", "tiny-gptoss"]
MODES = ["float32", "auto"]
CHUNK = 32          # the prefill chunk, and so the cache's block


def conversation(seed: int, turns: int = 3, first: int = 70, added: int = 25):
    """The requests of a chat, one turn at a time: each prompt is the last prompt, its answer and `added`
    new tokens (the answer is only known once the last turn ran: a generator fed the last result)."""
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(0, 2000, (first,), generator=g).tolist()
    for t in range(turns):
        params = dict(max_tokens=8, temperature=0.8 if t % 2 else 0.0, seed=seed * 10 + t, logprobs=2, ignore_eos=True)
        result = yield history, params
        history = history + result["token_ids"] + torch.randint(0, 2000, (added,), generator=g).tolist()


def local_engine(model, mode="float32", stages=1, cache=1 << 30):
    return LocalEngine(model, n_stages=stages, mode=mode, scheduler=Scheduler(2 * CHUNK, CHUNK),
                       prefix_cache_bytes=cache)


def chat_locally(engine, seeds=(0,), **kw) -> list[dict]:
    """The chats of `seeds`, their turns interleaved, one request at a time; every result in order."""
    chats = [conversation(s, **kw) for s in seeds]
    pending = [next(c) for c in chats]
    out = []
    while any(p is not None for p in pending):
        for i, c in enumerate(chats):
            if pending[i] is None:
                continue
            prompt, params = pending[i]
            seq = engine.add_request(f"c{i}.{len(out)}", prompt, SamplingParams(**params))
            engine.run_until_done()
            out.append(seq.result())
            try:
                pending[i] = c.send(out[-1])
            except StopIteration:
                pending[i] = None
    return out


def uncounted(x):
    """Results without usage.cached_tokens (how many prompt tokens the cache gave, which a run without it lacks)."""
    if isinstance(x, list):
        return [uncounted(v) for v in x]
    if isinstance(x, dict):
        return {k: {u: n for u, n in v.items() if u != "cached_tokens"} if k == "usage" else uncounted(v)
                for k, v in x.items()}
    return x


def same_bits(a, b) -> bool:
    return json.dumps(uncounted(a)) == json.dumps(uncounted(b))


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return open_model(request.param)


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_next_turn_hits_and_equals_a_run_without_the_cache(model, mode, stages):
    without = local_engine(model, mode, stages, cache=0)
    expected = chat_locally(without)
    engine = local_engine(model, mode, stages)
    got = chat_locally(engine)
    assert same_bits(got, expected)
    load = engine.prefix.load()
    # 70 tokens: blocks 0-1 stored; turn 2 (103 tokens) starts at 64, turn 3 (136) at 96
    assert load["hits"] == 2 and load["hit_tokens"] == 64 + 96
    assert [r["usage"]["cached_tokens"] for r in got] == [0, 64, 96]          # each turn's usage says so
    assert engine.prefill_tokens == without.prefill_tokens - 160
    # the index's bytes bound what the stages hold (a sliding window's snapshot holds at most its bound)
    held = sum(s.prefix.bytes for s in engine.stages)
    assert 0 < held <= load["bytes"] <= load["budget_bytes"]
    if model.config.arch == "qwen35moe":
        assert held == load["bytes"]


def test_prompt_logprobs_run_the_whole_prompt(model):
    """A request for prompt logprobs needs every prompt position's logits: it never starts after a prefix
    (and still stores its blocks for others)."""
    engine = local_engine(model)
    prompt = list(range(100, 170))
    first = engine.add_request("a", prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    engine.run_until_done()
    again = engine.add_request("b", prompt + [5, 6], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    engine.run_until_done()
    assert engine.prefix.load()["hits"] == 0 and len(engine.prefix.index.entries) == 2
    # rows 0-63 ran in the same two chunks (the last chunks, 6 and 8 rows, round differently)
    assert again.result()["prompt_logprobs"][:65] == first.result()["prompt_logprobs"][:65]
    later = engine.add_request("c", prompt + [5, 6], SamplingParams(max_tokens=2, temperature=0))
    engine.run_until_done()
    assert engine.prefix.load()["hits"] == 1 and later.result()["token_ids"] == again.result()["token_ids"]


def preamble_prompts(n: int = 6) -> list[list[int]]:
    """A batch job's prompts: an 80-token preamble (blocks 0-1 and half of block 2), then each its own text."""
    g = torch.Generator().manual_seed(5)
    preamble = torch.randint(0, 2000, (80,), generator=g).tolist()
    return [preamble + torch.randint(0, 2000, (20 + 7 * i,), generator=g).tolist() for i in range(n)]


def run_batch(engine, prompts) -> list[dict]:
    seqs = [engine.add_request(f"p{i}", p, SamplingParams(max_tokens=6, temperature=0.0 if i % 2 else 0.7, seed=i,
                                                            logprobs=1, ignore_eos=True))
            for i, p in enumerate(prompts)]
    engine.run_until_done()
    return [s.result() for s in seqs]


@pytest.mark.parametrize("running", [1, 3])
def test_prompts_sharing_a_preamble_hit_once_it_is_cached(model, running):
    """The first prompt stores the preamble's blocks (a snapshot at its own last block, 96); the second finds
    them without a snapshot where it parts from it, recomputes and leaves one there (64); the others start
    there. One at a time, every output equals a run without the cache bit for bit; three at a time (those
    admitted together with the first miss), the batches differ, and tokens agree with logprobs to float32
    noise, as for any change of batching."""
    prompts = preamble_prompts()
    without = local_engine(model, cache=0)
    without.max_running = running
    expected = run_batch(without, prompts)
    engine = local_engine(model)
    engine.max_running = running
    got = run_batch(engine, prompts)
    load = engine.prefix.load()
    hits = len(prompts) - (2 if running == 1 else running)
    assert load["hits"] == hits and load["hit_tokens"] == 64 * hits
    if running == 1:
        assert same_bits(got, expected)
    for a, b in zip(got, expected):
        assert a["token_ids"] == b["token_ids"]
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-3 for x, y in zip(a["logprobs"], b["logprobs"]))


def check_stores_match_the_index(engine):
    """What every stage holds is exactly what the coordinator's index says, within each stage's share."""
    index = engine.prefix.index
    ranges = [s.layers_range for s in engine.stages]
    shares = prefix_shares(engine.model, ranges, index.block, index.budget)
    for stage, share in zip(engine.stages, shares):
        assert set(stage.prefix.blocks) == set(index.entries)
        assert set(stage.prefix.snapshots) == {h for h, e in index.entries.items() if e.snapshot}
        assert stage.prefix.bytes <= share
    assert index.used <= index.budget


def test_eviction_under_a_small_budget_keeps_outputs_exact(model):
    """Three chats interleaved in a cache that holds about half of their blocks: blocks are evicted (least
    recently used leaves first), later turns still hit what is left, the stages always hold what the index says, and
    every output equals a run without the cache."""
    kv, snap = prefix_block_bytes(model, range(model.n_layers), CHUNK)
    expected = chat_locally(local_engine(model, stages=2, cache=0), seeds=(1, 2, 3), turns=4)
    engine = local_engine(model, stages=2, cache=8 * kv + 5 * snap)
    step = engine.step

    def checked():
        finished = step()
        check_stores_match_the_index(engine)
        return finished
    engine.step = checked
    got = chat_locally(engine, seeds=(1, 2, 3), turns=4)
    assert same_bits(got, expected)
    load = engine.prefix.load()
    assert load["evicted_blocks"] > 10 and load["hits"] > 3


def test_a_sequence_waiting_to_restore_keeps_its_blocks(model, monkeypatch):
    """A sequence admitted after a hit but not yet scheduled (another prompt took the step's tokens) pins its
    blocks: the other prompt's stores, with no room, evict nothing of them; once scheduled it restores them.
    Without the pins (the control) the stores evict them and the stage refuses the restore."""
    def run(pins: bool):
        if not pins:
            monkeypatch.setattr(PrefixIndex, "pin", lambda self, seq_id, chain: None)
        kv, snap = prefix_block_bytes(model, range(model.n_layers), CHUNK)
        engine = LocalEngine(model, mode="float32", scheduler=Scheduler(CHUNK, CHUNK),     # one chunk a step
                             prefix_cache_bytes=2 * kv + 2 * snap)
        shared = list(range(300, 370))
        engine.add_request("x", shared, SamplingParams(max_tokens=1, temperature=0))
        engine.run_until_done()                       # blocks 0-1 of `shared`, a snapshot at the end
        other = engine.add_request("other", list(range(500, 570)), SamplingParams(max_tokens=2, temperature=0))
        extended = engine.add_request("ext", shared + [9] * 20, SamplingParams(max_tokens=2, temperature=0))
        engine.run_until_done()
        assert extended.result()["token_ids"] and other.result()["token_ids"]
        return engine
    engine = run(pins=True)
    assert engine.prefix.load()["hits"] == 1 and engine.prefix.load()["hit_tokens"] == 64
    with pytest.raises(RuntimeError, match="restores blocks this stage lacks"):
        run(pins=False)


def test_index_evicts_only_unpinned_leaves():
    index = PrefixIndex(budget=3 * 10, block=4, kv_bytes=10, snapshot_bytes=0, salt="m")
    a = index.chain(list(range(12)))                   # a0 <- a1 <- a2
    b = index.chain([7] * 4)
    assert index.insert(a[0], None, True) == (True, True) and index.insert(a[1], a[0], True)
    index.pin(1, a[:2])
    index.take_dropped()
    assert index.insert(b[0], None, True)               # fits: 30 bytes
    index.take_dropped()
    assert index.insert(a[2], a[1], True) and index.take_dropped() == [b[0]]   # the only unpinned leaf
    index.unpin(1)
    assert index.insert(b[0], None, True) and index.take_dropped() == [a[2]]   # a leaf, never a0 or a1
    assert index.insert(a[1], a[0], True) is None       # held already
    c = index.chain([1] * 8)
    assert index.insert(c[1], c[0], True) is None          # its parent is not cached


def test_plan_memory_reserves_the_prefix_cache(monkeypatch):
    import ray

    from raymoe.cluster.engine import PREFIX_SHARE, plan_memory
    from raymoe.cluster.engine_args import EngineArgs
    from raymoe.cluster.pipeline import PipelineSpec
    from raymoe.stages.runtime.memory import GiB, stage_need

    model = open_model("tiny-gptoss", 512)
    ranges = split_layers(model.n_layers, 2)
    needs = [stage_need(model, r, "auto", 256) for r in ranges]
    node = sum(n.total(4) for n in needs) + 10 * 2**20
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"memory": node}}])
    spec = PipelineSpec(EngineArgs(model.path, pp=2, max_running=4), model.n_layers, model.config.n_expert)
    plan_memory(model, spec)
    budget = int(spec.args.prefix_cache_gb * GiB)
    assert budget == int(PREFIX_SHARE * 10 * 2**20)      # a share of what the plan left free
    shares = prefix_shares(model, ranges, 256, budget)
    assert spec.stage_memory == [n.total(4) + s for n, s in zip(needs, shares)] and 0 < min(shares)
    spec = PipelineSpec(EngineArgs(model.path, pp=2, max_running=4, prefix_cache_gb=0.5), model.n_layers,
                        model.config.n_expert)
    from raymoe.stages.errors import RaymoeError
    with pytest.raises(RaymoeError, match="does not fit"):     # asked for: it must fit
        plan_memory(model, spec)

    # without --max-running: a share of what the weights leave free, taken before the running sequences'
    # full contexts take the rest (else a model that fills the machine gets next to no cache)
    context = sum(n.cache_bytes_per_sequence for n in needs)
    for contexts, cached in ((10, True), (1.05, False)):       # with room for one context only, the cache gives way
        free = int(contexts * context)
        node = sum(n.total(0) for n in needs) + free
        monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"memory": node}}])
        spec = PipelineSpec(EngineArgs(model.path, pp=2), model.n_layers, model.config.n_expert)
        plan_memory(model, spec)
        budget = int(spec.args.prefix_cache_gb * GiB)
        assert budget == (int(PREFIX_SHARE * free) if cached else 0)
        held = sum(prefix_shares(model, ranges, 256, budget))
        running = spec.cache_budget[0] // needs[0].cache_bytes_per_sequence
        assert running == (free - held) // context >= 1


# ---- on the cluster ----------------------------------------------------------------------------------

def chat_on_cluster(engine_args) -> tuple[list[dict], dict, dict]:
    """One chat's turns through a ClusterEngine; (results, load(), stats())."""
    from raymoe.cluster.engine import ClusterEngine
    engine = ClusterEngine(engine_args)
    try:
        chat, out = conversation(0, turns=4), []
        request = next(chat)
        while request is not None:
            prompt, params = request
            [sid] = engine.submit_many([(f"t{len(out)}", {"prompt_token_ids": prompt, **params})])
            done = []
            while not done:
                done = engine.wait_finished(timeout=5)
            assert [s for s, _ in done] == [sid]
            out.append(done[0][1])
            try:
                request = chat.send(out[-1])
            except StopIteration:
                request = None
        load = asyncio.run(engine.load_async())
        return out, load, engine.stats()
    finally:
        engine.shutdown()


def reference(name: str, mode: str, turns: int = 4) -> list[dict]:
    """The same chat in process without the cache (the cluster's single sequence runs the same steps)."""
    files = open_model(name)
    engine = local_engine(files, mode, cache=0)
    results = chat_locally(engine, turns=turns)
    for r, i in zip(results, range(len(results))):
        r["id"] = f"t{i}"
    return results


@pytest.mark.cluster
@pytest.mark.parametrize("name, mode, pp", [(MODELS[0], MODES[0], 2), (MODELS[0], MODES[1], 1),
                                            (MODELS[1], MODES[0], 1), (MODELS[1], MODES[1], 2)])
def test_on_the_cluster_next_turns_hit_and_equal_a_run_without_the_cache(name, mode, pp):
    """Each family in each mode, once at PP=1 and once at PP=2 (the cache's logic does not depend on the
    pairing; in process every combination runs: test_next_turn_hits_and_equals_a_run_without_the_cache)."""
    from raymoe.cluster.engine_args import EngineArgs
    got, load, stats = chat_on_cluster(EngineArgs(name, pp=pp, dtype=mode, prefill_chunk=CHUNK,
                                                  max_batch_tokens=2 * CHUNK, prefix_cache_gb=0.25))
    assert same_bits(got, reference(name, mode))
    prefix = load["prefix_cache"]
    assert prefix["hits"] == 3 and prefix["hit_tokens"] == 64 + 96 + 128 and prefix["budget_bytes"] == 1 << 28
    assert 0 < prefix["hit_rate"] < 1 and load["prefill_tokens"] == sum(len(r["prompt_token_ids"]) for r in got) - 288
    held = sum(s["prefix_cache_bytes"] for s in stats["stages"])
    assert 0 < held <= prefix["bytes"]


@pytest.mark.cluster
@pytest.mark.parametrize("name", MODELS)
def test_a_stage_restart_empties_the_cache_without_changing_outputs(name):
    """Stage 1 is killed during the third turn: the coordinator drops its index, every stage its store (the
    survivor too), the turn recomputes from its tokens, and the fourth turn hits only what was stored since."""
    from raymoe.cluster.engine_args import EngineArgs
    # one decode step a call (the stages chain a lone sequence's steps): the 26th step falls in the third turn
    got, load, stats = chat_on_cluster(EngineArgs(name, pp=2, dtype="float32", prefill_chunk=CHUNK,
                                                  max_batch_tokens=2 * CHUNK, prefix_cache_gb=0.25, steps_per_call=1,
                                                  fault_injection={"stage": 1, "after_steps": 26}))
    expected = reference(name, "float32")
    assert stats["restarts"] == 1
    for a, b in zip(got, expected):
        # the recomputed turn ran its generated tokens as a prefill: logprobs agree to float32 noise (test_cluster)
        assert a["token_ids"] == b["token_ids"]
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-3 for x, y in zip(a["logprobs"], b["logprobs"]))
    assert same_bits(got[:2], expected[:2]) and same_bits(got[3], expected[3])
    prefix = load["prefix_cache"]
    # the turns before the restart hit (64, 96 tokens); after it only blocks stored since: turn 3's prompt
    assert prefix["hits"] == 3 and prefix["hit_tokens"] == 64 + 96 + 128
    held = sum(s["prefix_cache_bytes"] for s in stats["stages"])
    assert 0 < held <= prefix["bytes"]
    if name == "tiny-qwen35moe":
        assert held == prefix["bytes"]          # nothing of before the restart is left on the survivor


@pytest.mark.cluster
def test_health_and_metrics_show_the_prefix_cache():
    """Through the Serve app: a chat's second turn hits; /health shows the cache's fields, /metrics its gauges."""
    from ray import serve

    from raymoe.deploy.metrics import parse_metrics
    from raymoe.deploy.serve import app_builder
    from serve_util import free_port, get_json, get_text, post_raw

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    try:
        serve.run(app_builder({"model": "tiny-qwen35moe", "prefill_chunk": CHUNK, "max_batch_tokens": 2 * CHUNK,
                               "prefix_cache_gb": 0.25, "grpc_port": 0}), name="raymoe-prefix", route_prefix="/")
        history = [5 + i % 1000 for i in range(80)]
        for turn in range(2):
            body = {"model": "tiny-qwen35moe", "prompt": history, "max_tokens": 4, "temperature": 0}
            status, answer = post_raw(base + "/v1/completions", json.dumps(body).encode())
            assert status == 200, answer
            history = history + [7] * 40
        status, health = get_json(base + "/health")
        assert status == 200
        prefix = health["prefix_cache"]
        assert prefix["budget_bytes"] == 1 << 28 and prefix["block_tokens"] == CHUNK and prefix["bytes"] > 0
        assert prefix["hits"] == 1 and prefix["hit_tokens"] == 64 and 0 < prefix["hit_rate"] < 1
        assert health["prefill_tokens"] == 80 + 120 - 64
        metrics = parse_metrics(get_text(base + "/metrics"))
        labels = '{model="tiny-qwen35moe"}'
        assert metrics["raymoe_prefix_cache_bytes" + labels] == prefix["bytes"]
        assert metrics["raymoe_prefix_cache_hit_rate" + labels] == prefix["hit_rate"]
        assert metrics["raymoe_prefix_cache_hit_tokens" + labels] == 64
        assert metrics["raymoe_prefill_tokens" + labels] == 80 + 120 - 64
    finally:
        serve.shutdown()


@pytest.mark.cluster
def test_a_step_that_may_not_have_reached_the_stages_drops_the_cache():
    """A step whose submission failed (its prefix work perhaps never reached the stages) fails its sequences;
    the coordinator then drops its index and the next step tells the stages to drop their blocks: later
    requests miss, recompute, and the stages again hold exactly what the index says."""
    from raymoe.cluster.coordinator import Coordinator
    from raymoe.cluster.engine_args import EngineArgs
    from raymoe.cluster.pipeline import PipelineSpec
    from local_pipeline import LocalPipeline

    files = open_model("tiny-qwen35moe")
    args = EngineArgs(files.path, microbatches=1, prefill_chunk=CHUNK, max_batch_tokens=2 * CHUNK, max_running=64,
                      prefix_cache_gb=0.25).resolved()
    coord = Coordinator.__ray_metadata__.modified_class(PipelineSpec(args, files.n_layers, files.config.n_expert))
    coord.pipeline = LocalPipeline(files, fail_for=1)     # sequence 1's first step fails to submit
    prompt = list(range(300, 370))
    request = {"prompt_token_ids": prompt, "max_tokens": 4, "temperature": 0}
    later = {**request, "prompt_token_ids": prompt + [7] * 30}

    async def one(req):
        sid = await coord.submit("r", req)
        while True:
            for done, result in await coord.wait_finished(timeout=10):
                assert done == sid
                return result

    async def go():
        first = await one(request)
        failed = await one(later)               # it would have hit: its step's submission fails
        again = await one(later)                # the index was dropped: no hit
        return first, failed, again
    first, failed, again = asyncio.run(go())
    assert "error" in failed and "error" not in again
    load, store = coord.load()["prefix_cache"], coord.pipeline.stage.prefix
    assert load["hits"] == 1 and load["lookups"] == 3            # only the failed one hit
    assert set(store.blocks) == set(coord.core.prefix.index.entries) and store.bytes == load["bytes"] > 0
    reference = local_engine(files, "auto", cache=0)
    seq = reference.add_request("r", later["prompt_token_ids"], SamplingParams(max_tokens=4, temperature=0))
    reference.run_until_done()
    assert again["token_ids"] == seq.result()["token_ids"]


@pytest.mark.cluster
def test_a_batch_job_with_a_shared_preamble_hits(tmp_path, capsys):
    """deploy.generate, two requests running at a time: the lines that start after the first two share its
    300-token preamble's first block (256 tokens, the default step chunk); their outputs equal the job's without
    the cache (tokens; logprobs to float32 noise, since the batches differ), and the summary says how many
    prompt tokens hit."""
    from raymoe.deploy import generate

    g = torch.Generator().manual_seed(9)
    preamble = torch.randint(0, 2000, (300,), generator=g).tolist()
    lines = [{"id": i, "prompt_token_ids": preamble + torch.randint(0, 2000, (5 + 3 * i,), generator=g).tolist(),
              "max_tokens": 5, "logprobs": 1, "ignore_eos": True, **({"temperature": 0} if i % 2 else {"seed": i})}
             for i in range(6)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))

    def job(name, *flags):
        out = tmp_path / name
        assert generate.main(["--model", "tiny-qwen35moe", "--input", str(src), "--output", str(out),
                              "--max-running", "2", *flags]) == 0
        return [json.loads(line) for line in out.read_text().splitlines()], capsys.readouterr().err

    without, _ = job("without.jsonl", "--prefix-cache-gb", "0")
    got, err = job("with.jsonl", "--prefix-cache-gb", "0.25")
    # the lines after the first two hit the preamble's block; the second may too, when the job submits it after
    # the first has stored it (its admission step depends on when the job reads it)
    hit = re.search(r"prefix cache: (\d+) of \d+ prompt tokens hit \((\d+) requests\)", err)
    assert hit and int(hit[2]) in (4, 5) and int(hit[1]) == 256 * int(hit[2]), err
    for a, b in zip(got, without):
        assert a["token_ids"] == b["token_ids"]
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-3 for x, y in zip(a["logprobs"], b["logprobs"]))
