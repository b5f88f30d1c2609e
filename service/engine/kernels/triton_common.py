"""Small helpers shared by the Triton launchers: block sizes, dot precision, argument checks, and programmatic
dependent launch (PDL).

PDL (Hopper+): a kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is still
running, as soon as every program of that one has called `griddepcontrol.launch_dependents` (or exited). Our PDL
kernels call `pdl_wait` before their first read of anything an earlier kernel may write (activations, state pools,
KV pages, scratch; before it they read only weights and write nothing) and `pdl_release` after their loads
(releasing first thing lets a whole chain launch and stall, which is slower: benchmarks/pdl_bench.py). A kernel
after the wait sees every write of the kernel before it, and that one waited for its own predecessor, so the order
of a plain stream holds. As every PDL kernel releases only after its own wait, when a kernel starts all kernels
before its predecessor have finished: data written two or more launches earlier is final even before the wait
(the MoE down pass reads the router's expert ids there). Kernels launched without PDL (torch, cuBLAS) start after
their predecessor ends.
`use_pdl(t)` decides per launch from t's device alone; under the CPU interpreter it is False.

Per-step sizes: Triton compiles one variant of a kernel per specialization of its integer arguments (equal to 1, a
multiple of 16, neither), and a compile takes up to a second inside the step that first needs it. Arguments that
change from one engine step to the next (token counts T, routed pairs, split counts, the page-table width of an
eager step) are `do_not_specialize` in their kernel's `@triton.jit`, so a kernel's variants depend on the model and
the launcher's tile choice alone, which the start-up warm-up (service/engine/warmup.py) reaches. They bound row
masks and loops only; sizes along a contiguous dimension (whose divisibility lets loads vectorise) stay specialized."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

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


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Launch with programmatic dependent launch: t is on a CUDA device of compute capability >= 9."""
    return t.is_cuda and _pdl_capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_args(t: torch.Tensor, pdl: bool | None = None) -> dict[str, bool]:
    """Launch keyword args of a kernel with a `PDL` constexpr: the constexpr and Triton's `launch_pdl` flag, always
    equal (a PDL launch whose kernel skipped `pdl_wait` would race its predecessor). pdl None = `use_pdl(t)`."""
    on = use_pdl(t) if pdl is None else pdl
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Lets the next PDL kernel in the stream launch once every program of this one has passed here."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Blocks until the kernel before this one has finished and its writes are visible (no-op without PDL)."""
    if PDL:
        gdc_wait()
