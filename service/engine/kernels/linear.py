"""Reference of the single-row GEMV (`triton_gemv.gemv`): torch's F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: torch's F.linear."""
    return F.linear(x, weight, bias)
