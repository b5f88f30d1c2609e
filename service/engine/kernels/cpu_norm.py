"""Fast pure-torch norms (and the norms fused with the next linear) for the `torch` bundle (tuned on CPU). Same
contracts as `norm.rms_norm_ref`, `norm.add_rms_norm_ref`, `norm.add_rms_norm_linear_ref` and
`norm.gated_norm_linear_ref` (the oracles the tests compare against).

The references run each elementwise step over the whole [T, d] input, so at prefill sizes (8192 x 256 fp32: 8 MiB)
every temporary is written to and read back from memory. Here the rows run in blocks of `NORM_BLOCK_ROWS` (each
block the reference's own math, so the norms are bit-equal to it), the block's temporaries stay in the core's L2
cache, and the fused ops run the block's linear on it while it is there, into one preallocated output. Inputs of at
most one block (decode batches) in fp32 on the CPU take `F.rms_norm` (one op instead of the reference's six; equal
to it in the tests, bit for bit): about 10 us less per norm at [16, 256]. Other dtypes and devices take the
reference itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.engine.kernels.norm import add_rms_norm_ref, gated_group_rms_norm_ref, gated_norm_linear_ref, rms_norm_ref

NORM_BLOCK_ROWS = 256  # rows per block: a [256, 256] fp32 temporary is 256 KiB, a few of them fit in L2


def _blocks(x: torch.Tensor) -> list[tuple[int, int]] | None:
    """Row ranges [r0, r1) of x [T, d] when blocking applies (CPU, more than one block), else None."""
    T = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or T <= NORM_BLOCK_ROWS:
        return None
    return [(r0, min(T, r0 + NORM_BLOCK_ROWS)) for r0 in range(0, T, NORM_BLOCK_ROWS)]


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out [m, N] = F.linear(x [m, K], weight [N, K], bias) (x already in weight's dtype)."""
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def _small_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`norm.rms_norm_ref` of an input of at most one block: `F.rms_norm` for fp32 on the CPU, else the reference."""
    if x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`norm.rms_norm_ref`: x [T, d] -> [T, d] in x's dtype."""
    blocks = _blocks(x)
    if blocks is None:
        return _small_rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    for r0, r1 in blocks:
        out[r0:r1] = rms_norm_ref(x[r0:r1], weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm.add_rms_norm_ref`: x, residual [T, d] -> (normed, new_residual) in residual's dtype."""
    blocks = _blocks(x)
    if blocks is None:
        if x.dtype != residual.dtype:
            return add_rms_norm_ref(x, residual, weight, eps)
        new_residual = residual + x  # the reference's fp32 add rounded once: the same bits when the dtypes agree
        return _small_rms_norm(new_residual, weight, eps), new_residual
    normed = torch.empty_like(residual)
    new_residual = torch.empty_like(residual)
    for r0, r1 in blocks:
        normed[r0:r1], new_residual[r0:r1] = add_rms_norm_ref(x[r0:r1], residual[r0:r1], weight, eps)
    return normed, new_residual


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm.add_rms_norm_linear_ref`: x, residual [T, K], weight [N, K] -> (y [T, N], new_residual [T, K])."""
    blocks = _blocks(x)
    if blocks is None or weight.dtype != residual.dtype:
        normed, new_residual = add_rms_norm(x, residual, norm_weight, eps)
        return F.linear(normed, weight, bias), new_residual
    y = torch.empty(x.shape[0], weight.shape[0], dtype=weight.dtype, device=x.device)
    new_residual = torch.empty_like(residual)
    for r0, r1 in blocks:
        normed, new_residual[r0:r1] = add_rms_norm_ref(x[r0:r1], residual[r0:r1], norm_weight, eps)
        _linear_into(y[r0:r1], normed, weight, bias)
    return y, new_residual


def gated_norm_linear(
    y: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    group_size: int,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`norm.gated_norm_linear_ref`: y, z [T, Di], weight [N, Di] -> [T, N] in weight's dtype."""
    blocks = _blocks(y)
    if blocks is None:
        return gated_norm_linear_ref(y, z, norm_weight, group_size, eps, weight, bias)
    out = torch.empty(y.shape[0], weight.shape[0], dtype=weight.dtype, device=y.device)
    for r0, r1 in blocks:
        normed = gated_group_rms_norm_ref(y[r0:r1], z[r0:r1], norm_weight, group_size, eps, weight.dtype)
        _linear_into(out[r0:r1], normed, weight, bias)
    return out
