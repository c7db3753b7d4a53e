"""Measured hardware ceilings: device copy bandwidth and bf16 matmul rate (CPU: small stand-ins)."""

from __future__ import annotations

import torch

from specpilot.costmodel.hardware import copy_bandwidth
from specpilot.timing import time_call


def read_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a streaming read (a sum over a large bf16 vector)."""
    x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    sec = time_call(lambda: x.sum(), device, iters=20)
    return nbytes / sec


def matmul_rate(device: torch.device, n: int) -> float:
    """FLOP/s of an n×n×n matmul on random data (bf16 on CUDA, fp32 on the CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sec = time_call(lambda: a @ b, device, iters=10)
    return 2 * n**3 / sec


def measure(device: torch.device, tiny: bool) -> dict[str, float]:
    size = 1 << 22 if tiny else 4 << 30
    return {
        "copy_bandwidth_Bps": copy_bandwidth(device, size),
        "read_bandwidth_Bps": read_bandwidth(device, size),
        "matmul_flops": matmul_rate(device, 256 if tiny else 8192),
    }
