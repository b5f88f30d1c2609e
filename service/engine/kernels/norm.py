"""RMSNorm, residual add + RMSNorm, and gated group RMSNorm (mamba output norm). Pure torch reference, fp32 math."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] -> weight * x / rms(x), computed in fp32, returned in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with the next RMSNorm. x, residual [..., d] -> (normed, new_residual), both in residual's
    dtype: new_residual = residual + x added in fp32 and rounded once (bit-equal to torch's `residual + x` when the
    dtypes agree), normed = rms_norm_ref(new_residual). Out of place: neither input is written."""
    new_residual = (residual.float() + x.float()).to(residual.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


def gated_group_rms_norm_ref(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """y, z [T, Di]: (y * silu(z)) normalised over groups of group_size channels, times weight."""
    h = y.float() * F.silu(z.float())
    T, Di = h.shape
    g = h.view(T, Di // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * g.view(T, Di)).to(out_dtype)


def add_rms_norm_linear_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm + linear (a Mamba layer's norm and in_proj): x, residual [..., K], weight [N, K]
    -> (y [..., N], new_residual [..., K]) = (F.linear(normed, weight, bias), new_residual) of `add_rms_norm_ref`."""
    normed, new_residual = add_rms_norm_ref(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), new_residual


def gated_norm_linear_ref(
    y: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    group_size: int,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated group RMSNorm + linear (the Mamba-2 output norm and out_proj): y, z [T, Di], weight [N, Di] -> [T, N];
    the normed activation is rounded to weight's dtype before the linear."""
    return F.linear(gated_group_rms_norm_ref(y, z, norm_weight, group_size, eps, weight.dtype), weight, bias)
