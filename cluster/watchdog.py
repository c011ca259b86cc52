"""Stops a local Ray cluster whose driver died without stopping it (SIGKILL, the OOM killer).

    python -m raymoe.cluster.watchdog DRIVER_PID

connect_ray starts this beside a local cluster it starts. Ray's gcs_server and raylet end with
their parent, and the workers with the raylet, but the raylet's agents (DashboardAgent,
RuntimeEnvAgent) outlive them all. So every second this notes the driver's descendants (pid and
start time), keeping a note only if the driver still ran once it was taken; once the driver is
gone, it sends SIGTERM, then after a grace SIGKILL, to those of them still running, and exits. A
driver that exits normally stops the watchdog at exit.
Linux only (it reads /proc); elsewhere it exits at once.
"""
from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 1.0
GRACE_S = 3.0


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, ...), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    """None once pid is gone or a zombie: a dead driver's children are already reparented while it waits to be
    reaped, so a scan of its tree then would miss them."""
    fields = _stat(pid)
    return fields[19] if fields and fields[0] != "Z" else None


def descendants(root: int) -> dict[int, str]:
    """{pid: start time} of every living process below root."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat(int(name))
            if fields and fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(name))
    out, stack = {}, [root]
    while stack:
        for child in children.get(stack.pop(), []):
            started = _start_time(child)
            if started is not None:
                out[child] = started
                stack.append(child)
    return out


def alive(processes: dict[int, str]) -> list[int]:
    """Those of processes that still run (same pid and start time: not a reused pid)."""
    out = []
    for pid, started in processes.items():
        fields = _stat(pid)
        if fields and fields[0] != "Z" and fields[19] == started:
            out.append(pid)
    return out


def _signal(pids: list[int], sig: int):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def watch(driver: int):
    started = _start_time(driver)
    me = os.getpid()
    known: dict[int, str] = {}
    while started is not None:
        snapshot = {pid: t for pid, t in descendants(driver).items() if pid != me}
        if _start_time(driver) != started:
            break       # it died during the scan, whose tree may then lack what was reparented: keep the last
        known = snapshot
        time.sleep(POLL_S)
    left = alive(known)
    if not left:
        return
    print(f"raymoe watchdog: driver {driver} is gone; stopping the {len(left)} Ray processes it left",
          file=sys.stderr, flush=True)
    _signal(left, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while alive(known) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal(alive(known), signal.SIGKILL)


def start():
    """Start the watchdog of this process, in a session of its own so that a terminal's Ctrl-C or
    hang-up reaches the driver, which stops its cluster itself, and not it. A driver that exits
    normally (it has stopped its cluster) stops the watchdog on its way out."""
    import atexit
    import subprocess
    if not os.path.isdir("/proc/self"):
        return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-m", "raymoe.cluster.watchdog", str(os.getpid())], cwd=root,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    atexit.register(_stop, proc)
    return proc


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except Exception:
        pass


if __name__ == "__main__":
    if os.path.isdir("/proc/self"):
        watch(int(sys.argv[1]))
