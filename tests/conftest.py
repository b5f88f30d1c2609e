"""Root test configuration.

Without CUDA, Triton kernels run in Triton's interpreter. The variable must be set before anything
imports triton (transformers and torch may import it while other test modules are collected), so it
is set here, in the first conftest pytest loads."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
