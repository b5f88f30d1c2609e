"""The "triton" kernel bundle: Triton ops where written, the torch reference, by name, where not.

Triton ops:  ssd_varlen, selective_state_update, selective_state_update_slots_raw_dt (triton_ssd: the decode
             step with dt softplus/clamp and A = -exp(A_log) inside); conv_varlen, conv_update(_slots)
             (triton_conv1d);
             paged_attention (triton_attention: decode with split-KV, prefill with cached prefix);
             moe_route (triton_moe_route: router GEMV + top-k in one launch), moe_experts (triton_moe_gemv:
             grouped GEMVs for <= 16 (token, slot) pairs, else triton_moe's sorted-token grouped GEMMs);
             rms_norm, add_rms_norm (residual add + RMSNorm), gated_rms_norm (triton_norm); relu2 (triton_activation);
             linear (triton_gemv.linear: one-launch GEMV for single-row decode linears up to 32 M weights,
             cuBLAS otherwise).
Torch references used on purpose (each a single gather/scatter, no Python loop):
             conv_windows = conv1d.conv_state_windows_ref, write_kv = attention.write_kv_ref.
There is no runtime fallback: every field is fixed here.

On a machine without CUDA the Triton ops run only under TRITON_INTERPRET=1 (set before triton is imported).
"""
from __future__ import annotations

from service.engine.kernels import Kernels, attention, conv1d
from service.engine.kernels import triton_attention, triton_conv1d, triton_moe, triton_norm, triton_ssd
from service.engine.kernels import triton_activation, triton_gemv, triton_moe_gemv

TORCH_REFERENCE_OPS = ("conv_windows", "write_kv")   # fields that hold the torch reference


def triton_kernels() -> Kernels:
    return Kernels(
        name="triton",
        ssd_varlen=triton_ssd.ssd_varlen,
        selective_state_update=triton_ssd.selective_state_update,
        selective_state_update_slots_raw_dt=triton_ssd.selective_state_update_slots_raw_dt,
        conv_varlen=triton_conv1d.causal_conv1d_varlen,
        conv_update=triton_conv1d.causal_conv1d_update,
        conv_update_slots=triton_conv1d.causal_conv1d_update_slots,
        conv_windows=conv1d.conv_state_windows_ref,
        write_kv=attention.write_kv_ref,
        paged_attention=triton_attention.paged_attention,
        moe_route=triton_moe.moe_route,
        moe_experts=triton_moe_gemv.moe_experts_by_size,
        rms_norm=triton_norm.rms_norm,
        add_rms_norm=triton_norm.add_rms_norm,
        gated_rms_norm=triton_norm.gated_group_rms_norm,
        relu2=triton_activation.relu2,
        linear=triton_gemv.linear,
    )
