"""Per-hop transport latency, measured between two real actors (for tools.bench).

Two measures, both medians:
- call: what the coordinator sees of one hop, actor calls included. For `object_store`, an actor call
  whose argument is the ObjectRef another actor returned; for `gloo` and `shm`, a send call on one actor
  and a matching receive call on the other, submitted together.
- oneway (gloo and shm only): the transfer alone, inside the actors, half of a ping-pong's round trip. In
  the pipeline the coordinator submits every stage's call at once, so the calls' own cost overlaps the
  previous stages' work and a hop on the critical path costs about this.
"""
from __future__ import annotations

import statistics
import time
import uuid

import ray
import torch

from raymoe.cluster.shm import SHM_DIR, Ring, unlink


@ray.remote(num_cpus=1)
class HopEnd:
    def __init__(self):
        self.group = None
        self.ring_in = self.ring_out = None

    def produce(self, rows: int, cols: int) -> torch.Tensor:
        return torch.ones(rows, cols)

    def consume(self, t: torch.Tensor) -> int:
        return t.shape[0]

    def address(self) -> str:
        import socket
        with socket.socket() as s:
            s.bind(("", 0))
            return f"tcp://{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"

    def join(self, address: str, rank: int):
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2)
        self.group = rank

    def ring_create(self, path: str, slot_bytes: int):
        self.ring_in = Ring.create(path, 4, slot_bytes)

    def ring_attach(self, path: str, slot_bytes: int):
        self.ring_out = Ring.attach(path, 4, slot_bytes)

    def send(self, transport: str, rows: int, cols: int):
        import torch.distributed as dist
        if transport == "shm":
            self.ring_out.send(torch.ones(rows, cols))
        else:
            dist.send(torch.ones(rows, cols), dst=1 - self.group)

    def recv(self, transport: str, rows: int, cols: int) -> int:
        import torch.distributed as dist
        if transport == "shm":
            return self.ring_in.recv().shape[0]
        buf = torch.empty(rows, cols)
        dist.recv(buf, src=1 - self.group)
        return rows

    def pingpong(self, transport: str, first: bool, rows: int, cols: int, n: int) -> list[float]:
        """n round trips of a rows x cols tensor, this end sending first when `first`; the round trips'
        seconds (measured on the first end)."""
        times = []
        for _ in range(n):
            start = time.perf_counter()
            if first:
                self.send(transport, rows, cols)
                self.recv(transport, rows, cols)
            else:
                self.recv(transport, rows, cols)
                self.send(transport, rows, cols)
            times.append(time.perf_counter() - start)
        return times


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure_hops(shapes: dict[str, tuple[int, int]], repeats: int = 30) -> dict:
    """{shape name: {"bytes", "memcpy_ms", "object_store_ms", "gloo_ms", "shm_ms", "gloo_oneway_ms",
    "shm_oneway_ms"}} for float32 activations (module doc)."""
    a, b = HopEnd.remote(), HopEnd.remote()
    address = ray.get(a.address.remote())
    ray.get([a.join.remote(address, 0), b.join.remote(address, 1)])
    slot_bytes = max(rows * cols * 4 for rows, cols in shapes.values())
    paths = [f"{SHM_DIR}/raymoe-hops-{uuid.uuid4().hex[:8]}-{i}" for i in range(2)]
    try:
        ray.get([b.ring_create.remote(paths[0], slot_bytes), a.ring_create.remote(paths[1], slot_bytes)])
        ray.get([a.ring_attach.remote(paths[0], slot_bytes), b.ring_attach.remote(paths[1], slot_bytes)])
    finally:
        for p in paths:
            unlink(p)      # what a failed setup left, when this driver shares the actors' node
    out = {}
    for name, (rows, cols) in shapes.items():
        src = torch.ones(rows, cols)
        h = out[name] = {
            "bytes": src.numel() * 4,
            "memcpy_ms": _median_ms(lambda: src.clone(), repeats),
            "object_store_ms": _median_ms(lambda: ray.get(b.consume.remote(a.produce.remote(rows, cols))), repeats),
        }
        for t in ("gloo", "shm"):
            h[f"{t}_ms"] = _median_ms(lambda: ray.get([a.send.remote(t, rows, cols), b.recv.remote(t, rows, cols)]),
                                      repeats)
            trips, _ = ray.get([a.pingpong.remote(t, True, rows, cols, 1 + 10 * repeats),
                                b.pingpong.remote(t, False, rows, cols, 1 + 10 * repeats)])
            h[f"{t}_oneway_ms"] = 1000 * statistics.median(trips[1:]) / 2
    for actor in (a, b):
        ray.kill(actor)
    return out
