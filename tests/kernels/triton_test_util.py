"""Shared helpers for the Triton kernel tests."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests.marks import gpu, needs_cuda  # noqa: F401  (re-exported: the kernel tests import them from here)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative-norm tolerances: ||out - ref|| / ||ref||
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(args: list[str], timeout_s: float = 300) -> subprocess.CompletedProcess:
    """`python *args` from the repository root on the Triton CPU interpreter (no GPU visible); fails with the
    output's tails unless it exits 0."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; fails on a shape mismatch or any non-finite output."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values in the kernel output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.0e} ({dtype})"


def moe_inputs(T: int, E: int, k: int, d: int, inter: int, dtype: torch.dtype, seed: int, with_bias: bool = False):
    """(x [T, d], up [E, I, d], down [E, d, I], topk_weights, topk_ids) for the routed-experts ops, routed by the
    torch reference (correction bias ~ 0.1 N(0, 1) when with_bias, else 0)."""
    from service.engine.kernels import moe

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g).to(DEVICE, dtype)
    up = (torch.randn(E, inter, d, generator=g) * d**-0.5).to(DEVICE, dtype)
    down = (torch.randn(E, d, inter, generator=g) * inter**-0.5).to(DEVICE, dtype)
    gate = torch.randn(E, d, generator=g).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEVICE) if with_bias else torch.zeros(E, device=DEVICE)
    weights, ids = moe.moe_route_ref(x, gate, bias, k, 1, 1, True, 2.5)
    return x, up, down, weights, ids


def assert_pdl_chain_bit_equal(chain, refill, replays: int = 5) -> None:
    """chain(pdl) -> a tensor or a tuple of tensors, from inputs that refill() overwrites in place. Captures the
    chain in a CUDA graph with PDL and without, then on every replay with new inputs both graphs and the eager
    chain must agree bit for bit (a PDL kernel reading its input before the kernel before it finished breaks it)."""

    def as_tuple(out):
        return out if isinstance(out, tuple) else (out,)

    outs, graphs = {}, {}
    for pdl in (False, True):
        chain(pdl)  # compile outside the capture
        torch.cuda.synchronize()
        graphs[pdl] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[pdl]):
            outs[pdl] = as_tuple(chain(pdl))
    for replay in range(replays):
        refill()
        for pdl in (False, True):
            graphs[pdl].replay()
        eager = as_tuple(chain(False))
        for a, b, e in zip(outs[True], outs[False], eager, strict=True):
            assert torch.equal(a, b), f"replay {replay}: the PDL chain differs"
            assert torch.equal(a, e), f"replay {replay}: the graph differs from the eager chain"
