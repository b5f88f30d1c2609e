"""Small helpers shared by the Triton launchers: block sizes, dot precision, argument checks."""
from __future__ import annotations

import torch
import triton

# Programs per launch we aim for when a launcher may split work (e.g. attention split-KV):
# about two waves on a 132-SM H200, and fixed so CPU (interpreter) and GPU runs take the same path.
TARGET_PROGRAMS = 264


def block_dim(n: int, minimum: int = 16) -> int:
    """Power-of-two block covering n (>= minimum, so tl.dot's 16-wide shape rule holds)."""
    return max(minimum, triton.next_power_of_2(int(n)))


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 ('ieee') for fp32 operands, else the operands' own type."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_dim(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")


def check_inner_contiguous(name: str, t: torch.Tensor) -> None:
    """The last dim must have stride 1 (rows may be strided views, e.g. a split of in_proj's output)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
