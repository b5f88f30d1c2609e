"""Kernels: pure-torch references (`*_ref`) and Triton kernels. Imports nothing from the engine.

`Kernels` bundles one implementation of each op; `get_kernels(name)` returns the bundle for an
explicit backend choice ("torch" or "triton"). There is no silent fallback between them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn.functional as F

from service.engine.kernels import attention, conv1d, moe, norm, ssd


@dataclass(frozen=True)
class Kernels:
    name: str
    ssd_varlen: Callable               # ssd.ssd_varlen_ref signature
    selective_state_update: Callable   # ssd.selective_state_update_ref signature
    selective_state_update_slots_raw_dt: Callable  # ssd.selective_state_update_slots_raw_dt_ref (pool in place)
    conv_varlen: Callable              # conv1d.causal_conv1d_varlen_ref signature
    conv_update: Callable              # conv1d.causal_conv1d_update_ref signature
    conv_update_slots: Callable        # conv1d.causal_conv1d_update_slots_ref signature (pool in place)
    conv_windows: Callable             # conv1d.conv_state_windows_ref signature
    write_kv: Callable                 # attention.write_kv_ref signature
    paged_attention: Callable          # attention.paged_attention_ref signature
    moe_route: Callable                # moe.moe_route_ref signature
    moe_experts: Callable              # moe.moe_experts_ref signature (+ optional shared expert, keyword args)
    rms_norm: Callable                 # norm.rms_norm_ref signature
    add_rms_norm: Callable             # norm.add_rms_norm_ref signature (residual add + the next RMSNorm)
    gated_rms_norm: Callable           # norm.gated_group_rms_norm_ref signature
    relu2: Callable                    # moe.relu2 signature (dense MLP / shared expert activation)
    linear: Callable                   # F.linear signature (every projection: in/out, q/k/v/o, MLPs, lm_head)
    add_rms_norm_linear: Callable      # norm.add_rms_norm_linear_ref signature (residual add + norm + in_proj)
    gated_norm_linear: Callable        # norm.gated_norm_linear_ref signature (mamba gated norm + out_proj)


def torch_kernels() -> Kernels:
    return Kernels(
        name="torch", ssd_varlen=ssd.ssd_varlen_ref, selective_state_update=ssd.selective_state_update_ref,
        selective_state_update_slots_raw_dt=ssd.selective_state_update_slots_raw_dt_ref,
        conv_varlen=conv1d.causal_conv1d_varlen_ref, conv_update=conv1d.causal_conv1d_update_ref,
        conv_update_slots=conv1d.causal_conv1d_update_slots_ref,
        conv_windows=conv1d.conv_state_windows_ref, write_kv=attention.write_kv_ref,
        paged_attention=attention.paged_attention_ref, moe_route=moe.moe_route_ref,
        moe_experts=moe.moe_experts_ref, rms_norm=norm.rms_norm_ref, add_rms_norm=norm.add_rms_norm_ref,
        gated_rms_norm=norm.gated_group_rms_norm_ref, relu2=moe.relu2,
        linear=F.linear, add_rms_norm_linear=norm.add_rms_norm_linear_ref,
        gated_norm_linear=norm.gated_norm_linear_ref,
    )


def get_kernels(name: str) -> Kernels:
    if name == "torch":
        return torch_kernels()
    if name == "triton":
        from service.engine.kernels.triton_backend import triton_kernels  # imports triton: only when chosen
        return triton_kernels()
    raise ValueError(f"kernel_backend must be 'torch' or 'triton', got {name!r}")
