"""The model checks of the GPU script (tests/gpu/run.py): whole models on the GPU, driven without Ray.

outputs()   both embedded models on --device cuda against the CPU (float32 mode on both, so the same
            arithmetic up to summation order): 32 greedy tokens for a batch of prompts must be the same
            tokens, their logprobs within LOGPROB_BOUND; and the GPU at PP=2 and PP=4 (stages in one
            process, on one device) must give the GPU's PP=1 results exactly.
graphs()    decode steps replayed as CUDA graphs against eager steps (stages/runtime/decode_graph.py).
through_ray()  the embedded qwen35moe through Ray (`--device cuda`): PP=1, and PP=2 with both stage actors on one GPU
            where there is one (half a GPU each), must give the in-process GPU's tokens; tok/s of both.
decode()    a full-size synthetic file (tools.make_synthetic) on the GPU: load time, batch-1 decode
            tok/s eager and with CUDA graphs, and the weight bytes it reads per second against the
            device's peak (the roofline: bytes read per token / bandwidth), where a step's time goes, and
            the aggregate tok/s of BATCH sequences decoding together.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import torch

from raymoe.kernels import gpu_ops
from raymoe.stages.runtime import decode_graph
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.sampling_params import SamplingParams

# Summation order differs (cuBLAS and the Triton kernels against the CPU kernels) in float32; a logprob
# is a difference of logits of size ~10 built from sums of thousands of terms: 1e-6 relative error per
# product gives ~1e-4. The bound leaves a margin of 10.
LOGPROB_BOUND = 1e-3
PROMPTS = ["The quick brown fox", "def main():\n    return", "In the beginning the Universe was created.",
           "Pipeline parallelism splits the layers of a model into stages, and each stage"]
BATCH = 64
# which operations take the Triton kernels on the GPU (kernels/gpu_ops.py); products always do
VARIANTS = {"Triton for every op": gpu_ops.ALL_OPS, "torch for the small ops": {"delta_rule"}}


def _generate(files, device: str, n_stages: int = 1, max_tokens: int = 32, prompts=PROMPTS, graphs: bool = True,
              runners: list | None = None) -> list[dict]:
    """Greedy generations with logprobs; graphs False: decode steps eager (no CUDA graphs); runners: a list
    that gets each stage's DecodeGraphs."""
    engine = LocalEngine(files, n_stages=n_stages, mode="float32", device=device)
    _use_graphs(engine, graphs)
    if runners is not None:
        runners.extend(stage.graphs for stage in engine.stages)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1, ignore_eos=True)
    seqs = [engine.add_request(str(i), files.tokenizer.encode(p), params) for i, p in enumerate(prompts)]
    engine.run_until_done()
    return [s.result() for s in seqs]


def _use_graphs(engine, on: bool) -> None:
    for stage in engine.stages:
        stage.graphs = decode_graph.DecodeGraphs(stage.layers) if on and stage.device.type == "cuda" else None


def _compare(cpu: list[dict], gpu: list[dict]) -> tuple[int, float]:
    """(sequences whose tokens differ, largest |logprob difference| over the tokens both chose)."""
    differ, worst = 0, 0.0
    for a, b in zip(cpu, gpu):
        if a["token_ids"] != b["token_ids"]:
            differ += 1
            first = next(i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y)
            top = a["logprobs"][first]["top"]
            print(f"    request {a['id']}: tokens differ from position {first} (CPU top-1 {top})")
        for ea, eb in zip(a["logprobs"], b["logprobs"]):
            if ea["token_id"] != eb["token_id"]:
                break
            worst = max(worst, abs(ea["logprob"] - eb["logprob"]))
    return differ, worst


def outputs() -> int:
    failures = 0
    for name in ("tiny-qwen35moe", "tiny-gptoss"):
        files = open_model(name)
        start = time.perf_counter()
        cpu = _generate(files, "cpu")
        default_ops = gpu_ops.TRITON_OPS
        for label, ops in VARIANTS.items():      # both op sets of kernels/gpu_ops.py
            gpu_ops.TRITON_OPS = ops
            gpu = _generate(files, "cuda")
            differ, worst = _compare(cpu, gpu)
            ok = differ == 0 and worst <= LOGPROB_BOUND
            failures += not ok
            print(f"  {'pass' if ok else 'FAIL'}  {name}, {label}: GPU vs CPU, {len(PROMPTS)} prompts x 32 greedy "
                  f"tokens: {differ} sequence(s) differ, max |logprob diff| {worst:.2e} (bound {LOGPROB_BOUND:g}) "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
        gpu_ops.TRITON_OPS = default_ops
        gpu = _generate(files, "cuda")
        for n_stages in (2, 4):
            same = _generate(files, "cuda", n_stages) == gpu
            failures += not same
            print(f"  {'pass' if same else 'FAIL'}  {name}: GPU PP={n_stages} = GPU PP=1 exactly", flush=True)
    return failures


def through_ray() -> int:
    from raymoe.cluster.engine import ClusterEngine, EngineArgs, disconnect_ray

    failures, name = 0, "tiny-qwen35moe"
    files = open_model(name)
    start = time.perf_counter()
    want = [r["token_ids"] for r in _generate(files, "cuda")]
    local_s = time.perf_counter() - start
    lines = [(str(i), {"prompt": p, "max_tokens": 32, "temperature": 0, "ignore_eos": True})
             for i, p in enumerate(PROMPTS)]
    for pp in (1, 2):
        engine = ClusterEngine(EngineArgs(name, device="cuda", dtype="float32", pp=pp))
        try:
            start, got = time.perf_counter(), {}
            engine.submit_many(lines)
            while len(got) < len(lines):
                for _, result in engine.wait_finished(timeout=5):
                    got[result["id"]] = result
            ray_s = time.perf_counter() - start
        finally:
            engine.shutdown()
        tokens = [got[str(i)].get("token_ids") for i in range(len(lines))]
        same = tokens == want
        failures += not same
        print(f"  {'pass' if same else 'FAIL'}  {name} through Ray on the GPU, PP={pp}: the in-process GPU's tokens "
              f"({32 * len(lines) / ray_s:.0f} tok/s after start-up; in process {32 * len(lines) / local_s:.0f})",
              flush=True)
    disconnect_ray()
    return failures


def graphs() -> int:
    """Decode steps replayed as CUDA graphs against the same requests with every step eager, both embedded
    models on the GPU, the default ops (kernels/gpu_ops.py): the same tokens, logprobs within LOGPROB_BOUND,
    and whether they are the same bits; at 1 and 4 sequences."""
    failures = 0
    for name in ("tiny-qwen35moe", "tiny-gptoss"):
        files = open_model(name)
        for n in (1, 4):
            start, runners = time.perf_counter(), []
            eager = _generate(files, "cuda", prompts=PROMPTS[:n], graphs=False)
            graphed = _generate(files, "cuda", prompts=PROMPTS[:n], runners=runners)
            differ, worst = _compare(eager, graphed)
            replayed = sum(r.replayed for r in runners)
            ok = differ == 0 and worst <= LOGPROB_BOUND and replayed > 0
            failures += not ok
            print(f"  {'pass' if ok else 'FAIL'}  {name}, {n} sequence(s): graphs vs eager: {differ} sequence(s) "
                  f"differ, max |logprob diff| {worst:.2e}, same bits: {eager == graphed}; "
                  f"{sum(r.captured for r in runners)} captured, {replayed} steps replayed "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    return failures


def _graph_ms(engine, replays: int = 20) -> float:
    """The GPU time of the first stage's last captured decode step replayed alone (it scribbles on the
    sequence's caches: clear the engine after)."""
    step = next(reversed(engine.stages[0].graphs.steps.values()))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        step.graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays * 1000


def _host_breakdown(engine, steps: int = 32) -> str:
    """Where a decode step's wall time goes: engine.step, the stages' forward in it (which waits for the
    GPU when it copies the logits), the graph runner's call in that (host work and launches: it does not
    wait) and the sampling."""
    import raymoe.stages.runtime.stage as stage_module

    spent = {"step": 0.0, "forward": 0.0, "graphs": 0.0, "sampling": 0.0}

    def timed(key, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
        return run

    real_call, real_sample = decode_graph.DecodeGraphs.__call__, stage_module.sample_chunks
    decode_graph.DecodeGraphs.__call__ = timed("graphs", real_call)
    stage_module.sample_chunks = timed("sampling", real_sample)
    forwards = [(stage, stage.forward) for stage in engine.stages]
    for stage, forward in forwards:
        stage.forward = timed("forward", forward)
    try:
        for _ in range(steps):
            timed("step", engine.step)()
    finally:
        decode_graph.DecodeGraphs.__call__, stage_module.sample_chunks = real_call, real_sample
        for stage, forward in forwards:
            del stage.forward
    ms = {k: v / steps * 1000 for k, v in spent.items()}
    return (f"a step {ms['step']:.2f} ms: forward {ms['forward']:.2f} (the graph runner's call {ms['graphs']:.2f}, "
            f"sampling {ms['sampling']:.2f}), the engine around it {ms['step'] - ms['forward']:.2f}")


def _host_profile(engine, steps: int = 16, top: int = 15) -> str:
    """The host's functions that take most of `steps` decode steps, by their own time (cProfile)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return "\n".join([f"  host functions by own time over {steps} steps (cProfile):"]
                     + ["    " + line for line in lines[start:start + top + 1]])


def _bytes_per_token(files) -> tuple[int, int]:
    """(weight bytes the file holds, weight bytes one batch-1 decode step reads): every matrix once,
    the routed experts' share n_used / n_expert, the embedding one row."""
    cfg, total, read = files.config, 0, 0
    for name, info in files.source.tensors.items():
        total += info.n_bytes
        if name == "token_embd.weight":
            read += info.n_bytes // cfg.vocab
        elif "_exps." in name:
            read += info.n_bytes * cfg.n_expert_used // cfg.n_expert
        else:
            read += info.n_bytes
    return total, read


def _decode_rate(engine, n_steps: int) -> tuple[float, int]:
    """(seconds, tokens) of n_steps engine steps once every sequence decodes."""
    while any(s.n_cached < len(s.prompt_ids) for s in engine.sequences.values()):
        engine.step()
    engine.step()          # warm: every kernel variant of a decode step compiled,
    engine.step()          # and the step captured as a CUDA graph (on its second step)
    torch.cuda.synchronize()
    before = sum(len(s.output_ids) for s in engine.sequences.values())
    start = time.perf_counter()
    for _ in range(n_steps):
        engine.step()
    seconds = time.perf_counter() - start      # each step ends with its logits on the host: synchronised
    return seconds, sum(len(s.output_ids) for s in engine.sequences.values()) - before


def _clear(engine):
    for seq in list(engine.sequences.values()):
        engine.finish(seq, "abort")
    for stage in engine.stages:
        stage.caches.clear()


def _profile_step(engine, steps: int = 2):
    """Where a decode step's time goes: the GPU's kernel time per step against the wall time, and the
    kernels that take most of it (the rest of the wall time is the host launching them)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    gpu = sum(e.device_time_total for e in events) / steps / 1e6
    launches = sum(e.count for e in events) / steps
    print(f"  profile (under the profiler, which slows the host): {wall * 1000:.1f} ms per step, GPU busy "
          f"{gpu * 1000:.1f} ms in {launches:.0f} kernels; most time:", flush=True)
    for e in sorted(events, key=lambda e: -e.device_time_total)[:5]:
        print(f"    {e.device_time_total / steps / 1000:8.2f} ms  x{e.count // steps:<5} {e.key[:90]}", flush=True)


def decode(model: str, peak_gb_s: float | None, folder: str = "/tmp") -> int:
    path = os.path.join(folder, f"{model}.gguf")
    if not os.path.exists(path):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "raymoe.tools.make_synthetic", "--model", model, "--out", path], check=True,
                       stdout=subprocess.DEVNULL)
        print(f"  wrote {path} in {time.perf_counter() - start:.0f} s", flush=True)
    files = open_model(path, max_model_len=4096)
    total, per_token = _bytes_per_token(files)
    start = time.perf_counter()
    engine = LocalEngine(files, mode="auto", device="cuda")
    torch.cuda.synchronize()
    load = time.perf_counter() - start
    print(f"  {model}: {total / 1e9:.2f} GB of weights loaded to the GPU in {load:.1f} s "
          f"({total / load / 1e9:.1f} GB/s); a batch-1 decode step reads {per_token / 1e9:.2f} GB", flush=True)
    prompt = files.tokenizer.encode("The quick brown fox jumps over the lazy dog")[:8]
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    roofline = peak_gb_s * 1e9 / per_token if peak_gb_s else math.nan
    default_ops = gpu_ops.TRITON_OPS
    variants = [("eager, torch for the small ops (RAYMOE_CUDA_GRAPHS=0)", False, {"delta_rule"}),
                ("CUDA graphs, Triton for every op (the default)", True, gpu_ops.ALL_OPS)]
    for label, graphs_on, ops in variants:
        _use_graphs(engine, graphs_on)
        gpu_ops.TRITON_OPS = ops
        _clear(engine)
        engine.add_request("one", prompt, params)
        seconds, tokens = _decode_rate(engine, 32)
        single = tokens / seconds
        print(f"  batch 1, {label}: {single:.1f} tok/s ({1000 / single:.2f} ms/token), weights read at "
              f"{per_token * single / 1e9:.0f} GB/s" + (f" = {single / roofline:.1%} of the HBM roofline "
                                                        f"({roofline:.0f} tok/s at {peak_gb_s:.0f} GB/s)"
                                                        if peak_gb_s else ""), flush=True)
    print(f"  host: {_host_breakdown(engine)}", flush=True)
    print(_host_profile(engine), flush=True)
    _profile_step(engine)
    graph_ms = _graph_ms(engine)
    print(f"  the layers' graph replayed alone: {graph_ms:.2f} ms a step ({1000 / graph_ms:.0f} steps/s); the rest "
          f"of a step above is the host's (embedding, LM head, sampling, the engine)", flush=True)
    from raymoe.kernels.triton import blocks

    default_sorted = blocks.SORTED_SLOTS
    try:
        for batch in (4, BATCH):
            for sorted_slots, how in ((default_sorted, "experts' rows sorted on the device"),
                                      (1 << 30, "a row per slot")):
                blocks.SORTED_SLOTS = sorted_slots
                _use_graphs(engine, True)
                _clear(engine)
                for i in range(batch):
                    engine.add_request(f"b{i}", prompt, params)
                seconds, tokens = _decode_rate(engine, 16)
                rate = tokens / seconds
                print(f"  batch {batch} (CUDA graphs, {engine.stages[0].graphs.replayed} steps replayed; slot "
                      f"products: {how}): {rate:.1f} tok/s aggregate = {rate / single:.1f}x batch 1 (max memory "
                      f"allocated {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)", flush=True)
    finally:        # the sections after this one run with the default
        blocks.SORTED_SLOTS = default_sorted
    print(f"  {_churn(engine, prompt)}", flush=True)
    gpu_ops.TRITON_OPS = default_ops
    del engine
    torch.cuda.empty_cache()
    return 0


def _churn(engine, prompt, n: int = 48, running: int = 16) -> str:
    """Continuous batching, where graphs are weakest: n requests of 8-64 new tokens each, at most `running`
    at once, so the batch changes whenever one finishes or joins (each change a capture). Aggregate tok/s
    with graphs and eager (as RAYMOE_CUDA_GRAPHS=0 runs: torch for the small ops)."""
    import random

    lengths = random.Random(0).choices(range(8, 65), k=n)
    rates, default_running, default_ops, captured = [], engine.max_running, gpu_ops.TRITON_OPS, 0
    for on in (True, False):
        _use_graphs(engine, on)
        gpu_ops.TRITON_OPS = gpu_ops.ALL_OPS if on else {"delta_rule"}
        _clear(engine)
        engine.max_running = running
        for i, m in enumerate(lengths):
            engine.add_request(f"c{i}", prompt, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.run_until_done()
        rates.append(sum(lengths) / (time.perf_counter() - start))
        captured += sum(stage.graphs.captured for stage in engine.stages if stage.graphs is not None)
    engine.max_running, gpu_ops.TRITON_OPS = default_running, default_ops
    return (f"churn ({n} requests of 8-64 tokens, at most {running} at once, prefill included): graphs "
            f"{rates[0]:.1f} tok/s ({captured} captures), eager {rates[1]:.1f}")


def _stage_process(model: str, layers: tuple[int, int], requests, replies):
    """A second stage in its own process: its input arrives through the CUDA IPC ring."""
    from raymoe.tools.cuda_ipc import IpcReader
    from raymoe.stages.runtime.stage import Stage

    stage = Stage(open_model(model), range(*layers), "float32", device="cuda")
    reader = None
    while (message := requests.get()) is not None:
        kind, *args = message
        if kind == "open":
            reader = IpcReader(args[0])
            replies.put("open")
        elif kind == "forward":
            batch, descriptor = args
            replies.put(stage.forward(batch, reader.get(descriptor)))
        elif kind == "release":
            for seq_id in args[0]:
                stage.release(seq_id)
        elif kind == "read":        # one hop: the slot copied out on this side
            reader.get(args[0])
            replies.put(None)
        elif kind == "bytes":       # one hop staged through the host: bytes pickled, then to the GPU
            torch.frombuffer(bytearray(args[0]), dtype=torch.float32).cuda()
            torch.cuda.synchronize()
            replies.put(None)
        else:                       # "ping": the queue's own round trip
            replies.put(None)


class IpcPipeline:
    """PP=2 with the second stage in a child process, activations through tools.cuda_ipc (no Ray)."""

    def __init__(self, files, engine_core):
        import torch.multiprocessing as mp

        from raymoe.tools.cuda_ipc import IpcRing
        from raymoe.stages.runtime.engine import split_layers
        from raymoe.stages.runtime.stage import Stage

        first, second = split_layers(files.n_layers, 2)
        self.core, self.stage = engine_core, Stage(files, first, "float32", device="cuda")
        ctx = mp.get_context("spawn")
        self.requests, self.replies = ctx.Queue(), ctx.Queue()
        self.child = ctx.Process(target=_stage_process, args=(files.path, (second.start, second.stop),
                                                              self.requests, self.replies), daemon=True)
        self.child.start()
        self.ring = IpcRing(2, max(512 * files.config.hidden, 64 * 2880) * 4)     # the hop measurement: 64 x 2880
        self.requests.put(("open", self.ring.handles()))
        assert self.replies.get(timeout=300) == "open"

    def step(self):
        planned = self.core.next_batch(0)
        if planned is None:
            return []
        batch, plan = planned
        self.requests.put(("forward", batch, self.ring.put(self.stage.forward(batch))))
        finished = self.core.consume(self.replies.get(timeout=300), plan)
        ids = [s.seq_id for s in finished]
        for seq_id in ids:
            self.stage.release(seq_id)
        self.requests.put(("release", ids))
        return finished

    def hop_ms(self, message_for, repeats: int = 200) -> float:
        """Median round trip of a message (from message_for()) to the child and its empty reply."""
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.requests.put(message_for())
            self.replies.get(timeout=60)
            times.append(time.perf_counter() - start)
        return 1000 * sorted(times)[len(times) // 2]

    def close(self):
        self.requests.put(None)
        self.child.join(timeout=30)


def ipc() -> int:
    """PP=2 across two processes on one GPU through CUDA IPC: outputs equal the one-process GPU PP=1
    outputs exactly; and the hop's cost against the queue alone and against staging through the host."""
    from raymoe.stages.runtime.engine import EngineCore

    failures = 0
    for name in ("tiny-qwen35moe", "tiny-gptoss"):
        files = open_model(name)
        reference = _generate(files, "cuda")
        core = EngineCore(files.config, files.tokenizer)
        pipeline = IpcPipeline(files, core)
        params = SamplingParams(max_tokens=32, temperature=0, logprobs=1, ignore_eos=True)
        seqs = [core.add_request(str(i), files.tokenizer.encode(p), params) for i, p in enumerate(PROMPTS)]
        while core.has_work():
            pipeline.step()
        same = [s.result() for s in seqs] == reference
        failures += not same
        print(f"  {'pass' if same else 'FAIL'}  {name}: PP=2 in two processes through CUDA IPC = GPU PP=1 exactly",
              flush=True)
        if name == "tiny-gptoss":
            queue = pipeline.hop_ms(lambda: ("ping",))
            for rows in (1, 64):
                x = torch.randn(rows, 2880, device="cuda")       # gpt-oss-20b's hidden size
                hop = pipeline.hop_ms(lambda: ("read", pipeline.ring.put(x)))
                staged = pipeline.hop_ms(lambda: ("bytes", x.cpu().numpy().tobytes()))
                print(f"  hop of {rows} x 2880 float32: CUDA IPC {hop:.3f} ms, staged through the host "
                      f"{staged:.3f} ms (the queue's own round trip {queue:.3f} ms)", flush=True)
        pipeline.close()
    return failures
