"""Triton FP8 MoE experts: sorted-token grouped GEMMs over float8_e4m3fn expert weights (weight-only, W8A16).

The expert weights stay FP8 in memory (half the bytes of bf16: decode reads them once per step) and are converted
to x's dtype in registers; activations stay in x's dtype (no activation quantization: more precise than the
checkpoint's static W8A8 math; `fp8.fp8_moe_experts_ref` (weight-only by default) is this kernel's oracle).
Per-expert weight scales multiply the fp32 accumulators. The pipeline is `triton_moe`'s: `align_by_expert`, an up
GEMM with ReLU² into H [rows, I] (x's dtype), a down GEMM times the routing weight into Y [T*k, d], `sum_slots`.

The e4m3 -> fp16 conversion is done on the bytes (`_e4m3_bits_to_f16`): exact, and the same on the GPU and in the
Triton interpreter (which does not handle float8 tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.engine.kernels.fp8 import check_fp8_experts_args
from service.engine.kernels.tiles import default_tiles
from service.engine.kernels.triton_common import dot_precision
from service.engine.kernels.triton_moe import align_by_expert, sum_slots


@triton.jit
def _e4m3_bits_to_f16(b):
    """uint8 e4m3 bit patterns -> fp16 equal to value / 256, exactly (sign bit to bit 15, exponent and mantissa
    into fp16's, whose exponent bias is 8 larger; subnormals map to fp16 subnormals). No NaN handling: weights are
    finite."""
    b = b.to(tl.int16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _fp8_expert_tile(
    a_rows,
    valid,
    w_ptr,
    e,
    n_out,
    k_in,
    s_w_e,
    s_w_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] fp32 = A @ (W[e] / 256)^T over k_in; A's rows at a_rows [BLOCK_M, 1] (unit stride along
    k_in; rows where `valid`), W e4m3 bytes. Also returns the output columns offs_n and their mask."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < k_in
        a = tl.load(a_rows + offs_k[None, :], mask=valid[:, None] & mk[None, :], other=0.0)
        b = tl.load(
            w_ptr + e * s_w_e + offs_n[None, :] * s_w_n + offs_k[:, None], mask=mn[None, :] & mk[:, None], other=0
        )
        acc += tl.dot(a, _e4m3_bits_to_f16(b).to(a.dtype), input_precision=DOT_PRECISION)
    return acc, offs_n, mn


@triton.jit
def _fp8_up_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    pairs_ptr,
    block_expert_ptr,
    h_ptr,
    num_pairs,
    top_k,
    n_out,
    k_in,
    s_x_t,
    s_w_e,
    s_w_n,
    s_h_r,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs < num_pairs
    tok = (pairs // top_k).to(tl.int64)
    acc, offs_n, mn = _fp8_expert_tile(
        x_ptr + tok[:, None] * s_x_t,
        valid,
        w_ptr,
        e,
        n_out,
        k_in,
        s_w_e,
        s_w_n,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        DOT_PRECISION,
    )
    acc = tl.maximum(acc * (tl.load(scale_ptr + e) * 256.0), 0.0)
    acc = acc * acc
    tl.store(
        h_ptr + offs_m.to(tl.int64)[:, None] * s_h_r + offs_n[None, :],
        acc.to(h_ptr.dtype.element_ty),
        mask=valid[:, None] & mn[None, :],
    )


@triton.jit
def _fp8_down_kernel(
    h_ptr,
    w_ptr,
    scale_ptr,
    pairs_ptr,
    block_expert_ptr,
    topk_w_ptr,
    y_ptr,
    num_pairs,
    n_out,
    k_in,
    s_h_r,
    s_w_e,
    s_w_n,
    s_y_p,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs < num_pairs
    acc, offs_n, mn = _fp8_expert_tile(
        h_ptr + offs_m.to(tl.int64)[:, None] * s_h_r,
        valid,
        w_ptr,
        e,
        n_out,
        k_in,
        s_w_e,
        s_w_n,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        DOT_PRECISION,
    )
    wt = tl.load(topk_w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = acc * (wt[:, None] * (tl.load(scale_ptr + e) * 256.0))
    tl.store(
        y_ptr + pairs.to(tl.int64)[:, None] * s_y_p + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=valid[:, None] & mn[None, :],
    )


def fp8_moe_experts(
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    up_input_scale: torch.Tensor,
    down_input_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Routed FP8 experts (Triton, weight-only): x [T, d] (unit stride in d), up [E, I, d] / down [E, d, I] e4m3
    contiguous, up_scale / down_scale [E] fp32, topk_weights [T, k], topk_ids [T, k] -> [T, d] in x's dtype.
    The input scales are checked and not used (activations are not quantized, see the module docstring)."""
    check_fp8_experts_args(x, up, down, up_scale, down_scale, up_input_scale, down_input_scale, topk_ids)
    if x.stride(1) != 1 or not (up.is_contiguous() and down.is_contiguous()):
        raise ValueError("fp8 experts: x needs unit stride in d and up/down must be contiguous")
    T, d_in = x.shape
    E, inter, top_k = up.shape[0], up.shape[1], topk_ids.shape[1]
    if T == 0:
        return torch.empty(0, d_in, dtype=x.dtype, device=x.device)
    tiles = default_tiles(T * top_k / E, x.element_size())
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    al = align_by_expert(topk_ids, E, bm)
    rows = al.sorted_pairs.numel()
    prec = dot_precision(x.dtype)
    up8, down8 = up.view(torch.uint8), down.view(torch.uint8)
    up_s, down_s = up_scale.float().contiguous(), down_scale.float().contiguous()
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    _fp8_up_kernel[(rows // bm, triton.cdiv(inter, bn))](
        x,
        up8,
        up_s,
        al.sorted_pairs,
        al.block_expert,
        h,
        T * top_k,
        top_k,
        inter,
        d_in,
        x.stride(0),
        up.stride(0),
        up.stride(1),
        h.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_PRECISION=prec,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    y = torch.empty(T * top_k, d_in, dtype=x.dtype, device=x.device)
    _fp8_down_kernel[(rows // bm, triton.cdiv(d_in, bn))](
        h,
        down8,
        down_s,
        al.sorted_pairs,
        al.block_expert,
        topk_weights.float().contiguous(),
        y,
        T * top_k,
        d_in,
        inter,
        h.stride(0),
        down.stride(0),
        down.stride(1),
        y.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_PRECISION=prec,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    return sum_slots(y, T, top_k)
