"""The "triton" kernel bundle: Triton ops where written, the torch reference, by name, where not.

Triton ops:  ssd_varlen, selective_state_update, selective_state_update_slots_raw_dt (triton_ssd: the decode
             step with dt softplus/clamp and A = -exp(A_log) inside); conv_varlen, conv_update(_slots)
             (triton_conv1d);
             paged_attention (triton_attention: decode with split-KV, prefill with cached prefix);
             write_kv (triton_kv: K and V rows into the pages, one launch);
             moe_route (triton_moe_route: router GEMV + top-k, one launch; two above 64 bf16 tokens),
             moe_experts (triton_moe_gemv: grouped GEMVs for <= 16 (token, slot) pairs, else triton_moe's
             sorted-token grouped GEMMs);
             rms_norm, add_rms_norm (residual add + RMSNorm), gated_rms_norm (triton_norm); relu2 (triton_activation);
             linear (triton_gemv.linear: one-launch GEMV for single-row decode linears up to 32 M weights,
             cuBLAS otherwise); add_rms_norm_linear, gated_norm_linear (triton_norm_gemv: a single row runs the norm
             in the GEMV's prologue, one launch; other shapes the norm kernel, then linear);
             fp8_linear (triton_fp8.fp8_linear: the FP8 GEMV for single-row decode linears, else
             torch._scaled_mm on FP8 tensor cores), fp8_moe_experts (triton_moe_gemv.fp8_moe_experts: FP8
             grouped GEMVs with the shared expert for <= 16 pairs, else triton_moe's grouped GEMMs, W8A8).
moe_route, linear, fp8_linear and the norm + linear ops are bound to the bundle's `ArrivalCounters` (one persistent zeroed
counter buffer per device for the multi-program router and split-K GEMVs: no memset per launch).
Torch ops used on purpose (a few gathers, no Python loop): conv_windows = cpu_conv1d.conv_state_windows (the torch
             bundle's: gathers only the n * (K-1) rows it returns, where the reference copies all of a prefill's
             [T, conv_dim] inputs into one buffer first).
There is no runtime fallback: every field is fixed here.

On a machine without CUDA the Triton ops run only under TRITON_INTERPRET=1 (set before triton is imported).
"""

from __future__ import annotations

import torch

from service.engine.kernels import (
    Kernels,
    cpu_conv1d,
    linear,
    moe,
    triton_activation,
    triton_attention,
    triton_conv1d,
    triton_fp8,
    triton_gemv,
    triton_kv,
    triton_moe_gemv,
    triton_moe_route,
    triton_norm,
    triton_norm_gemv,
    triton_ssd,
)

# fields that hold the torch reference
TORCH_REFERENCE_OPS = ("linear_weight_layout", "moe_weight_layout")
ARRIVAL_COUNTER_SLOTS = 1 << 16  # int32 counters per device (256 KB): see `ArrivalCounters`


def _capturing(device: torch.device) -> bool:
    """A CUDA graph capture is under way on device's current stream."""
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


class ArrivalCounters:
    """The triton bundle's persistent arrival counters: one zero-initialised int32 buffer of `slots` elements per
    device, shared by every split-K GEMV (`linear`, the norm + linear ops) and multi-program router (`moe_route`)
    the bundle launches, so that no launch zero-fills a fresh counter buffer (in a CUDA graph a memset node per
    launch, which also breaks the programmatic-dependent-launch chain between the Triton kernels).

    Invariant (why one buffer serves every launch): (1) the launches that use it are serialised: one stream, or
    streams ordered by wait_stream/events (the decode graphs warm up on a side stream ordered with the main one);
    launches running concurrently on unordered streams would mix their counts. (2) Every launch leaves the counters
    it touched at 0: the last arrival on each counter stores 0 after its reduction (`triton_gemv._gemv_kernel`,
    `triton_norm_gemv._norm_gemv_kernel`, `triton_moe_route._moe_route_kernel`). (3) A PDL successor bumps counters
    only after its `pdl_wait` (the GEMVs wait before loading x, the router waits first thing), which returns once
    the predecessor has finished and its writes, the 0 stores included, are visible. So every launch finds its
    counters at 0.
    Sizing: the buffer must cover the largest grid it serves; the launchers check it and raise ValueError when a
    launch needs more counters. The bundle's GEMVs take default tiles, which split K only with <= TARGET_PROGRAMS //
    2 column blocks (one counter each); the router has one counter per token block and >= 16 tokens per block above
    T = 8 (`route_tiles`): ARRIVAL_COUNTER_SLOTS covers 2^20 tokens per call.
    The buffer is created on its device's first use, which must be eager (the decode graphs warm up eagerly before
    capturing, runner/cuda_graph.py): created inside a capture it would live in the graph's pool and be zeroed by a
    graph node, so that raises RuntimeError."""

    def __init__(self, slots: int = ARRIVAL_COUNTER_SLOTS) -> None:
        self.slots = slots
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device | str) -> torch.Tensor:
        """The device's buffer (all zero between launches), created on the first call."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        buf = self._buffers.get(device)
        if buf is None:
            if device.type == "cuda" and _capturing(device):
                raise RuntimeError(
                    f"the arrival counters of {device} would be allocated during CUDA graph capture: "
                    "run the triton bundle's linear / moe_route eagerly once before capturing"
                )
            buf = self._buffers[device] = torch.zeros(self.slots, dtype=torch.int32, device=device)
        return buf

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`triton_gemv.linear` with these counters."""
        return triton_gemv.linear(x, weight, bias, counters=self.on(x.device))

    def fp8_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`triton_fp8.fp8_linear` with these counters."""
        return triton_fp8.fp8_linear(x, weight, weight_scale, input_scale, bias, counters=self.on(x.device))

    def moe_route(
        self,
        h: torch.Tensor,
        gate_weight: torch.Tensor,
        correction_bias: torch.Tensor,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        scaling: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`triton_moe_route.moe_route` with these counters."""
        return triton_moe_route.moe_route(
            h,
            gate_weight,
            correction_bias,
            top_k,
            n_group,
            topk_group,
            norm_topk_prob,
            scaling,
            counters=self.on(h.device),
        )

    def add_rms_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`triton_norm_gemv.add_rms_norm_linear` with these counters."""
        return triton_norm_gemv.add_rms_norm_linear(
            x, residual, norm_weight, eps, weight, bias, counters=self.on(x.device)
        )

    def gated_norm_linear(
        self,
        y: torch.Tensor,
        z: torch.Tensor,
        norm_weight: torch.Tensor,
        group_size: int,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`triton_norm_gemv.gated_norm_linear` with these counters."""
        return triton_norm_gemv.gated_norm_linear(
            y, z, norm_weight, group_size, eps, weight, bias, counters=self.on(y.device)
        )


def triton_kernels(counters: ArrivalCounters | None = None, fuse_norm_linear: bool = False) -> Kernels:
    """The bundle; counters None gives it a fresh `ArrivalCounters`. fuse_norm_linear: a single row's norm + linear
    ops run as one launch (`triton_norm_gemv`); off by default: the per-program norm prologue costs more than the
    launches it saves (measured on H200, see benchmarks/RESULTS.md)."""
    counters = counters if counters is not None else ArrivalCounters()
    bundle = Kernels(
        name="triton",
        ssd_varlen=triton_ssd.ssd_varlen,
        selective_state_update=triton_ssd.selective_state_update,
        selective_state_update_slots_raw_dt=triton_ssd.selective_state_update_slots_raw_dt,
        conv_varlen=triton_conv1d.causal_conv1d_varlen,
        conv_update=triton_conv1d.causal_conv1d_update,
        conv_update_slots=triton_conv1d.causal_conv1d_update_slots,
        conv_windows=cpu_conv1d.conv_state_windows,
        write_kv=triton_kv.write_kv,
        paged_attention=triton_attention.paged_attention,
        moe_route=counters.moe_route,
        moe_experts=triton_moe_gemv.moe_experts_by_size,
        rms_norm=triton_norm.rms_norm,
        add_rms_norm=triton_norm.add_rms_norm,
        gated_rms_norm=triton_norm.gated_group_rms_norm,
        relu2=triton_activation.relu2,
        linear=counters.linear,
        add_rms_norm_linear=counters.add_rms_norm_linear,
        gated_norm_linear=counters.gated_norm_linear,
        fp8_linear=counters.fp8_linear,
        fp8_moe_experts=triton_moe_gemv.fp8_moe_experts,
        linear_weight_layout=linear.linear_weight_layout_ref,
        moe_weight_layout=moe.moe_weight_layout_ref,
        mamba_decode_split=False,  # a mixed step's mamba rows in one varlen launch each (graphs take the decodes)
    )
    return bundle if fuse_norm_linear else triton_norm_gemv.without_norm_fusion(bundle)
