"""Kernels: pure-torch references (`*_ref`), fast pure-torch kernels (`cpu_*.py`) and Triton kernels. Imports
nothing from the engine.

`Kernels` bundles one implementation of each op; `get_kernels(name)` returns the bundle for an
explicit backend choice ("torch", "native" or "triton"). There is no silent fallback between them.
The "torch" bundle runs the fast pure-torch kernels where they exist (tuned on CPU; each is tested against its
`*_ref` oracle) and the references elsewhere; `torch_reference_kernels()` is the all-reference bundle (same name,
for tests and benchmarks)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F

from service.engine.kernels import (
    attention,
    conv1d,
    cpu_attention,
    cpu_conv1d,
    cpu_linear,
    cpu_moe,
    cpu_native,
    cpu_native_ops,
    cpu_norm,
    cpu_ssd,
    fp8,
    linear,
    moe,
    norm,
    ssd,
)


@dataclass(frozen=True)
class Kernels:
    name: str
    ssd_varlen: Callable  # ssd.ssd_varlen_ref signature
    selective_state_update: Callable  # ssd.selective_state_update_ref signature
    selective_state_update_slots_raw_dt: Callable  # ssd.selective_state_update_slots_raw_dt_ref (pool in place)
    conv_varlen: Callable  # conv1d.causal_conv1d_varlen_ref signature
    conv_update: Callable  # conv1d.causal_conv1d_update_ref signature
    conv_update_slots: Callable  # conv1d.causal_conv1d_update_slots_ref signature (pool in place)
    conv_windows: Callable  # conv1d.conv_state_windows_ref signature
    write_kv: Callable  # attention.write_kv_ref signature
    paged_attention: Callable  # attention.paged_attention_ref signature
    moe_route: Callable  # moe.moe_route_ref signature
    moe_experts: Callable  # moe.moe_experts_ref signature (+ optional shared expert, keyword args)
    rms_norm: Callable  # norm.rms_norm_ref signature
    add_rms_norm: Callable  # norm.add_rms_norm_ref signature (residual add + the next RMSNorm)
    gated_rms_norm: Callable  # norm.gated_group_rms_norm_ref signature
    relu2: Callable  # moe.relu2 signature (dense MLP / shared expert activation)
    linear: Callable  # F.linear signature (every projection: in/out, q/k/v/o, MLPs, lm_head)
    add_rms_norm_linear: Callable  # norm.add_rms_norm_linear_ref signature (residual add + norm + in_proj)
    gated_norm_linear: Callable  # norm.gated_norm_linear_ref signature (mamba gated norm + out_proj)
    fp8_linear: Callable  # fp8.fp8_linear_ref signature (FP8 weight, per-tensor scales)
    fp8_moe_experts: Callable  # fp8.fp8_moe_experts_ref signature (FP8 experts, per-expert weight scales)
    # weight layouts, applied once after loading (the model's `prepare_weights`): the same shapes and values in the
    # memory layout this bundle's ops read fastest (every bundle's ops take any layout)
    linear_weight_layout: Callable  # linear.linear_weight_layout_ref signature (non-FP8 linear weights [out, in])
    moe_weight_layout: Callable  # moe.moe_weight_layout_ref signature (non-FP8 routed experts)
    # how a mamba layer runs a step that mixes one-token rows with longer ones: True: the one-token rows by the
    # decode recurrence (conv_update_slots + selective_state_update_slots_raw_dt), the others by conv_varlen +
    # ssd_varlen (two passes whose cost follows the rows each takes); False: every row by the varlen ops (one pass)
    mamba_decode_split: bool


def torch_reference_kernels() -> Kernels:
    """Every op its pure-torch reference (`*_ref`): the readable oracle."""
    return Kernels(
        name="torch",
        ssd_varlen=ssd.ssd_varlen_ref,
        selective_state_update=ssd.selective_state_update_ref,
        selective_state_update_slots_raw_dt=ssd.selective_state_update_slots_raw_dt_ref,
        conv_varlen=conv1d.causal_conv1d_varlen_ref,
        conv_update=conv1d.causal_conv1d_update_ref,
        conv_update_slots=conv1d.causal_conv1d_update_slots_ref,
        conv_windows=conv1d.conv_state_windows_ref,
        write_kv=attention.write_kv_ref,
        paged_attention=attention.paged_attention_ref,
        moe_route=moe.moe_route_ref,
        moe_experts=moe.moe_experts_ref,
        rms_norm=norm.rms_norm_ref,
        add_rms_norm=norm.add_rms_norm_ref,
        gated_rms_norm=norm.gated_group_rms_norm_ref,
        relu2=moe.relu2,
        linear=F.linear,
        add_rms_norm_linear=norm.add_rms_norm_linear_ref,
        gated_norm_linear=norm.gated_norm_linear_ref,
        fp8_linear=fp8.fp8_linear_dequant_ref,
        fp8_moe_experts=fp8.fp8_moe_experts_ref,
        linear_weight_layout=linear.linear_weight_layout_ref,
        moe_weight_layout=moe.moe_weight_layout_ref,
        mamba_decode_split=False,
    )


def torch_kernels() -> Kernels:
    """The "torch" bundle: the fast pure-torch kernels (cpu_attention, cpu_conv1d, cpu_moe, cpu_norm, cpu_ssd) for
    the prefill scan, conv and conv state windows, the decode recurrence, paged attention, the routed experts (with
    their weights laid out at load, `cpu_moe.moe_weight_layout`) and the norms with their fused linears (row blocks
    at prefill sizes); references for the rest, with the linears' weights stored transposed at load
    (`cpu_linear.linear_weight_layout`).
    cpu_moe.moe_experts runs `F.grouped_mm`, whose CUDA kernel takes bf16 only: off the CPU it is the reference."""
    return dataclasses.replace(
        torch_reference_kernels(),
        ssd_varlen=cpu_ssd.ssd_varlen,
        selective_state_update_slots_raw_dt=cpu_ssd.selective_state_update_slots_raw_dt,
        conv_varlen=cpu_conv1d.causal_conv1d_varlen,
        conv_update_slots=cpu_conv1d.causal_conv1d_update_slots,
        conv_windows=cpu_conv1d.conv_state_windows,
        paged_attention=cpu_attention.paged_attention,
        moe_experts=cpu_moe.moe_experts,
        rms_norm=cpu_norm.rms_norm,
        add_rms_norm=cpu_norm.add_rms_norm,
        add_rms_norm_linear=cpu_norm.add_rms_norm_linear,
        gated_norm_linear=cpu_norm.gated_norm_linear,
        linear_weight_layout=cpu_linear.linear_weight_layout,
        moe_weight_layout=cpu_moe.moe_weight_layout,
        mamba_decode_split=True,
    )


def native_kernels() -> Kernels:
    """The "native" bundle: the "torch" bundle with compiled C kernels (csrc/cpu_decode.c, `cpu_native_ops`) for
    the decode recurrence, the prefill scan (the same recurrence, token after token), the conv (decode and
    prefill), the decode rows of paged attention, the routed experts of small batches, the router's top-k, the Mamba
    output norm and the residual add + norm (alone and before in_proj) (fp32 on the CPU; other inputs run the torch
    bundle's ops). Builds the kernels now (`cpu_native.native_library`:
    compiled once per machine, then cached), so an engine that chose this backend fails at start, naming what to
    install, when they cannot be."""
    cpu_native.native_library()
    return dataclasses.replace(
        torch_kernels(),
        name="native",
        selective_state_update_slots_raw_dt=cpu_native_ops.selective_state_update_slots_raw_dt,
        conv_update_slots=cpu_native_ops.causal_conv1d_update_slots,
        paged_attention=cpu_native_ops.paged_attention,
        moe_experts=cpu_native_ops.moe_experts,
        gated_norm_linear=cpu_native_ops.gated_norm_linear,
        conv_varlen=cpu_native_ops.causal_conv1d_varlen,
        moe_weight_layout=cpu_native_ops.moe_weight_layout,
        add_rms_norm=cpu_native_ops.add_rms_norm,
        add_rms_norm_linear=cpu_native_ops.add_rms_norm_linear,
        moe_route=cpu_native_ops.moe_route,
        ssd_varlen=cpu_native_ops.ssd_varlen,
    )


def get_kernels(name: str) -> Kernels:
    if name == "torch":
        return torch_kernels()
    if name == "native":
        return native_kernels()
    if name == "triton":
        from service.engine.kernels.triton_backend import triton_kernels  # imports triton: only when chosen

        return triton_kernels()
    raise ValueError(f"kernel_backend must be 'torch', 'native' or 'triton', got {name!r}")
