"""Kernel tests: without CUDA the Triton kernels run in Triton's interpreter (set before triton is imported)."""
from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))
