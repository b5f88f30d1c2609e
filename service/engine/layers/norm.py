"""Norm weights as modules (the math lives in kernels/norm.py)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_module(hidden: int) -> nn.Module:
    m = nn.Module()
    m.weight = nn.Parameter(torch.ones(hidden))
    return m
