"""One rank's state tensors: the paged KV cache and the mamba conv/ssm slots, indexed by the ids the engine's
allocators (cache/pools.py) hand out. Page 0 and slot 0 are scratch (padding targets)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.cache.pools import PoolSizes
from service.engine.kernels.transfer import to_device_async


@dataclass(frozen=True)
class StateShapes:
    """Per-rank sizes of one token's KV and one slot's mamba state (this rank's heads and groups)."""

    num_attn_layers: int
    kv_heads: int  # KV heads held by this rank
    head_dim: int
    num_mamba_layers: int
    conv_dim: int  # conv channels held by this rank (x, B, C of its heads and groups)
    conv_width: int  # conv kernel K (the state holds K-1 columns)
    mamba_heads: int  # mamba heads held by this rank
    mamba_head_dim: int
    state_size: int


class StateTensors:
    """kv [L_attn, 2, num_pages * page_size, Hkv, Dh] in kv_dtype (default: dtype); conv [L_mamba, S, conv_dim, K-1]
    in dtype; ssm [L_mamba, S, H, P, N] in ssm_dtype, fp32 unless mamba_ssm_cache_dtype says bf16 (S = all mamba
    slots, scratch slot 0 included)."""

    def __init__(
        self,
        sizes: PoolSizes,
        page_size: int,
        shapes: StateShapes,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: torch.dtype | None = None,
        ssm_dtype: torch.dtype = torch.float32,
    ):
        s = shapes
        self.kv = torch.zeros(
            s.num_attn_layers,
            2,
            sizes.num_kv_pages * page_size,
            s.kv_heads,
            s.head_dim,
            dtype=kv_dtype or dtype,
            device=device,
        )
        self.conv = torch.zeros(
            s.num_mamba_layers, sizes.num_slots, s.conv_dim, s.conv_width - 1, dtype=dtype, device=device
        )
        self.ssm = torch.zeros(
            s.num_mamba_layers,
            sizes.num_slots,
            s.mamba_heads,
            s.mamba_head_dim,
            s.state_size,
            dtype=ssm_dtype,
            device=device,
        )

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copies conv + ssm state of every mamba layer from src slots to dst slots (all reads before writes)."""
        if not src:
            return
        s = to_device_async(src, torch.int64, self.ssm.device)
        d = to_device_async(dst, torch.int64, self.ssm.device)
        self.conv[:, d] = self.conv[:, s]
        self.ssm[:, d] = self.ssm[:, s]

    def zero_slots(self, slots: list[int]) -> None:
        """Zeroes the state of these slots. Like `copy_slots`, it queues behind the steps in flight without waiting
        for them (a step that admits requests must not stall the host until the previous step has finished)."""
        if slots:
            idx = to_device_async(slots, torch.int64, self.ssm.device)
            # index_fill_, not `t[:, idx] = 0`: the assignment synchronizes with the device (CUDA's sync debug mode)
            self.conv.index_fill_(1, idx, 0)
            self.ssm.index_fill_(1, idx, 0)

    def read_slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one slot's state: conv [L_mamba, conv_dim, K-1], ssm [L_mamba, H, P, N] (the pool's dtype)."""
        return self.conv[:, slot].clone(), self.ssm[:, slot].clone()
