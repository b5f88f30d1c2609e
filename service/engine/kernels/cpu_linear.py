"""Weight layout of the linears for the `torch` bundle (tuned on CPU). Same contract as
`linear.linear_weight_layout_ref` (same shape and values; every op, F.linear included, takes either layout).

On the CPU a linear's weight [out, in] is stored as its transpose ([in, out] row-major) and handed on as the
[out, in] transposed view: `F.linear(x, weight)` then multiplies x by a row-major [in, out] operand, which the CPU
GEMM runs faster than the transposed operand of the loaded layout at decode batches and no slower at prefill sizes
(one core, fp32: [16, 256] x 2048 outputs 0.24 -> 0.17 ms, x 776 0.076 -> 0.052 ms; [8192, 256] x 776 28 -> 22 ms,
x 256 and x 2048 equal).
"""

from __future__ import annotations

import torch


def linear_weight_layout(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same values stored as [in, out] row-major, returned as its [out, in] transposed view
    (fp32 on the CPU, where it was measured; other dtypes and devices as loaded)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return weight
    return weight.t().contiguous().t()
