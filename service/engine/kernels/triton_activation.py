"""Triton ReLU² (the activation of the dense MLP and the MoE shared expert) in one launch.

Same signature and result as `moe.relu2` (`relu(x).square()`, two launches in torch): the square of a bf16/fp16/fp32
value is exact in fp32 before the one rounding to x's dtype, so the output is bit-equal to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.engine.kernels.triton_common import check_dtype, pdl_args, pdl_release, pdl_wait

_BLOCK = 1024


@triton.jit
def _relu2_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    pdl_release(PDL)
    r = tl.where(x < 0.0, 0.0, x)  # keeps NaN, like torch.relu
    tl.store(out_ptr + offs, (r * r).to(out_ptr.dtype.element_ty), mask=m)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """ReLU² (Triton): x [...] contiguous float -> relu(x)**2, same shape and dtype."""
    check_dtype("x", x, (torch.float32, torch.float16, torch.bfloat16))
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got strides {x.stride()} for shape {tuple(x.shape)}")
    out = torch.empty_like(x)
    n = x.numel()
    if n > 0:
        _relu2_kernel[(triton.cdiv(n, _BLOCK),)](x, out, n, BLOCK=_BLOCK, num_warps=4, **pdl_args(x))
    return out
