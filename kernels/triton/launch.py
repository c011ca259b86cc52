"""What every wrapper checks before launching a kernel: one device that Triton can run on."""
from __future__ import annotations

import os

import torch


def check_device(*tensors: torch.Tensor) -> None:
    """CUDA tensors, or CPU tensors with Triton's interpreter on; all on one device."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 (set before importing triton) "
                         "to run on CPU tensors")


def power_of_two(n: int, name: str) -> None:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"{name} must be a power of two, got {n}")
