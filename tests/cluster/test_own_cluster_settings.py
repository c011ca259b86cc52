"""The Ray settings of the local cluster that connect_ray starts reach every process of it (the GCS included), and a
value the user set wins. What they are for (gcs_server's memory staying flat) is a soak's to measure
(tools/soak.py fails on a Ray daemon's growth; docs/ray-step.md)."""
import os
import subprocess
import sys

import pytest

from raymoe.cluster.engine import OWN_CLUSTER_SETTINGS

pytestmark = pytest.mark.cluster

SCRIPT = """
import os, ray
from raymoe.cluster.engine import connect_ray, disconnect_ray
connect_ray(1)
ray.get(ray.remote(lambda: 1).remote())
for pid in os.listdir("/proc"):       # the GCS this driver started: its child
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
        parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        continue
    if b"gcs_server" in cmd.split(b"\\0")[0] and parent == os.getpid():
        print("GCS", [e.decode() for e in env if e.startswith(b"RAY_task_events")])
disconnect_ray()
"""


def run(**settings) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", *OWN_CLUSTER_SETTINGS)}
    env.update(settings)
    out = subprocess.run([sys.executable, "-P", "-c", SCRIPT], capture_output=True, text=True, timeout=180, env=env,
                         cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if line.startswith("GCS")][-1]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the GCS's environment from /proc")
def test_task_events_are_off_in_the_cluster_connect_ray_starts_unless_the_user_set_them():
    assert run() == "GCS ['RAY_task_events_report_interval_ms=0']"
    assert run(RAY_task_events_report_interval_ms="1000") == "GCS ['RAY_task_events_report_interval_ms=1000']"
