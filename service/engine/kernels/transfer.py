"""Host -> device copies that do not wait for the device: the step's metadata is built on the host while earlier
steps still run (async scheduling), so a copy must not synchronize with the kernels queued before it."""

from __future__ import annotations

import torch


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on device without waiting for the device: on CUDA a non-blocking copy from pinned memory (a
    pageable copy would wait for every kernel queued before it; the pinned block is kept until the copy ran)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device_async(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """values as a 1-d tensor on device without waiting for the device (see `host_to_device`)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)
