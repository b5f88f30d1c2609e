"""Measured GPU ceilings shared by the benchmarks: device copy bandwidth (read + write), read-only bandwidth, and a
bf16 matmul. Each is a triton.testing.do_bench median over 1 GiB buffers (far above L2), so every benchmark divides
by the same numbers."""

from __future__ import annotations

import torch
import triton.testing

GIB_BF16 = 2**29  # bf16 elements in 1 GiB


def copy_gbs(device: str = "cuda") -> float:
    """Device-to-device copy of 1 GiB, GB/s counting the read and the write."""
    a = torch.randn(GIB_BF16, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() * 2 / ms / 1e6


def read_gbs(device: str = "cuda") -> float:
    """Read-only stream of 1 GiB (a sum into one scalar), GB/s."""
    a = torch.randn(GIB_BF16, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a.sum(dtype=torch.float32), warmup=50, rep=300, return_mode="median")
    return a.numel() * 2 / ms / 1e6


def matmul_tflops(device: str = "cuda") -> float:
    """8192^3 bf16 matmul on random data, TFLOP/s."""
    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: x @ y, warmup=50, rep=300, return_mode="median")
    return 2 * 8192**3 / ms / 1e9
