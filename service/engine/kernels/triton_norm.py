"""Triton RMSNorm, residual add + RMSNorm, and gated group RMSNorm (the Mamba-2 output norm), fp32 math.

Same signatures and semantics as `norm.rms_norm_ref` / `norm.add_rms_norm_ref` / `norm.gated_group_rms_norm_ref`.
PDL launches on Hopper+ (triton_common): the norm weight is read before the wait, the activations after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.engine.kernels.triton_common import (
    block_dim,
    check_dim,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    pdl_args,
    pdl_release,
    pdl_wait,
)


@triton.jit
def _row_weight(w_ptr, d, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Program row: (row, offs, mask, fp32 norm weight [BLOCK_D]); the weight is read before `pdl_wait`."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    m = offs < d
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    return row, offs, m, w


@triton.jit
def _scale_store(out_ptr, offs, m, w, h, n, eps):
    """out[offs] = w * h / sqrt(mean(h^2) over n + eps), in out's dtype (h fp32, zero where masked)."""
    r = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    tl.store(out_ptr + offs, (w * (h * r)).to(out_ptr.dtype.element_ty), mask=m)


def _warps(block: int) -> int:
    """Warps of a one-row norm program over `block` elements: one per 512, 1 to 8."""
    return min(max(block // 512, 1), 8)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, d, s_x, s_o, eps, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    row, offs, m, w = _row_weight(w_ptr, d, BLOCK_D, PDL)
    x = tl.load(x_ptr + row * s_x + offs, mask=m, other=0.0).to(tl.float32)
    pdl_release(PDL)
    _scale_store(out_ptr + row * s_o, offs, m, w, x, d, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Triton). x [..., d] (unit stride in d), weight [d] -> [..., d] in x's dtype."""
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dim, got shape {tuple(x.shape)}")
    d = x.shape[-1]
    check_shape("weight", weight, (d,))
    check_inner_contiguous("x", x)
    x2 = x.reshape(-1, d)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return out.view(x.shape)
    bd = block_dim(d, 1)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, weight, out, d, x2.stride(0), out.stride(0), eps, BLOCK_D=bd, num_warps=_warps(bd), **pdl_args(x)
    )
    return out.view(x.shape)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, d, s_x, s_r, s_o, s_n, eps, BLOCK_D: tl.constexpr, PDL: tl.constexpr
):
    row, offs, m, w = _row_weight(w_ptr, d, BLOCK_D, PDL)
    x = tl.load(x_ptr + row * s_x + offs, mask=m, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * s_r + offs, mask=m, other=0.0).to(tl.float32)
    pdl_release(PDL)
    h = (res + x).to(new_res_ptr.dtype.element_ty)  # rounded once, like torch's `residual + x`
    tl.store(new_res_ptr + row * s_n + offs, h, mask=m)
    _scale_store(out_ptr + row * s_o, offs, m, w, h.to(tl.float32), d, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm in one launch (Triton), see `norm.add_rms_norm_ref`. x, residual [..., d] (same shape
    and dtype, unit stride in d), weight [d] -> (normed, new_residual), two new tensors in residual's dtype
    (out of place: inputs are not written, so a captured CUDA graph's buffers keep their meaning)."""
    if residual.dim() < 1:
        raise ValueError(f"residual must have at least 1 dim, got shape {tuple(residual.shape)}")
    d = residual.shape[-1]
    check_shape("x", x, tuple(residual.shape))
    check_shape("weight", weight, (d,))
    if x.dtype != residual.dtype:
        raise ValueError(f"x must have residual's dtype {residual.dtype}, got {x.dtype}")
    check_inner_contiguous("x", x)
    check_inner_contiguous("residual", residual)
    check_same_device(x=x, residual=residual, weight=weight)
    x2, r2 = x.reshape(-1, d), residual.reshape(-1, d)
    out = torch.empty(r2.shape, dtype=residual.dtype, device=residual.device)
    new_res = torch.empty_like(out)
    if r2.shape[0] > 0:
        bd = block_dim(d, 1)
        _add_rms_norm_kernel[(r2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            new_res,
            d,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            new_res.stride(0),
            eps,
            BLOCK_D=bd,
            num_warps=_warps(bd),
            **pdl_args(x),
        )
    return out.view(residual.shape), new_res.view(residual.shape)


@triton.jit
def _gated_rms_norm_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr, group_size, s_y, s_z, s_o, eps, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < group_size
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    y = tl.load(y_ptr + row * s_y + offs, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * s_z + offs, mask=m, other=0.0).to(tl.float32)
    pdl_release(PDL)
    _scale_store(out_ptr + row * s_o, offs, m, w, y * z * tl.sigmoid(z), group_size, eps)


def gated_group_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """Gated group RMSNorm (Triton). y, z [T, Di] (unit stride in Di; z may be a strided split),
    weight [Di]: (y * silu(z)) normalised over groups of group_size channels, times weight -> [T, Di] out_dtype."""
    check_dim("y", y, 2)
    T, Di = y.shape
    check_shape("z", z, (T, Di))
    check_shape("weight", weight, (Di,))
    if group_size < 1 or Di % group_size:
        raise ValueError(f"group_size {group_size} must divide Di={Di}")
    check_inner_contiguous("y", y)
    check_inner_contiguous("z", z)
    out = torch.empty(T, Di, dtype=out_dtype, device=y.device)
    if T == 0:
        return out
    bg = block_dim(group_size, 1)
    _gated_rms_norm_kernel[(T, Di // group_size)](
        y,
        z,
        weight,
        out,
        group_size,
        y.stride(0),
        z.stride(0),
        out.stride(0),
        eps,
        BLOCK=bg,
        num_warps=_warps(bg),
        **pdl_args(y),
    )
    return out
