"""Shared helpers for the Triton kernel tests."""
from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative-norm tolerances: ||out - ref|| / ||ref||
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; fails on a shape mismatch or any non-finite output."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values in the kernel output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.0e} ({dtype})"
