"""Projections through the kernel bundle (the weights stay `nn.Linear` modules so checkpoints load by name)."""
from __future__ import annotations

import torch
from torch import nn

from service.engine.kernels import Kernels


def project(k: Kernels, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) computed by `k.linear` (the Triton bundle picks its GEMV or cuBLAS by shape)."""
    return k.linear(x, layer.weight, layer.bias)
