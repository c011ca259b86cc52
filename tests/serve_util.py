"""Helpers of the serving tests: free ports, a `python -m raymoe.deploy.serve` subprocess, its process tree."""
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

BIN = os.path.dirname(sys.executable)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_ports(n: int) -> list[int]:
    """n distinct free ports: every socket stays bound until all are chosen (ports taken one at a time
    can repeat, and Ray refuses two components on one port)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get_text(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def post_raw(url: str, data: bytes, timeout: float = 30) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_idle(base: str, timeout: float = 30) -> dict:
    """Poll /health until the engine holds no sequence; returns the last health body."""
    deadline = time.time() + timeout
    while True:
        status, body = get_json(base + "/health")
        if status == 200 and body["sequences"] == 0 and body["running"] == 0:
            return body
        if time.time() > deadline:
            raise AssertionError(f"sequences still held after {timeout}s: {body}")
        time.sleep(0.1)


def _parents() -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    out[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> dict[int, int]:
    """{pid: start time} of every process below pid (Ray's gcs, raylet, workers, ...)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out, stack = {}, [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out[child] = start_time(child)
            stack.append(child)
    return out


def cmdline(pid: int) -> bytes:
    """A process's command line, its arguments separated by NUL (b"" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def still_running(processes: dict[int, int]) -> list[int]:
    """Those of `processes` that still exist (same pid and start time)."""
    return [pid for pid, started in processes.items() if started is not None and start_time(pid) == started]


class ServerProcess:
    """`python -m raymoe.deploy.serve` in its own session, with its own local Ray cluster."""

    def __init__(self, log_path, *flags, model="tiny-qwen35moe"):
        self.port, self.grpc_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ}
        env.pop("RAY_ADDRESS", None)
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "raymoe.deploy.serve", "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
             "--grpc-port", str(self.grpc_port), *flags],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 240):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"deploy.serve exited with {self.proc.returncode}: {self.tail()}")
            try:
                status, _ = get_json(self.base + "/health", timeout=2)
                if status == 200:
                    return
            except (OSError, ValueError, http.client.HTTPException):
                pass    # not listening yet (another process, such as a Ray server, may hold the port until then)
            time.sleep(1)
        raise AssertionError(f"deploy.serve did not become healthy in {timeout}s: {self.tail()}")

    def wait_for_line(self, text: str, timeout: float = 60) -> str:
        """The log once it holds `text` (the start-up line comes after /health answers, once serve.run
        returns), or as it is at the timeout."""
        deadline = time.time() + timeout
        while text not in self.tail() and time.time() < deadline:
            time.sleep(0.5)
        return self.tail()

    def tail(self, n: int = 3000) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def stop(self, sig=signal.SIGTERM, timeout: float = 90) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.log.flush()

    def kill(self):
        """Last resort (a failed test): the whole session, whatever is left of it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self.log.close()


@contextlib.contextmanager
def running_server(log, *flags: str, model: str = "tiny-qwen35moe"):
    """A `raymoe.deploy.serve` process, ready; killed (with its tree) on leaving."""
    proc = ServerProcess(log, *flags, model=model)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@contextlib.contextmanager
def serve_apps(apps: dict[str, dict]):
    """Serve apps in this process's Ray cluster, one per route prefix (prefix -> app_builder's arguments), with
    HTTP on a free localhost port; yields its base URL; Serve is shut down on leaving."""
    from ray import serve

    from raymoe.deploy.serve import app_builder
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        for prefix, args in apps.items():
            serve.run(app_builder(args), name="app" + prefix.replace("/", "-"), route_prefix=prefix)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
