"""deploy.generate end to end on the embedded default model: the JSONL contract of docs/model-formats.md §1."""
import json
import math
import os

import pytest

from raymoe.deploy import generate
from raymoe.stages.errors import RequestError

pytestmark = pytest.mark.cluster

FIELDS = {"id", "prompt_token_ids", "token_ids", "text", "finish_reason", "usage", "logprobs", "prompt_logprobs"}


def run(tmp_path, requests, *flags, name="out"):
    src, out = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in requests))
    assert generate.main(["--model", "tiny-qwen35moe", "--input", str(src), "--output", str(out), *flags]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_output_contract(tmp_path, capsys):
    reqs = [{"id": "a", "prompt": "Hello world", "max_tokens": 5, "logprobs": 3, "prompt_logprobs": 2},
            {"id": 7, "prompt_token_ids": [3, 4, 5], "max_tokens": 2},
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}]
    out = run(tmp_path, reqs, "--temperature", "0")
    assert [r["id"] for r in out] == ["a", 7, 2]
    for r in out:
        assert set(r) == FIELDS | ({"reasoning_content"} if r["id"] == 2 else set())   # a chat line's reasoning
        assert r["usage"] == {"prompt_tokens": len(r["prompt_token_ids"]), "completion_tokens": len(r["token_ids"]),
                              "cached_tokens": r["usage"]["cached_tokens"]}
        assert 0 <= r["usage"]["cached_tokens"] < len(r["prompt_token_ids"])
        assert r["finish_reason"] in ("stop", "length")
    a = out[0]
    assert len(a["token_ids"]) == 5 and a["finish_reason"] == "length"
    assert len(a["logprobs"]) == 5
    for tok, entry in zip(a["token_ids"], a["logprobs"]):
        assert entry["token_id"] == tok and len(entry["top"]) == 3
        lps = [lp for _, lp in entry["top"]]
        assert lps == sorted(lps, reverse=True) and entry["logprob"] == lps[0]   # greedy takes the best
        assert all(lp <= 0 for lp in lps)
    assert a["prompt_logprobs"][0] is None and len(a["prompt_logprobs"]) == len(a["prompt_token_ids"])
    for i, entry in enumerate(a["prompt_logprobs"][1:], start=1):
        assert entry["token_id"] == a["prompt_token_ids"][i] and len(entry["top"]) == 2
    assert out[1]["logprobs"] is None and out[1]["prompt_logprobs"] is None
    # the chat request went through the template: ChatML with the assistant turn opened by <think>
    from raymoe.stages.files.loader import open_model
    tok = open_model("tiny-qwen35moe").tokenizer
    assert tok.decode(out[2]["prompt_token_ids"]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    err = capsys.readouterr().err
    assert "3 requests (0 failed)" in err and "tok/s" in err


def test_seed_gives_same_tokens_whatever_the_batch(tmp_path):
    target = {"id": "t", "prompt": "Once upon a time", "temperature": 1.0, "seed": 1234, "max_tokens": 12}
    alone = run(tmp_path, [target], name="alone")[0]
    crowd = [{"id": i, "prompt": "noise " * (i + 1), "temperature": 0.9, "max_tokens": 6 + i} for i in range(5)]
    other_seed = {**target, "id": "other", "seed": 99}
    out = run(tmp_path, crowd[:2] + [target] + crowd[2:] + [other_seed], name="mixed")
    assert out[2]["token_ids"] == alone["token_ids"]
    assert out[-1]["token_ids"] != alone["token_ids"]


def test_sampling_controls(tmp_path):
    base = {"prompt": "The numbers", "max_tokens": 8, "logprobs": 5}
    # one job: each line's sampling is its own, whatever else is in the batch (test_seed_gives_same_tokens_...)
    greedy, top1, tiny_p, hot = run(tmp_path, [{**base, "temperature": 0},
                                               {**base, "temperature": 1.5, "top_k": 1, "seed": 3},
                                               {**base, "temperature": 1.5, "top_p": 1e-6, "seed": 4},
                                               {**base, "temperature": 1.0, "seed": 5}])
    assert top1["token_ids"] == greedy["token_ids"]      # top_k 1 is greedy whatever the temperature
    assert tiny_p["token_ids"] == greedy["token_ids"]    # top_p -> only the most likely token survives
    for entry in hot["logprobs"]:                        # logprobs are of the raw logits: a distribution
        assert sum(math.exp(lp) for _, lp in entry["top"]) <= 1.0 + 1e-6
        assert entry["logprob"] in [lp for _, lp in entry["top"]] or entry["logprob"] <= entry["top"][-1][1]


def test_a_line_overrides_the_jobs_sampling_flags(tmp_path, capsys):
    """The flags set the job's sampling (here greedy with a repetition penalty); each line's own fields
    override them: penalties, logit_bias, stop_token_ids, min_p. A line with a bad value or with n gets an
    error naming the field, and the rest of the batch runs."""
    base = {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 16, "ignore_eos": True}
    lines = [{**base, "id": "job"},
             {**base, "id": "plain", "repetition_penalty": 1},
             {**base, "id": "bias", "temperature": 1.0, "seed": 3, "logit_bias": {"42": 100}},
             {**base, "id": "stop", "temperature": 1.0, "seed": 3, "logit_bias": {"42": 100}, "stop_token_ids": [42]},
             {**base, "id": "min_p", "temperature": 1.5, "seed": 4, "min_p": 1.0},   # the best token alone: greedy
             {**base, "id": "pen", "repetition_penalty": 1, "frequency_penalty": -1, "presence_penalty": -2},
             {**base, "id": "n", "n": 2},
             {**base, "id": "bad", "min_p": 2},
             {**base, "id": "bad_bias", "logit_bias": {"999999": 1}}]
    out = {r["id"]: r for r in run(tmp_path, lines, "--temperature", "0", "--repetition-penalty", "1.8")}
    assert out["job"]["token_ids"] != out["plain"]["token_ids"]
    assert out["bias"]["token_ids"] == [42] * 16
    assert out["stop"]["token_ids"] == [42] and out["stop"]["finish_reason"] == "stop"
    assert out["min_p"]["token_ids"] == out["job"]["token_ids"]
    assert out["pen"]["token_ids"] not in (out["job"]["token_ids"], out["plain"]["token_ids"])
    assert out["n"]["error"].startswith("n must be 1")
    assert out["bad"]["error"] == "min_p must be a number in [0, 1], got 2"
    assert out["bad_bias"]["error"].startswith("logit_bias token id 999999 is outside the vocabulary")
    assert "9 requests (3 failed)" in capsys.readouterr().err
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps(base) + "\n")
    assert generate.main(["--model", "tiny-qwen35moe", "--input", str(src), "--output", str(tmp_path / "x.jsonl"),
                          "--presence-penalty", "3"]) == 2
    assert "bad sampling flag: presence_penalty must be a number in [-2, 2]" in capsys.readouterr().err


def test_stop_strings(tmp_path):
    first = run(tmp_path, [{"prompt": "Hello", "max_tokens": 16, "temperature": 0}], name="free")[0]
    text = first["text"]
    stop = text[3:5]
    assert stop and stop in text
    stopped = run(tmp_path, [{"prompt": "Hello", "max_tokens": 16, "temperature": 0, "stop": [stop]}], name="stop")[0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == text[:text.find(stop)]
    assert stopped["token_ids"] == first["token_ids"][:len(stopped["token_ids"])]


def test_hf_dir_and_gguf_agree(tmp_path):
    from raymoe.tools.make_tiny import make_tiny
    gguf_path = make_tiny("qwen35moe", str(tmp_path / "model"))         # a random model: this is an exactness test
    hf_dir = str(tmp_path / "model" / "hf")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "Pipelines", "max_tokens": 10, "temperature": 0, "logprobs": 1}) + "\n")
    outs = []
    for model in (gguf_path, hf_dir):
        out = tmp_path / f"{len(outs)}.jsonl"
        assert generate.main(["--model", model, "--input", str(src), "--output", str(out)]) == 0
        outs.append(json.loads(out.read_text()))
    a, b = outs
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 10
    for x, y in zip(a["logprobs"], b["logprobs"]):
        assert abs(x["logprob"] - y["logprob"]) < 1e-5


def test_int8_mode_is_close_to_float32(tmp_path):
    req = [{"prompt": "Hello", "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}]
    exact = run(tmp_path, req, "--dtype", "float32", name="f32")[0]
    fast = run(tmp_path, req, "--dtype", "int8", name="int8")[0]
    assert fast["prompt_token_ids"] == exact["prompt_token_ids"]
    diffs = [abs(a["logprob"] - b["logprob"]) for a, b in zip(exact["prompt_logprobs"][1:], fast["prompt_logprobs"][1:])]
    # approximate (measured: up to 0.52 nats on this tiny random model), and really computed from int8 rows
    assert max(diffs) < 1.0 and sum(diffs) > 0


def test_ignore_eos_generates_through_end_tokens():
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.files.loader import open_model
    from raymoe.stages.text.sampling_params import SamplingParams

    engine = LocalEngine(open_model("tiny-qwen35moe"))
    first = engine.add_request("first", [5, 6, 7], SamplingParams(max_tokens=1, temperature=0))
    engine.run_until_done()
    engine.eos_ids = {first.output_ids[0]}                    # the greedy first token now ends a sequence
    stops = engine.add_request("stops", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0))
    runs = engine.add_request("runs", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.run_until_done()
    assert stops.output_ids == first.output_ids and stops.finish_reason == "stop"
    assert len(runs.output_ids) == 6 and runs.output_ids[0] == first.output_ids[0] and runs.finish_reason == "length"
    with pytest.raises(RequestError, match="ignore_eos must be a boolean"):
        SamplingParams.from_dict({"ignore_eos": "yes"})


def test_a_tiny_temperature_is_greedy_and_stalls_nothing(tmp_path):
    """Issue 14, case 1: temperature 1e-40 once overflowed in sampling and hung the whole batch."""
    base = {"prompt": "Hello", "max_tokens": 6}
    out = run(tmp_path, [{**base, "id": "normal", "temperature": 0}, {**base, "id": "tiny", "temperature": 1e-40}])
    assert [r["id"] for r in out] == ["normal", "tiny"] and "error" not in out[1]
    assert out[1]["token_ids"] == out[0]["token_ids"]


@pytest.mark.parametrize("sig, delay", [("SIGTERM", 0), ("SIGTERM", 3), ("SIGKILL", 1)])
def test_a_killed_driver_leaves_no_ray_process(tmp_path, sig, delay):
    """A driver stopped by SIGTERM while its model loads (delay 0 after the stage actor appears) or mid-job
    stops the local Ray cluster it started, and every worker with it, and says so in one line; one killed by
    SIGKILL cannot, and its watchdog (cluster/watchdog.py) stops what Ray's own fate sharing leaves (the
    raylet's agents) within seconds."""
    import signal
    import subprocess
    import sys
    import time

    from serve_util import ROOT, descendants, still_running

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": "Hello", "max_tokens": 4000, "ignore_eos": True}) + "\n"
                           for i in range(4)))      # tens of seconds of work
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "raymoe.deploy.generate", "--model", "tiny-qwen35moe", "--input", str(src),
                             "--output", str(tmp_path / "out.jsonl")], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while True:                        # generating: the stage actor is up
            children = descendants(proc.pid)
            if any(b"ray::Stage" in _cmdline(pid) for pid in children):
                break
            assert proc.poll() is None and time.time() < deadline, "the job did not start generating"
            time.sleep(0.5)
        time.sleep(delay)
        children = descendants(proc.pid)
        assert any(b"cluster.watchdog" in _cmdline(pid) for pid in children) and len(children) >= 5
        proc.send_signal(getattr(signal, sig))
        status, err = proc.wait(timeout=60), proc.stderr.read()
        if sig == "SIGTERM":
            assert status == 128 + signal.SIGTERM and "interrupted by SIGTERM" in err, err
            assert "Traceback" not in err, err
        else:
            assert status == -signal.SIGKILL
        deadline = time.time() + 15
        while still_running(children) and time.time() < deadline:
            time.sleep(0.2)
        assert not still_running(children), [_cmdline(pid) for pid in still_running(children)]
        assert (tmp_path / "out.jsonl").read_text() == ""     # nothing had finished; --resume would start over
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_auto_transport_falls_back_where_the_rings_cannot_be_made(tmp_path, capsys):
    """`--pp 2` on one node moves activations over shm rings (`--transport auto`). On a node where they cannot be
    made (here RAYMOE_SHM_DIR names no folder) the job warns, takes the object store, and writes the same lines."""
    import subprocess
    import sys

    from serve_util import ROOT

    reqs = seeded_requests(6)
    expected = run(tmp_path, reqs, "--pp", "2", name="shm")
    assert "transport=shm" in capsys.readouterr().err
    src, out = tmp_path / "fallback.in.jsonl", tmp_path / "fallback.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    env = {**os.environ, "RAYMOE_SHM_DIR": str(tmp_path / "none")}
    env.pop("RAY_ADDRESS", None)        # a cluster of its own, whose actors see the variable
    proc = subprocess.run([sys.executable, "-m", "raymoe.deploy.generate", "--model", "tiny-qwen35moe", "--input", str(src),
                           "--output", str(out), "--pp", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (f"warning: the shm transport cannot start (--transport shm needs {tmp_path / 'none'} (Linux shared "
            f"memory), which this node lacks") in proc.stderr, proc.stderr
    assert "transport=object_store" in proc.stderr and "Traceback" not in proc.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == expected


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


# ---- streaming, --resume, bad paths (issue 16) -------------------------------------------------------


def test_streams_both_ends_through_a_fifo(tmp_path):
    """Reading is lazy and each result is written as it finishes: with the input a named pipe, the
    first results are in the output while the pipe is still open."""
    import threading
    import time

    fifo, out = tmp_path / "in.fifo", tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    reqs = [{"id": i, "prompt": "Hi " * (i + 1), "max_tokens": 3, "temperature": 0} for i in range(6)]
    seen_while_open = []

    def feed():
        with open(fifo, "w") as f:
            for r in reqs[:3]:
                f.write(json.dumps(r) + "\n")
            f.flush()
            deadline = time.time() + 120
            while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
                time.sleep(0.1)
            seen_while_open.append(out.read_text().count("\n") if out.exists() else 0)
            for r in reqs[3:]:
                f.write(json.dumps(r) + "\n")

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        assert generate.main(["--model", "tiny-qwen35moe", "--input", str(fifo), "--output", str(out),
                              "--window", "2"]) == 0
    finally:
        feeder.join()
    assert seen_while_open == [3]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == list(range(6))


def test_window_bounds_lines_in_flight_and_unordered_writes_as_they_finish(tmp_path, monkeypatch):
    from raymoe.cluster.engine import ClusterEngine

    in_flight, most = set(), [0]
    submit_many, wait_finished = ClusterEngine.submit_many, ClusterEngine.wait_finished

    def counting_submit(self, requests, defaults=None):
        out = submit_many(self, requests, defaults)
        in_flight.update(x for x in out if not isinstance(x, dict))
        most[0] = max(most[0], len(in_flight))
        return out

    def counting_wait(self, timeout=1.0):
        out = wait_finished(self, timeout)
        in_flight.difference_update(seq_id for seq_id, _ in out)
        return out

    monkeypatch.setattr(ClusterEngine, "submit_many", counting_submit)
    monkeypatch.setattr(ClusterEngine, "wait_finished", counting_wait)
    long = {"id": "long", "prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    short = [{"id": i, "prompt": "Hi", "max_tokens": 2, "temperature": 0} for i in range(6)]
    unordered = run(tmp_path, [long] + short, "--unordered", "--window", "3", name="unordered")
    assert most[0] == 3
    assert unordered[-1]["id"] == "long"          # written when it finished, after every short one
    most[0] = 0
    ordered = run(tmp_path, [long] + short, "--window", "3", name="ordered")
    assert most[0] <= 3                            # the long line holds the window: finished lines wait
    assert [r["id"] for r in ordered] == ["long"] + list(range(6))
    assert sorted(map(json.dumps, ordered)) == sorted(map(json.dumps, unordered))


def seeded_requests(n):
    return [{"id": f"r{i}", "prompt": "Once upon a time " * (1 + i % 3), "temperature": 0.8, "seed": 100 + i,
             "max_tokens": 6 + 3 * (i % 4)} for i in range(n)]


def test_resume_after_sigkill_equals_an_uninterrupted_run(tmp_path):
    """A job killed (SIGKILL) mid-run, then rerun with --resume: the output is line for line the one an
    uninterrupted run writes."""
    import signal
    import subprocess
    import sys
    import time

    import ray
    from serve_util import ROOT

    reqs = seeded_requests(10)
    reqs.insert(5, {"id": "bad", "prompt_token_ids": [1, 10 ** 9]})
    whole = run(tmp_path, reqs, name="whole")
    src, out = tmp_path / "killed.in.jsonl", tmp_path / "killed.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    # the killed job joins this session's cluster, so that it starts in seconds
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.Popen([sys.executable, "-m", "raymoe.deploy.generate", "--model", "tiny-qwen35moe", "--input", str(src),
                             "--output", str(out), "--window", "2"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not out.exists() or out.read_text().count("\n") < 3:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    written = out.read_text().count("\n")
    assert 3 <= written < len(reqs)
    with open(out, "a") as f:
        f.write('{"id": "r9", "prompt_tok')               # a torn last line, as a kill mid-write leaves
    assert generate.main(["--model", "tiny-qwen35moe", "--input", str(src), "--output", str(out), "--resume"]) == 0
    assert out.read_text() == (tmp_path / "whole.jsonl").read_text()
    assert [r["id"] for r in whole] == [r["id"] for r in reqs]
    # resuming a finished job generates nothing and changes nothing
    assert generate.main(["--model", "tiny-qwen35moe", "--input", str(src), "--output", str(out), "--resume"]) == 0
    assert out.read_text() == (tmp_path / "whole.jsonl").read_text()


def test_ids_missing_repeated_and_bad_paths(tmp_path, capsys):
    reqs = [{"prompt": "Hi", "max_tokens": 2}, {"id": "x", "prompt": "Hi", "max_tokens": 2},
            {"id": 0, "prompt": "Hi", "max_tokens": 2}, {"id": "y", "prompt": "Hi", "max_tokens": 2}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    # line 1 has no id: its index 0 is its id, which line 3 repeats; the job stops there with one line
    assert generate.main(["--model", "tiny-qwen35moe", "--input", str(src), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: line 3 repeats the id 0 of line 1: ids must be unique" in err and "Traceback" not in err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0, "x"]
    (tmp_path / "not-a-result.jsonl").write_text("hello\n")
    for flags, message in [
            (["--input", str(tmp_path / "missing.jsonl")], "missing.jsonl: cannot read input (No such file"),
            (["--output", str(tmp_path / "no" / "dir.jsonl")], "dir.jsonl: cannot write output (No such file"),
            (["--output", str(tmp_path / "not-a-result.jsonl"), "--resume"], "line 1 is not a result line"),
            (["--input", "nosuch://bucket/in.jsonl"], "nosuch://bucket/in.jsonl: cannot read input ("),
            (["--input", str(src), "--output", "nosuch://bucket/out"], "nosuch://bucket/out: cannot write output ("),
            (["--output", str(tmp_path / "folder") + "/", "--resume"], "--resume needs a JSONL file output")]:
        argv = {"--input": str(src), "--output": str(tmp_path / "o.jsonl")}
        argv.update(dict(zip(flags[::2], flags[1::2])))
        extra = [f for f in flags if f == "--resume"]
        assert generate.main(["--model", "tiny-qwen35moe", *[x for kv in argv.items() for x in kv], *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_ray_data_parquet_with_replicas(tmp_path):
    """Through Ray Data: Parquet in, two replicas, a Parquet folder out, equal to the local job's results.
    (tests/deploy/test_ray_job.py runs a JSONL input with two replicas into a JSONL file.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    reqs = seeded_requests(6) + [{"id": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                  "temperature": 0}]
    local = run(tmp_path, reqs, name="local")
    rows = reqs + [{"prompt": "a row without an id"}]
    columns = {key for r in rows for key in r}                   # a field a row lacks is null there
    pq.write_table(pa.Table.from_pylist([{key: r.get(key) for key in columns} for r in rows]), tmp_path / "in.parquet")
    assert generate.main(["--model", "tiny-qwen35moe", "--input", str(tmp_path / "in.parquet"), "--output",
                          str(tmp_path / "out.parquet"), "--replicas", "2", "--window", "2"]) == 0
    got = pq.read_table(tmp_path / "out.parquet").to_pylist()
    by_id = {r["id"]: r for r in got}
    assert len(got) == len(rows) and by_id[None]["error"].startswith("row has no \"id\"")
    for want in local:
        r = by_id[want["id"]]
        assert (r["token_ids"], r["text"], r["finish_reason"]) == (want["token_ids"], want["text"], want["finish_reason"])
        assert r["reasoning_content"] == want.get("reasoning_content")
        assert r["completion_tokens"] == want["usage"]["completion_tokens"] and r["error"] is None
