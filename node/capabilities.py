"""What this machine can do: device, memory, a matmul FLOP/s probe. Bandwidth is measured
against a peer once one is known (see `Membership`)."""

from __future__ import annotations

import os
import platform
import time

import torch


def total_memory_gb(device: str) -> float:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def matmul_tflops(device: str, size: int = 512, seconds: float = 0.2) -> float:
    """Sustained fp32 matmul throughput in TFLOP/s, measured for about `seconds`."""
    dev = torch.device(device)
    a = torch.randn(size, size, device=dev)
    b = torch.randn(size, size, device=dev)
    (a @ b).sum().item()  # warm up
    n, t0 = 0, time.perf_counter()
    while True:
        c = a @ b
        n += 1
        if n % 4 == 0:
            c.sum().item()  # synchronise accelerators
            if time.perf_counter() - t0 >= seconds:
                break
    return 2 * size**3 * n / (time.perf_counter() - t0) / 1e12


def check_device(device: str) -> str | None:
    """None if usable, else a one-line reason."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"unknown device {device!r} (use cpu, cuda, cuda:N or mps)"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"device {device} requested but CUDA is not available on this machine"
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"device {device} does not exist (this machine has {torch.cuda.device_count()} CUDA devices)"
    if dev.type == "mps" and not torch.backends.mps.is_available():
        return "device mps requested but MPS is not available on this machine"
    return None


def measure(device: str) -> dict[str, float | str]:
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else platform.processor() or platform.machine(),
        "cpu_count": float(os.cpu_count() or 1),
        "memory_gb": round(total_memory_gb(device), 2),
        "tflops": round(matmul_tflops(device), 4),
    }
