"""Marks shared by every test package: `gpu` (selected by `-m gpu`, see pyproject's markers) and `needs_cuda` (skips
without a CUDA device, so a GPU test collected on the CPU machine skips instead of failing)."""

from __future__ import annotations

import pytest
import torch

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
