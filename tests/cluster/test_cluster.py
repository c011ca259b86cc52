"""The Ray cluster: PP=1/2/4 and EP give bit-identical outputs for every transport; each stage
holds only its share of the weights; a stage killed mid-run is replaced without changing the output; a
coordinator that dies too often fails the engine with one line."""
import os

import pytest
import torch

from raymoe.cluster.engine import ClusterEngine, EngineArgs
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.stage import Stage

pytestmark = pytest.mark.cluster

MODELS = ["tiny-qwen35moe", "tiny-gptoss"]
TRANSPORTS = ["object_store", "gloo", "shm"]
CHUNK = 32          # prefill chunk: several prompts below are longer


def requests(vocab: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(14):
        n = [5, 12, 40, 75, 3, 33, 64, 90, 8, 21, 50, 2, 70, 17][i]
        req = {"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist(), "max_tokens": 4 + i % 5}
        if i % 2:
            req.update(temperature=0.9, top_p=0.9, top_k=20, seed=100 + i)
        else:
            req.update(temperature=0)
        if i % 4 == 1:      # every control of docs/sampling.md: the penalties' history travels with the batch
            req.update(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, min_p=0.05,
                       logit_bias={"7": 2.5, "11": -4}, stop_token_ids=[3])
        elif i % 4 == 2:    # greedy on penalised logits
            req.update(repetition_penalty=1.5, frequency_penalty=1.0)
        if i % 3 == 0:
            req.update(logprobs=3, prompt_logprobs=2)
        out.append((f"r{i}", req))
    return out


def run(model, **kwargs):
    engine = ClusterEngine(EngineArgs(model, prefill_chunk=CHUNK, max_batch_tokens=2 * CHUNK, **kwargs))
    try:
        vocab = engine.config.vocab
        seq_ids = engine.submit_many(requests(vocab))
        assert all(isinstance(s, int) for s in seq_ids)
        results = {}
        while len(results) < len(seq_ids):
            for sid, r in engine.wait_finished(timeout=5):
                results[sid] = r
        return [results[s] for s in seq_ids], engine.stats()
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def references():
    """references(model) -> (model, results, stats) of PP=1 over the object store, run once per model."""
    done = {}

    def get(model):
        if model not in done:
            results, stats = run(model, pp=1)
            assert all("error" not in r for r in results)
            assert any(r["prompt_logprobs"] for r in results) and any(r["logprobs"] for r in results)
            assert stats["merged_steps"] > 0        # PP=1 sent its groups' decode steps as one step
            done[model] = model, results, stats
        return done[model]
    return get


@pytest.fixture(scope="module", params=MODELS)
def reference(request, references):
    return references(request.param)


# Every transport at PP=2 for both families; PP=4 (three hops) once per transport, spread over the families
# (each engine costs a Ray actor per stage, a few seconds of the suite; PP=3 over shm: test_shm_rings_...).
DEGREES = [(model, 2, transport) for model in MODELS for transport in TRANSPORTS] + [
    ("tiny-qwen35moe", 4, "gloo"), ("tiny-qwen35moe", 4, "shm"), ("tiny-gptoss", 4, "object_store")]


@pytest.mark.parametrize("model, pp, transport", DEGREES)
def test_pipeline_degrees_are_bit_identical(references, model, pp, transport):
    """The reference is PP=1 over the object store; every other degree and transport equals it."""
    _, expected, _ = references(model)
    results, stats = run(model, pp=pp, transport=transport)
    assert results == expected               # token ids, logprobs and prompt logprobs, bit for bit
    assert len(stats["stages"]) == pp
    if pp == 4:
        each_stage_holds_only_its_share(model, stats)


def each_stage_holds_only_its_share(model: str, stats: dict):
    files = open_model(model)
    whole = Stage(files, range(files.n_layers)).parameter_bytes()
    shares = [s["parameter_bytes"] for s in stats["stages"]]
    assert sum(shares) == whole
    assert all(0 < b < 0.5 * whole for b in shares)
    per = files.n_layers // 4
    assert [s["layers"] for s in stats["stages"]] == [[i * per, (i + 1) * per] for i in range(4)]


def test_expert_parallel_is_bit_identical(reference):
    model, expected, _ = reference
    results, _ = run(model, pp=2, ep=2)
    assert results == expected


def test_qwen3next_pipeline_and_experts_are_bit_identical(oracle):
    """The third family (its DeltaNet V heads in HF's grouped order) from its converted GGUF: PP=2 over the
    shared-memory rings and PP=2 x EP=2 equal PP=1 bit for bit."""
    path = oracle("qwen3next").gguf
    expected, _ = run(path, pp=1)
    assert all("error" not in r for r in expected) and any(r["prompt_logprobs"] for r in expected)
    assert run(path, pp=2, transport="shm")[0] == expected
    assert run(path, pp=2, ep=2)[0] == expected


def test_an_itl_target_reaches_the_scheduler(references):
    """--itl-target-ms at 1 ms (far below any step here): while sequences decode, prompts go on in the
    smallest chunks, so the same requests take more steps, and every one still completes."""
    model, expected, stats = references("tiny-gptoss")
    results, bounded = run(model, pp=2, itl_target_ms=1)
    assert all("error" not in r and r["token_ids"] for r in results)
    assert bounded["prefill_tokens"] == stats["prefill_tokens"] and bounded["steps"] > stats["steps"]


def test_a_stage_alone_takes_every_core_and_busy_stages_share_them():
    """Without --threads, at PP=2 on one node: a 250-token prompt alone in the pipeline is prefilled with
    every core of each stage in turn; its decode steps, too small to share out (PARALLEL_MIN_BYTES), on one
    thread; two prompts in flight at once share the cores between the stages."""
    from raymoe.kernels.threads import node_cores

    cores = node_cores()
    engine = ClusterEngine(EngineArgs("tiny-qwen35moe", pp=2, prefill_chunk=256, max_batch_tokens=512))
    prompt = {"prompt_token_ids": list(range(3, 253)), "max_tokens": 3, "temperature": 0}
    try:
        def run_all(requests):
            ids = set(engine.submit_many(requests))
            while ids:
                ids -= {s for s, _ in engine.wait_finished(timeout=60)}
            return [s["threads_used"] for s in engine.stats()["stages"]]

        assert run_all([("alone", prompt)]) == [sorted({1, cores})] * 2
        assert all(max(1, cores // 2) in used for used in run_all([("a", prompt), ("b", prompt)]))
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def exact_references(references):
    """exact_references(model) -> (model, results) of PP=1 in the exact mode: what a stage restart must
    reproduce. (In the fast mode the caches that a restart rebuilds by prefill come from float32 products
    where the original decode steps quantised activations to 8 bits, so later tokens may differ, as they
    would for the same prompt sent again in one piece.)"""
    done = {}

    def get(model):
        if model not in done:
            if model == "tiny-qwen35moe":          # float32 weights: the default mode is the exact one
                done[model] = model, references(model)[1]
            else:
                done[model] = model, run(model, pp=1, dtype="float32")[0]
        return done[model]
    return get


@pytest.fixture(scope="module", params=MODELS)
def exact_reference(request, exact_references):
    return exact_references(request.param)


# object store and gloo, one family each; a stage killed under shm: test_shm_rings_leave_nothing_behind
@pytest.mark.parametrize("model, transport", [("tiny-qwen35moe", "object_store"), ("tiny-gptoss", "gloo")])
def test_killed_stage_is_replaced_and_output_unchanged(exact_references, model, transport):
    _, expected = exact_references(model)
    results, stats = run(model, pp=2, transport=transport, dtype="float32",
                         fault_injection={"stage": 1, "after_steps": 5})
    assert stats["restarts"] == 1
    assert len(results) == len(expected)
    for got, want in zip(results, expected):
        assert got["id"] == want["id"] and got["token_ids"] == want["token_ids"]
        assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"]
        # Rebuilt caches come from differently chunked batches than the original steps (see
        # test_prefill_then_decode_equals_full_forward): logprobs agree to float32 noise.
        for key in ("logprobs", "prompt_logprobs"):
            for a, b in zip(got[key] or [], want[key] or []):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-3


def ring_mappings(pid: int) -> list[str]:
    """The shm transport's rings that process `pid` has mapped (each ends in " (deleted)": unlinked)."""
    from raymoe.cluster.pipeline import RING_PREFIX
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split(None, 5)[5].strip() for line in f if RING_PREFIX in line})


def gone(pid: int, timeout: float = 60) -> bool:
    import time
    deadline = time.time() + timeout
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
        time.sleep(0.2)
    return not os.path.exists(f"/proc/{pid}")


def test_shm_rings_leave_nothing_behind(exact_reference):
    """The rings are unlinked as soon as both stages hold them; a killed stage's ring is dropped by the
    survivor and replaced; after shutdown no process holds any."""
    model, expected = exact_reference
    engine = ClusterEngine(EngineArgs(model, pp=3, transport="shm", dtype="float32", prefill_chunk=CHUNK,
                                      max_batch_tokens=2 * CHUNK, fault_injection={"stage": 1, "after_steps": 5}))
    try:
        pids = [s["pid"] for s in engine.stats()["stages"]]
        rings = [ring_mappings(pid) for pid in pids]
        edges = [[r for r in held if "-back" not in r] for held in rings]
        assert len(edges[0]) == 1 and len(edges[1]) == 2 and len(edges[2]) == 1     # one ring per edge
        assert edges[0] == edges[1][:1] and edges[2] == edges[1][1:]
        back = [r for r in rings[0] if "-back" in r]            # and one from the last stage to the first
        assert len(back) == 1 and rings[0] == edges[0] + back and rings[2] == edges[2] + back
        assert all(r.endswith(" (deleted)") for r in rings[0] + rings[1] + rings[2])
        seq_ids = engine.submit_many(requests(engine.config.vocab))
        results = {}
        while len(results) < len(seq_ids):
            results.update(engine.wait_finished(timeout=5))
        assert [results[s]["token_ids"] for s in seq_ids] == [r["token_ids"] for r in expected]
        stats = engine.stats()
        assert stats["restarts"] == 1
        now = [s["pid"] for s in stats["stages"]]
        assert now[0] == pids[0] and now[2] == pids[2] and now[1] != pids[1] and gone(pids[1])
        fresh = [ring_mappings(pid) for pid in now]
        assert len(fresh[0]) == 2 and len(fresh[2]) == 2 and not set(fresh[0] + fresh[2]) & set(sum(rings, []))
        assert all(r.endswith(" (deleted)") for r in fresh[0] + fresh[2])
    finally:
        engine.shutdown()
    assert all(gone(pid) for pid in now)       # the last holders of the rings: the kernel frees them
    paths = [r.removesuffix(" (deleted)") for r in sum(rings, []) + fresh[0] + fresh[2]]
    assert not [p + end for p in paths for end in ("", ".full", ".free") if os.path.exists(p + end)]


def test_shm_passes_a_failure_down_the_rings(exact_references):
    """A stage that runs out of memory tells the next one through its ring, which fails too rather than
    waiting: the step's sequences get the out-of-memory error, the others go on unchanged."""
    from raymoe.cluster.coordinator import OOM_ERROR

    model, expected = exact_references("tiny-gptoss")
    results, stats = run(model, pp=2, transport="shm", dtype="float32",
                         fault_injection={"stage": 0, "after_steps": 5, "kind": "oom"})
    assert stats["restarts"] == 1
    failed = [r for r in results if "error" in r]
    assert 0 < len(failed) < len(results) and all(r["error"] == OOM_ERROR for r in failed)
    for got, want in zip(results, expected):
        if "error" not in got:
            assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]


def test_coordinator_deaths_beyond_the_limit_fail_with_one_line(monkeypatch):
    """A dead coordinator is replaced and its requests finish (tests/cluster/test_coordinator_faults.py: unchanged);
    one death more than MAX_RESTARTS within RESTART_WINDOW fails the engine, for good, with one line."""
    import ray

    from raymoe.cluster import engine as cluster_engine
    from raymoe.stages.errors import RaymoeError

    monkeypatch.setattr(cluster_engine, "MAX_RESTARTS", 1)
    engine = ClusterEngine(EngineArgs("tiny-qwen35moe", pp=2))
    try:
        batch = requests(engine.config.vocab)
        seq_ids = engine.submit_many(batch)
        ray.kill(engine.coordinator, no_restart=True)
        results = {}
        while len(results) < len(seq_ids):
            results.update(engine.wait_finished(timeout=5))
        assert sorted(results) == sorted(seq_ids) and all("error" not in r for r in results.values())
        assert engine.stats()["coordinator_restarts"] == 1
        engine.submit_many(batch)
        ray.kill(engine.coordinator, no_restart=True)
        with pytest.raises(RaymoeError, match="^the coordinator actor died 2 times within 10 minutes; giving up"):
            for _ in range(10):
                engine.wait_finished(timeout=1)
        with pytest.raises(RaymoeError, match="giving up"):
            engine.submit("late", batch[0][1])
    finally:
        engine.shutdown()


def test_out_of_memory_fails_its_batch_and_is_not_retried(exact_references):
    from raymoe.cluster.coordinator import OOM_ERROR

    model, expected = exact_references("tiny-qwen35moe")
    results, stats = run(model, pp=2, dtype="float32", fault_injection={"stage": 1, "after_steps": 5, "kind": "oom"})
    assert stats["restarts"] == 1
    failed = [r for r in results if "error" in r]
    assert 0 < len(failed) < len(results)
    assert all(r["error"] == OOM_ERROR for r in failed)
    for got, want in zip(results, expected):
        if "error" not in got:
            assert got["id"] == want["id"] and got["token_ids"] == want["token_ids"] and got["text"] == want["text"]


def test_out_of_memory_is_told_from_other_deaths():
    import ray

    from raymoe.cluster.coordinator import out_of_memory

    assert out_of_memory(ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory."))
    assert out_of_memory(ray.exceptions.RayActorError(
        error_msg="The actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY"))
    assert out_of_memory(ray.exceptions.RayTaskError("forward", "", MemoryError()))
    # an unexpected exit names the OOM killer only as a possible cause: a crash, restarted
    assert not out_of_memory(ray.exceptions.RayActorError(
        error_msg="Worker exit type: SYSTEM_ERROR ... (1) The process is killed by SIGKILL by OOM killer due to high "
                  "memory usage."))
    assert not out_of_memory(ray.exceptions.RayTaskError("forward", "", ValueError()))
