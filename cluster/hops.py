"""Per-hop transport latency, measured between two real actors (for deploy.bench).

A hop is what one stage-to-stage transfer costs in the pipeline: for `object_store`, an
actor call whose argument is the ObjectRef another actor returned; for `gloo`, a
torch.distributed send on one actor matched by a recv on the other.
"""
from __future__ import annotations

import statistics
import time

import ray
import torch


@ray.remote(num_cpus=1)
class HopEnd:
    def __init__(self):
        self.group = None

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

    def send(self, rows: int, cols: int):
        import torch.distributed as dist
        dist.send(torch.ones(rows, cols), dst=1)

    def recv(self, rows: int, cols: int) -> int:
        import torch.distributed as dist
        buf = torch.empty(rows, cols)
        dist.recv(buf, src=0)
        return rows


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure_hops(shapes: dict[str, tuple[int, int]], repeats: int = 30) -> dict:
    """{shape name: {"bytes", "memcpy_ms", "object_store_ms", "gloo_ms"}} for float32 activations."""
    a, b = HopEnd.remote(), HopEnd.remote()
    address = ray.get(a.address.remote())
    ray.get([a.join.remote(address, 0), b.join.remote(address, 1)])
    out = {}
    for name, (rows, cols) in shapes.items():
        src = torch.ones(rows, cols)
        out[name] = {
            "bytes": src.numel() * 4,
            "memcpy_ms": _median_ms(lambda: src.clone(), repeats),
            "object_store_ms": _median_ms(lambda: ray.get(b.consume.remote(a.produce.remote(rows, cols))), repeats),
            "gloo_ms": _median_ms(lambda: ray.get([a.send.remote(rows, cols), b.recv.remote(rows, cols)]), repeats),
        }
    for actor in (a, b):
        ray.kill(actor)
    return out
