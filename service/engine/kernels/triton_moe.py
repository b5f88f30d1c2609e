"""Triton MoE experts: sorted-token grouped GEMMs (bf16 operands, fp32 accumulation), ReLU² between.

Same signature and semantics as `moe.moe_experts_ref`. Steps (no host sync, so a step can be graph-captured):
  1. `align_by_expert` (torch): the T*k (token, slot) pairs sorted by expert, each expert's run padded
     to a multiple of BLOCK_M with the sentinel T*k; `block_expert[b]` = expert of block b (-1 past the end).
  2. `_up_kernel`:   H[r] = relu(x[pair_r // k] @ up[e]^T)^2 for every sorted row r         [rows, I]
  3. `_down_kernel`: Y[pair_r] = w[pair_r] * (H[r] @ down[e]^T)                             [T*k, d_in]
  4. `_sum_slots_kernel`: out[t] = sum over the k slots of Y, in fp32, cast to x's dtype.
`moe_route` stays the torch reference (`moe.moe_route_ref`): an fp32 [T, d] x [d, E] product and a top-k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from service.engine.kernels.triton_common import (block_dim, check_dim, check_inner_contiguous, check_same_device,
                                                  check_shape, dot_precision)


@dataclass(frozen=True)
class ExpertAlignment:
    sorted_pairs: torch.Tensor   # [num_blocks * block_m] int32: pair index t*k + j, or T*k for padding
    block_expert: torch.Tensor   # [num_blocks] int32: expert of each block of block_m rows, -1 for unused blocks
    block_m: int                 # rows per block


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """topk_ids [T, k] -> pairs grouped by expert, each group padded to a multiple of block_m (device ops only)."""
    flat = topk_ids.flatten()
    tk = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends_p = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(tk, device=dev) - starts[sorted_e]
    num_blocks = triton.cdiv(tk, block_m) + num_experts          # upper bound on sum_e ceil(count_e / block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), tk, dtype=torch.int32, device=dev)
    sorted_pairs[ends_p[sorted_e] - padded[sorted_e] + rank] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends_p, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertAlignment(sorted_pairs, block_expert, block_m)


@triton.jit
def _up_kernel(x_ptr, w_ptr, pairs_ptr, block_expert_ptr, h_ptr, num_pairs, top_k, n_out, k_in,
               s_x_t, s_w_e, s_w_n, s_h_r,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs < num_pairs
    tok = (pairs // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < k_in
        a = tl.load(x_ptr + tok[:, None] * s_x_t + offs_k[None, :], mask=valid[:, None] & mk[None, :], other=0.0)
        b = tl.load(w_ptr + e * s_w_e + offs_n[None, :] * s_w_n + offs_k[:, None], mask=mn[None, :] & mk[:, None],
                    other=0.0)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    acc = tl.maximum(acc, 0.0)
    acc = acc * acc
    tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * s_h_r + offs_n[None, :], acc.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & mn[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, pairs_ptr, block_expert_ptr, topk_w_ptr, y_ptr, num_pairs, n_out, k_in,
                 s_h_r, s_w_e, s_w_n, s_y_p,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < k_in
        a = tl.load(h_ptr + offs_m.to(tl.int64)[:, None] * s_h_r + offs_k[None, :], mask=valid[:, None] & mk[None, :],
                    other=0.0)
        b = tl.load(w_ptr + e * s_w_e + offs_n[None, :] * s_w_n + offs_k[:, None], mask=mn[None, :] & mk[:, None],
                    other=0.0)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    wt = tl.load(topk_w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    tl.store(y_ptr + pairs.to(tl.int64)[:, None] * s_y_p + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & mn[None, :])


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, top_k, d, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum_j y[t * top_k + j] in fp32, cast to out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    md = offs_d < d
    v = tl.load(y_ptr + (t * top_k + offs_k[:, None]) * d + offs_d[None, :],
                mask=(offs_k < top_k)[:, None] & md[None, :], other=0.0)
    tl.store(out_ptr + t * d + offs_d, tl.sum(v.to(tl.float32), axis=0).to(out_ptr.dtype.element_ty), mask=md)


@dataclass(frozen=True)
class MoeTiles:
    """Launch shape of both grouped GEMMs."""
    block_m: int                  # sorted (token, slot) rows per program; each expert's run is padded to it
    block_n: int                  # output columns per program
    block_k: int                  # reduction step
    warps: int                    # warps per program
    stages: int                   # software-pipelining depth


def default_tiles(pairs_per_expert: float, element_size: int) -> MoeTiles:
    """Tiles for the average rows per expert: weight streaming (decode) vs matrix-bound (prefill);
    4-byte operands get a smaller prefill tile so the pipeline fits in shared memory."""
    if pairs_per_expert <= 16:
        return MoeTiles(16, 64, 128, 4, 4)
    if pairs_per_expert <= 48:
        return MoeTiles(32, 64, 128, 4, 4)
    return MoeTiles(128, 256, 64, 8, 4) if element_size <= 2 else MoeTiles(64, 128, 64, 4, 3)


def moe_experts(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """Routed experts (Triton), see `moe_experts_tiled`."""
    return moe_experts_tiled(x, up, down, topk_weights, topk_ids, None)


def moe_experts_tiled(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, tiles: MoeTiles | None) -> torch.Tensor:
    """Routed experts (Triton); tiles None picks `default_tiles`.
    x [T, d_in] (unit stride in d_in), up [E, I, d_in], down [E, d_in, I]
    (contiguous), topk_weights [T, k] (fp32), topk_ids [T, k] int64 -> sum_k w * down(relu(up(x))^2) [T, d_in]."""
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
    if up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"up/down must have x's dtype {x.dtype}, got {up.dtype}/{down.dtype}")
    check_inner_contiguous("x", x)
    if not (up.is_contiguous() and down.is_contiguous()):
        raise ValueError("up and down expert weights must be contiguous")
    check_same_device(x=x, up=up, down=down, topk_weights=topk_weights, topk_ids=topk_ids)
    top_k = topk_ids.shape[1]
    if T == 0:
        return torch.empty(0, d_in, dtype=x.dtype, device=x.device)
    cfg = tiles or default_tiles(T * top_k / E, x.element_size())
    bm, bn, bk, warps, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.warps, cfg.stages
    al = align_by_expert(topk_ids, E, bm)
    rows = al.sorted_pairs.numel()
    prec = dot_precision(x.dtype)
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    _up_kernel[(rows // bm, triton.cdiv(inter, bn))](
        x, up, al.sorted_pairs, al.block_expert, h, T * top_k, top_k, inter, d_in, x.stride(0), up.stride(0),
        up.stride(1), h.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=prec,
        num_warps=warps, num_stages=stages)
    y = torch.empty(T * top_k, d_in, dtype=x.dtype, device=x.device)
    w = topk_weights.to(torch.float32).contiguous()
    _down_kernel[(rows // bm, triton.cdiv(d_in, bn))](
        h, down, al.sorted_pairs, al.block_expert, w, y, T * top_k, d_in, inter, h.stride(0), down.stride(0),
        down.stride(1), y.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=prec,
        num_warps=warps, num_stages=stages)
    out = torch.empty(T, d_in, dtype=x.dtype, device=x.device)
    _sum_slots_kernel[(T, triton.cdiv(d_in, 1024))](y, out, top_k, d_in, BLOCK_K=block_dim(top_k, 1),
                                                    BLOCK_D=min(block_dim(d_in, 1), 1024), num_warps=4)
    return out
