"""Two real Ray nodes on this machine (`ray start --head`, then `ray start --address`), a PP=2 pipeline
placed with one stage per node (--placement spread), with the object_store and gloo transports: the outputs
equal one node's; shm, which needs one node, is refused. A node lost mid-job (its raylet killed): the stage
moves to the other node, or the job fails with one line and --resume finishes it. Each node is a
`ray start --block` in its own process group, stopped by its process id."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from serve_util import ROOT, cmdline, descendants
from serve_util import BIN, free_ports

from raymoe.deploy import generate

pytestmark = pytest.mark.cluster

REQUESTS = [{"id": "greedy", "prompt": "Hello there", "max_tokens": 8, "temperature": 0},
            {"id": "seeded", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.9, "seed": 7},
            {"id": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}]


LINES = 600        # a batch job of the lost-node test
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
    """(address, env, nodes, add_worker): a head and a worker node, each of 2 CPUs; add_worker() joins another."""
    # the GCS declares a silent node dead after ~2 s (Ray's defaults: ~15 s), so a lost node costs the test less
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
           "RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
           "RAY_health_check_failure_threshold": "3"}
    env.pop("RAY_ADDRESS", None)
    port, client, *head_ports = free_ports(2 + len(PORT_FLAGS))     # all distinct
    address = f"127.0.0.1:{port}"
    temp_dir = tempfile.mkdtemp(prefix="raymoe-2n-")      # short: Ray's socket paths must fit 107 bytes
    nodes = []

    def start(name: str, args: list[str], ports: list[int]):
        log_path = tmp_path / f"{name}.log"
        with open(log_path, "w") as log:
            nodes.append(start_node(args, ports, log, env))
        wait_started(nodes[-1], log_path)

    def add_worker():
        start(f"worker{len(nodes)}", [f"--address={address}", '--resources={"node_b": 1}'],
              free_ports(len(PORT_FLAGS)))

    try:
        start("head", ["--head", f"--port={port}", "--include-dashboard=false", f"--ray-client-server-port={client}",
                       f"--temp-dir={temp_dir}", '--resources={"node_a": 1}'], head_ports)
        add_worker()
        yield address, env, nodes, add_worker
    finally:
        for proc in reversed(nodes):
            stop_node(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def stage_processes(node: subprocess.Popen) -> int:
    """Stage actors running under this node's raylet (its `ray start --block` process tree)."""
    return sum(b"ray::StageActor" in cmdline(pid) for pid in descendants(node.pid))


def test_pp2_spread_over_two_nodes_equals_one_node(two_nodes, tmp_path, capsys):
    address, env, nodes, _ = two_nodes
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    one_node = tmp_path / "one-node.jsonl"
    assert generate.main(["--model", "tiny-qwen35moe", "--pp", "2", "--input", str(src), "--output",
                          str(one_node)]) == 0          # this session's single-node cluster
    assert "pp=2 ep=0 nodes=1 " in capsys.readouterr().err
    for transport in ("object_store", "gloo"):
        out = tmp_path / f"{transport}.jsonl"
        # the summary line counts the nodes the stage actors ran on (each asks Ray for its node's id); a job of
        # three requests lasts ~2 s, too short to find its stage processes under each node reliably
        job = subprocess.run([sys.executable, "-m", "raymoe.deploy.generate", "--model", "tiny-qwen35moe", "--pp", "2",
                              "--placement", "spread", "--transport", transport, "--input", str(src),
                              "--output", str(out)], cwd=ROOT, env={**env, "RAY_ADDRESS": address},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
        assert job.returncode == 0, job.stderr[-3000:]
        assert f"pp=2 ep=0 nodes=2 transport={transport}" in job.stderr, job.stderr[-3000:]
        assert out.read_text() == one_node.read_text(), transport
    # shared memory cannot cross nodes: a spread pipeline over shm is refused with one line naming the fix
    job = subprocess.run([sys.executable, "-m", "raymoe.deploy.generate", "--model", "tiny-qwen35moe", "--pp", "2",
                          "--placement", "spread", "--transport", "shm", "--input", str(src),
                          "--output", str(tmp_path / "shm.jsonl")], cwd=ROOT, env={**env, "RAY_ADDRESS": address},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert job.returncode == 2
    assert ("error: --transport shm needs every stage on one node, and Ray placed the 2 stages on 2 nodes: use "
            "--transport gloo across nodes") in job.stderr, job.stderr[-3000:]


def raylet(node: subprocess.Popen) -> int:
    pid, = [p for p in descendants(node.pid) if cmdline(p).split(b"\0")[0].endswith(b"/raylet")]
    return pid


def lines_in(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.slow
def test_a_lost_node_moves_its_stage_or_fails_the_job_and_resume_finishes_it(two_nodes, tmp_path):
    """A node that holds a stage stops mid-job (its raylet SIGKILLed). With room on the other node Ray places the
    stage's bundle there again, the stage restarts and the output is the uninterrupted one; with no room the job
    fails with one line after --placement-timeout, and once a node joins, --resume finishes it to the same output."""
    from batch_cases import batch_lines

    address, env, nodes, add_worker = two_nodes
    src = tmp_path / "in.jsonl"
    # enough lines that a job outlasts the time its lost node's stages take to die (200 could finish before)
    src.write_text("".join(json.dumps(line) + "\n" for line in batch_lines(LINES)))
    reference = tmp_path / "reference.jsonl"
    assert generate.main(["--model", "tiny-qwen35moe", "--pp", "2", "--input", str(src), "--output",
                          str(reference)]) == 0          # this session's single-node cluster

    def job(out, pp: int, *flags):
        return subprocess.Popen([sys.executable, "-m", "raymoe.deploy.generate", "--model", "tiny-qwen35moe", "--pp", str(pp),
                                 "--placement", "spread", "--input", str(src), "--output", str(out), *flags],
                                cwd=ROOT, env={**env, "RAY_ADDRESS": address}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)

    def kill_worker_mid_job(proc, out, worker, pp: int) -> list[int]:
        """SIGKILL the worker node's raylet once the job has written 20 lines; the most stage actors seen
        under each node after that, until the job ends."""
        deadline = time.time() + 300
        while lines_in(out) < 20 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and stage_processes(worker) >= 1, "the job ended, or had no stage there"
        os.kill(raylet(worker), signal.SIGKILL)
        killed, written = time.time(), lines_in(out)
        most = [0] * len(nodes)
        while proc.poll() is None and time.time() < deadline:
            most = [max(m, stage_processes(node)) for m, node in zip(most, nodes)]
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
        print(f"--pp {pp}: worker node lost at line {written}; the job ended {time.time() - killed:.1f} s later")
        assert written < LINES
        return most

    # room on the head (2 CPUs, one stage): the lost stage is placed there again; nothing changes
    out = tmp_path / "moved.jsonl"
    proc = job(out, 2)
    most = kill_worker_mid_job(proc, out, nodes[1], 2)
    assert proc.wait() == 0, proc.stderr.read()[-3000:]
    assert most[0] == 2, most                     # both stages on the head
    assert out.read_bytes() == reference.read_bytes()

    # no room: three stages over a head of 2 CPUs and a new worker of 2; the worker's stages have nowhere to go
    add_worker()
    out = tmp_path / "resumed.jsonl"
    proc = job(out, 3, "--placement-timeout", "10")
    kill_worker_mid_job(proc, out, nodes[2], 3)
    assert proc.wait() == 2
    err = proc.stderr.read().strip().splitlines()
    assert err[-1].startswith("error: ") and "no room for the pipeline's 3 actors" in err[-1], err[-5:]
    assert not any("Traceback" in line for line in err), err[-20:]
    assert lines_in(out) < LINES
    add_worker()
    proc = job(out, 3, "--resume")
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    assert out.read_bytes() == reference.read_bytes()
