"""Triton MoE experts: sorted-token grouped GEMMs (bf16 operands, fp32 accumulation), ReLU² between.

Same signature and semantics as `moe.moe_experts_ref`. Steps (no host sync, so a step can be graph-captured):
  1. `align_by_expert` (triton_moe_align, one launch; `align_by_expert_ref` is the torch oracle): the T*k (token, slot)
     pairs sorted by expert (stable), each expert's run padded to a multiple of BLOCK_M with the sentinel T*k;
     `block_expert[b]` = expert of block b (-1 past the end).
  2. `_up_kernel`:   H[r] = relu(x[pair_r // k] @ up[e]^T)^2 for every sorted row r         [rows, I]
  3. `_down_kernel`: Y[pair_r] = w[pair_r] * (H[r] @ down[e]^T)                             [T*k, d_in]
  4. `_sum_slots_kernel`: out[t] = sum over the k slots of Y, in fp32, cast to x's dtype.
`moe_route` (re-exported here) is the one-launch Triton router of `triton_moe_route`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from service.engine.kernels import fp8, moe
from service.engine.kernels.fp8 import Fp8Linear
from service.engine.kernels.tiles import MoeTiles, default_tiles
from service.engine.kernels.triton_common import (
    block_dim,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    dot_precision,
    pdl_args,
    pdl_release,
    pdl_wait,
)
from service.engine.kernels.triton_fp8 import FP8_MAX, f32_to_e4m3_bits, quantize_fp8
from service.engine.kernels.triton_gemv import e4m3_to
from service.engine.kernels.triton_moe_align import align_by_expert
from service.engine.kernels.triton_moe_route import moe_route  # noqa: F401  (the backend's moe_route)

FP8_OFF, FP8_WEIGHT_ONLY, FP8_W8A8 = 0, 1, 2  # the grouped GEMMs' FP8 modes (their FP8 constexpr)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _expert_tile(
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
    FP8: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] fp32 = A @ W[e]^T over k_in: A's rows at the pointers a_rows [BLOCK_M, 1] (unit
    stride along k_in; rows where `valid`), expert e's weight rows of n-block program_id(1). Also returns the
    output columns offs_n and their mask. FP8 (`FP8_*`): 0: A and W in x's dtype; WEIGHT_ONLY: W e4m3 bytes made
    x's dtype in registers (`e4m3_to`, exact); W8A8: A and W e4m3 bytes, an e4m3 tensor-core dot. The caller
    applies the scales."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < k_in
        a = tl.load(a_rows + offs_k[None, :], mask=valid[:, None] & mk[None, :], other=0)
        b = tl.load(
            w_ptr + e * s_w_e + offs_n[None, :] * s_w_n + offs_k[:, None], mask=mn[None, :] & mk[:, None], other=0
        )
        if FP8 == 2:
            acc = tl.dot(a.to(tl.float8e4nv, bitcast=True), b.to(tl.float8e4nv, bitcast=True), acc)
        elif FP8 == 1:
            acc += tl.dot(a, e4m3_to(b, a.dtype), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    return acc, offs_n, mn


@triton.jit
def _dequant(ws_ptr, a_scale_ptr, e, FP8: tl.constexpr):
    """The factor that turns an `_expert_tile` sum into the product of the true values: 1 (FP8 0), the expert's
    weight scale (WEIGHT_ONLY), weight scale * the A operand's static input scale (W8A8)."""
    if FP8 == 2:
        return tl.load(ws_ptr + e) * tl.load(a_scale_ptr)
    if FP8 == 1:
        return tl.load(ws_ptr + e)
    return 1.0


@triton.jit(do_not_specialize=("num_pairs",))  # per-step sizes: triton_common's docstring
def _up_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    a_scale_ptr,
    h_scale_ptr,
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
    FP8: tl.constexpr,
    H_DTYPE: tl.constexpr,
):
    """H rows = relu(x @ W[e]^T)^2 in x's dtype; W8A8: x is e4m3 bytes and H is written as e4m3 bytes of
    H / (the down GEMM's input scale at h_scale_ptr), H rounded to x's dtype (H_DTYPE) first, as the reference."""
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs < num_pairs
    tok = (pairs // top_k).to(tl.int64)
    acc, offs_n, mn = _expert_tile(
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
        FP8,
    )
    acc = tl.maximum(acc * _dequant(ws_ptr, a_scale_ptr, e, FP8), 0.0)
    acc = acc * acc
    h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * s_h_r + offs_n[None, :]
    if FP8 == 2:
        hq = acc.to(H_DTYPE).to(tl.float32) / tl.load(h_scale_ptr)
        hq = f32_to_e4m3_bits(tl.minimum(hq, FP8_MAX))  # >= 0 after the ReLU²
        tl.store(h_ptrs, hq.to(tl.uint8), mask=valid[:, None] & mn[None, :])
    else:
        tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=valid[:, None] & mn[None, :])


@triton.jit(do_not_specialize=("num_pairs",))  # per-step sizes: triton_common's docstring
def _down_kernel(
    h_ptr,
    w_ptr,
    ws_ptr,
    a_scale_ptr,
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
    FP8: tl.constexpr,
):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs < num_pairs
    acc, offs_n, mn = _expert_tile(
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
        FP8,
    )
    wt = tl.load(topk_w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = acc * (wt[:, None] * _dequant(ws_ptr, a_scale_ptr, e, FP8))
    tl.store(
        y_ptr + pairs.to(tl.int64)[:, None] * s_y_p + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=valid[:, None] & mn[None, :],
    )


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, top_k, d, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum_j y[t * top_k + j] in fp32, cast to out's dtype."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    md = offs_d < d
    v = tl.load(
        y_ptr + (t * top_k + offs_k[:, None]) * d + offs_d[None, :],
        mask=(offs_k < top_k)[:, None] & md[None, :],
        other=0.0,
    )
    pdl_release(PDL)
    tl.store(out_ptr + t * d + offs_d, tl.sum(v.to(tl.float32), axis=0).to(out_ptr.dtype.element_ty), mask=md)


@dataclass(frozen=True)
class Fp8ExpertScales:
    """The fp32 scales of FP8 expert stacks (ModelOpt per-tensor scheme) for the grouped GEMMs."""

    up: torch.Tensor  # [E] per-expert weight scales of up (W ~= weight * scale)
    down: torch.Tensor  # [E] of down
    up_input: torch.Tensor  # one element: static input scale of the up GEMM (x), used by W8A8
    down_input: torch.Tensor  # one element: of the down GEMM (the ReLU² output), used by W8A8


def moe_experts(
    x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Routed experts (Triton), see `moe_experts_tiled`."""
    return moe_experts_tiled(x, up, down, topk_weights, topk_ids, None)


def moe_experts_tiled(
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: MoeTiles | None,
    scales: Fp8ExpertScales | None = None,
    w8a8: bool = False,
) -> torch.Tensor:
    """Routed experts (Triton); tiles None picks `default_tiles`.
    x [T, d_in] (unit stride in d_in), up [E, I, d_in], down [E, d_in, I] (contiguous; x's dtype, or
    float8_e4m3fn with `scales`), topk_weights [T, k] (fp32), topk_ids [T, k] int64 ->
    sum_k w * down(relu(up(x))^2) [T, d_in] in x's dtype. FP8 experts: weight-only (the weights made x's dtype in
    registers), or w8a8: x and the ReLU² output quantized with the static input scales, e4m3 tensor-core dots
    (`fp8.fp8_moe_experts_ref` with quantize_activations is its oracle)."""
    T, d_in, E, inter, top_k = check_experts_args(x, up, down, topk_weights, topk_ids, scales)
    if T == 0:
        return torch.empty(0, d_in, dtype=x.dtype, device=x.device)
    mode = FP8_OFF if scales is None else FP8_W8A8 if w8a8 else FP8_WEIGHT_ONLY
    cfg = tiles or default_tiles(T * top_k / E, 1 if mode == FP8_W8A8 else x.element_size())
    bm, bn, bk, warps, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.warps, cfg.stages
    al = align_by_expert(topk_ids, E, bm)
    rows = al.sorted_pairs.numel()
    prec = dot_precision(x.dtype)
    a, w_up, w_down, s = x, up, down, scales
    if mode != FP8_OFF:
        w_up, w_down = up.view(torch.uint8), down.view(torch.uint8)
    if mode == FP8_W8A8:
        a = quantize_fp8(x, s.up_input).view(torch.uint8)
    dummy = x  # scale pointers not read without FP8
    h = torch.empty(rows, inter, dtype=torch.uint8 if mode == FP8_W8A8 else x.dtype, device=x.device)
    _up_kernel[(rows // bm, triton.cdiv(inter, bn))](
        a,
        w_up,
        dummy if s is None else s.up,
        dummy if s is None else s.up_input,
        dummy if s is None else s.down_input,
        al.sorted_pairs,
        al.block_expert,
        h,
        T * top_k,
        top_k,
        inter,
        d_in,
        a.stride(0),
        up.stride(0),
        up.stride(1),
        h.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_PRECISION=prec,
        FP8=mode,
        H_DTYPE=_TL_DTYPES[x.dtype],
        num_warps=warps,
        num_stages=stages,
    )
    y = torch.empty(T * top_k, d_in, dtype=x.dtype, device=x.device)
    w = topk_weights.to(torch.float32).contiguous()
    _down_kernel[(rows // bm, triton.cdiv(d_in, bn))](
        h,
        w_down,
        dummy if s is None else s.down,
        dummy if s is None else s.down_input,
        al.sorted_pairs,
        al.block_expert,
        w,
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
        FP8=mode,
        num_warps=warps,
        num_stages=stages,
    )
    return sum_slots(y, T, top_k)


def sum_slots(y: torch.Tensor, T: int, top_k: int) -> torch.Tensor:
    """y [T*k, d] (row t*k + j: slot j of token t) -> [T, d] sums over the k slots in fp32, in y's dtype."""
    d = y.shape[1]
    out = torch.empty(T, d, dtype=y.dtype, device=y.device)
    _sum_slots_kernel[(T, triton.cdiv(d, 1024))](
        y, out, top_k, d, BLOCK_K=block_dim(top_k, 1), BLOCK_D=min(block_dim(d, 1), 1024), num_warps=4, **pdl_args(y)
    )
    return out


def check_experts_args(
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: Fp8ExpertScales | None = None,
) -> tuple[int, int, int, int, int]:
    """Shape/dtype/device checks of the routed-experts ops (FP8 experts: with their scales); returns
    (T, d_in, E, I, top_k)."""
    check_dim("x", x, 2)
    T, d_in = x.shape
    check_dim("up", up, 3)
    E, inter = up.shape[0], up.shape[1]
    check_shape("up", up, (E, inter, d_in))
    check_shape("down", down, (E, d_in, inter))
    check_dim("topk_ids", topk_ids, 2)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    if topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows, x has T={T}")
    want = x.dtype if scales is None else fp8.FP8_DTYPE
    if up.dtype != want or down.dtype != want:
        raise ValueError(f"up/down must be {want}, got {up.dtype}/{down.dtype} (FP8 experts need their scales)")
    if scales is not None:
        check_shape("up weight scales", scales.up, (E,))
        check_shape("down weight scales", scales.down, (E,))
        if scales.up_input.numel() != 1 or scales.down_input.numel() != 1:
            raise ValueError("the experts' input scales must have one element each (one per GEMM)")
        for name, t in vars(scales).items():
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"FP8 expert scale {name!r} must be contiguous fp32, got {t.dtype}")
        check_same_device(x=x, **vars(scales))
    check_inner_contiguous("x", x)
    if not (up.is_contiguous() and down.is_contiguous()):
        raise ValueError("up and down expert weights must be contiguous")
    check_same_device(x=x, up=up, down=down, topk_weights=topk_weights, topk_ids=topk_ids)
    return T, d_in, E, inter, topk_ids.shape[1]


SharedLinear = torch.Tensor | Fp8Linear  # a shared-expert matrix: x's dtype with BF16 experts, FP8 with FP8 ones


def check_shared_args(
    x: torch.Tensor, shared_up: SharedLinear | None, shared_down: SharedLinear | None, is_fp8: bool = False
) -> int:
    """The optional shared expert of the Triton routed-experts ops, both or neither: with experts in x's dtype
    tensors (`moe.check_shared_expert`: shared_up [S, d_in], shared_down [d_in, S]; x's dtype), with FP8 experts
    (is_fp8) `Fp8Linear`s (`fp8.check_fp8_shared`); contiguous weights on x's device. Returns S (0: none)."""
    if any(m is not None and isinstance(m, Fp8Linear) != is_fp8 for m in (shared_up, shared_down)):
        want = "Fp8Linear" if is_fp8 else f"{x.dtype} tensors"
        raise ValueError(f"the shared expert of {'FP8' if is_fp8 else x.dtype} experts must be {want}")
    if is_fp8:
        n_shared = fp8.check_fp8_shared(x, shared_up, shared_down)
        ups, downs = (shared_up.weight, shared_down.weight) if n_shared else (None, None)
    else:
        n_shared, ups, downs = moe.check_shared_expert(x, shared_up, shared_down), shared_up, shared_down
        if n_shared:
            check_dtype("shared_up", ups, (x.dtype,))
            check_dtype("shared_down", downs, (x.dtype,))
    if not n_shared:
        return 0
    if not (ups.is_contiguous() and downs.is_contiguous()):
        raise ValueError("shared_up and shared_down must be contiguous")
    check_same_device(x=x, shared_up=ups, shared_down=downs)
    return n_shared


def shared_weight_and_scale(m: SharedLinear | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A shared-expert matrix as the kernels take it: (weight, fp32 one-element scale) for FP8, (weight, None)."""
    if isinstance(m, Fp8Linear):
        return m.weight, m.weight_scale.float().reshape(1)
    return m, None
