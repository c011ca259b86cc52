"""A real `ray start --head` cluster and a real `ray job submit` of the batch job (README's recipe:
two PP=2 pipelines fed by Ray Data)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from serve_util import BIN, free_ports

pytestmark = pytest.mark.cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def head_node(tmp_path):
    """`ray start --head --block` in its own process group; killing the group stops that cluster only."""
    # every port of its own: the suite's local cluster holds Ray's default ones
    names = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
             "metrics-export-port", "node-manager-port", "object-manager-port", "ray-client-server-port")
    port, dash, *ports = free_ports(2 + len(names))
    own_ports = [f"--{name}={p}" for name, p in zip(names, ports)]
    log = open(tmp_path / "head.log", "w")
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([os.path.join(BIN, "ray"), "start", "--head", "--block", f"--port={port}",
                             f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--num-cpus=6",
                             "--disable-usage-stats", *own_ports],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", dash), timeout=1).close()
            break
        except OSError:
            time.sleep(1)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
        pytest.fail("the Ray head node did not come up: " + (tmp_path / "head.log").read_text()[-2000:])
    yield address, env
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)      # anything of that cluster still running
    except ProcessLookupError:
        pass


def test_ray_job_submit_batch_generation(head_node, tmp_path):
    address, env = head_node
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "prompt": "Hello there", "max_tokens": 6, "temperature": 0},
        {"id": "b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0},
        {"id": "c", "prompt_token_ids": [1, 10 ** 9]}]))
    runtime_env = {"excludes": [".venv", ".git", "out"], "env_vars": {"RAYMOE_CACHE": os.environ["RAYMOE_CACHE"]}}
    cmd = [os.path.join(BIN, "ray"), "job", "submit", "--address", address, "--working-dir", ".",
           "--runtime-env-json", json.dumps(runtime_env), "--",
           sys.executable, "-m", "raymoe.deploy.generate", "--model", "tiny-qwen35moe", "--pp", "2", "--replicas", "2",
           "--input", str(src), "--output", str(out)]
    # token authentication is on for the job server: the CLI reads ~/.ray/auth_token (docs/model-formats.md §6)
    for _ in range(30):       # the job agent starts a little after the dashboard answers
        proc = subprocess.run(cmd, cwd=ROOT, env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True,
                              text=True, timeout=600)
        if "No available agent" not in proc.stderr + proc.stdout:
            break
        time.sleep(2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "succeeded" in proc.stdout + proc.stderr
    assert "2 replica(s), pp=2" in proc.stdout + proc.stderr      # two pipelines fed by one Ray Data stream
    assert "transport=shm" in proc.stdout + proc.stderr           # what `auto` picked for stages on one node
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in results] == ["a", "b", "c"]
    assert len(results[0]["token_ids"]) == 6 and len(results[1]["token_ids"]) == 4
    assert "outside the vocabulary" in results[2]["error"]
    # the cluster's answer equals the in-process pipeline's
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.files.loader import open_model
    from raymoe.stages.text.sampling_params import SamplingParams
    engine = LocalEngine(open_model("tiny-qwen35moe"))
    seq = engine.add_request("a", results[0]["prompt_token_ids"], SamplingParams(max_tokens=6, temperature=0))
    engine.run_until_done()
    assert seq.output_ids == results[0]["token_ids"]
