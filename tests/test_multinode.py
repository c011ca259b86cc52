"""Two real Ray nodes on this machine (`ray start --head`, then `ray start --address`), a PP=2 pipeline
placed with one stage per node (--placement spread), with the object_store and gloo transports: the outputs
equal one node's; shm, which needs one node, is refused. Each node is a `ray start --block` in its own
process group, stopped by its process id."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from serve_util import ROOT, descendants
from test_ray_job import BIN, free_ports

from deploy import generate

pytestmark = pytest.mark.cluster

REQUESTS = [{"id": "greedy", "prompt": "Hello there", "max_tokens": 8, "temperature": 0},
            {"id": "seeded", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.9, "seed": 7},
            {"id": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}]


# every port of its own: other clusters on this machine hold Ray's default ones
PORT_FLAGS = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
              "metrics-export-port", "node-manager-port", "object-manager-port")


def start_node(args: list[str], ports: list[int], log, env) -> subprocess.Popen:
    own_ports = [f"--{name}={p}" for name, p in zip(PORT_FLAGS, ports)]
    return subprocess.Popen([os.path.join(BIN, "ray"), "start", "--block", "--num-cpus=2",
                             "--object-store-memory=200000000", "--disable-usage-stats", *own_ports, *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_node(proc: subprocess.Popen):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def wait_started(proc: subprocess.Popen, log_path):
    """`ray start` logs this line once its node has joined the cluster."""
    deadline = time.time() + 180
    while "Ray runtime started." not in log_path.read_text():
        assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.5)


@pytest.fixture
def two_nodes(tmp_path):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    port, client, *node_ports = free_ports(2 + 2 * len(PORT_FLAGS))     # all distinct
    address = f"127.0.0.1:{port}"
    temp_dir = tempfile.mkdtemp(prefix="raymoe-2n-")      # short: Ray's socket paths must fit 107 bytes
    nodes = []
    try:
        for name, args in [("head", ["--head", f"--port={port}", "--include-dashboard=false",
                                     f"--ray-client-server-port={client}", f"--temp-dir={temp_dir}",
                                     '--resources={"node_a": 1}']),
                           ("worker", [f"--address={address}", '--resources={"node_b": 1}'])]:
            log_path = tmp_path / f"{name}.log"
            with open(log_path, "w") as log:
                ports = node_ports[:len(PORT_FLAGS)] if name == "head" else node_ports[len(PORT_FLAGS):]
                nodes.append(start_node(args, ports, log, env))
            wait_started(nodes[-1], log_path)
        yield address, env, nodes
    finally:
        for proc in reversed(nodes):
            stop_node(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def stage_processes(node: subprocess.Popen) -> int:
    """Stage actors running under this node's raylet (its `ray start --block` process tree)."""
    return sum(b"ray::StageActor" in cmdline(pid) for pid in descendants(node.pid))


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_pp2_spread_over_two_nodes_equals_one_node(two_nodes, tmp_path):
    address, env, nodes = two_nodes
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    one_node = tmp_path / "one-node.jsonl"
    assert generate.main(["--model", "tiny-qwen35moe", "--pp", "2", "--input", str(src), "--output",
                          str(one_node)]) == 0          # this session's single-node cluster
    for transport in ("object_store", "gloo"):
        out = tmp_path / f"{transport}.jsonl"
        deadline = time.time() + 60           # the previous job's stage processes have exited
        while any(stage_processes(node) for node in nodes) and time.time() < deadline:
            time.sleep(0.5)
        job = subprocess.Popen([sys.executable, "-m", "deploy.generate", "--model", "tiny-qwen35moe", "--pp", "2",
                                "--placement", "spread", "--transport", transport, "--input", str(src),
                                "--output", str(out)], cwd=ROOT, env={**env, "RAY_ADDRESS": address},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        most = [0, 0]                  # the most stage actors seen at once under each node
        deadline = time.time() + 300
        while job.poll() is None and time.time() < deadline:
            most = [max(m, stage_processes(node)) for m, node in zip(most, nodes)]
            time.sleep(0.2)
        if job.poll() is None:
            job.kill()
        assert job.wait() == 0, job.stderr.read()[-3000:]
        assert most == [1, 1], f"{transport}: stage actors per node {most}"
        assert out.read_text() == one_node.read_text(), transport
    # shared memory cannot cross nodes: a spread pipeline over shm is refused with one line naming the fix
    job = subprocess.run([sys.executable, "-m", "deploy.generate", "--model", "tiny-qwen35moe", "--pp", "2",
                          "--placement", "spread", "--transport", "shm", "--input", str(src),
                          "--output", str(tmp_path / "shm.jsonl")], cwd=ROOT, env={**env, "RAY_ADDRESS": address},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert job.returncode == 2
    assert ("error: --transport shm needs every stage on one node, and Ray placed the 2 stages on 2 nodes: use "
            "--transport gloo across nodes") in job.stderr, job.stderr[-3000:]
