"""Reference of the single-row GEMV (`triton_gemv.gemv`): torch's F.linear; the loaded weight layout of the linears."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: torch's F.linear."""
    return F.linear(x, weight, bias)


def linear_weight_layout_ref(weight: torch.Tensor) -> torch.Tensor:
    """A linear's weight [out, in] in the loaded layout, row-major (the same tensor when it is; a bundle whose
    linears read another memory layout faster returns the same values in that layout)."""
    return weight.contiguous()
