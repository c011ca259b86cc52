"""cluster/watchdog.py without Ray: a driver that dies while the watchdog scans its process tree (the scan then
misses what was reparented) still has the processes of its last whole scan stopped."""
import os
import signal
import subprocess
import sys

import pytest

from raymoe.cluster import watchdog

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="the watchdog reads /proc")


def test_a_driver_dying_during_a_scan_still_has_what_it_left_stopped(monkeypatch):
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])   # outlives the driver
    scans = []

    def scan(root):
        assert root == driver.pid
        scans.append(root)
        if len(scans) == 1:
            return {agent.pid: watchdog._start_time(agent.pid)}
        driver.kill()           # dies mid-scan: the agent is no longer below it
        driver.wait()
        return {}
    monkeypatch.setattr(watchdog, "descendants", scan)
    monkeypatch.setattr(watchdog, "POLL_S", 0.05)
    try:
        watchdog.watch(driver.pid)
        assert agent.wait(timeout=10) == -signal.SIGTERM     # the watchdog's first signal
        assert len(scans) == 2
    finally:
        for proc in (driver, agent):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
