"""Triton MoE experts for a handful of (token, slot) pairs (batch-1/2 decode) as grouped GEMVs.

Same signature and semantics as `moe.moe_experts_ref` and `triton_moe.moe_experts` (h and the per-slot outputs are
rounded to x's dtype at the same points as the tiled path). At batch 1 the tiled path runs 16-row tiles with one
valid row per expert; here there is no alignment and no padding: program (p, j) of the up pass streams BLOCK_N rows
of `up[ids[p]]` against token p // k's x and writes relu(.)² of them; program (p, j) of the down pass streams
BLOCK_N rows of `down[ids[p]]` against that h row, times the pair's routing weight. Each program keeps fp32 partial
products in a [BLOCK_N, BLOCK_K] register tile with the next step's tile loaded before this step's FMAs
(`triton_gemv.dot_tiles`, one reduction at the end). The k slots of a token are then summed by `triton_moe.sum_slots`.
Weight bytes are read once per pair, so the tiled path (one read per expert) wins as soon as pairs share experts:
this path is for T * k up to MAX_GEMV_PAIRS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from service.engine.kernels.triton_gemv import dot_tiles
from service.engine.kernels import triton_moe
from service.engine.kernels.triton_moe import check_experts_args, sum_slots

MAX_GEMV_PAIRS = 16          # (token, slot) pairs up to which `moe_experts_gemv` accepts a batch


@dataclass(frozen=True)
class ExpertGemvTiles:
    """Launch shape of both grouped-GEMV passes."""
    block_n: int = 4             # weight rows (outputs) per program
    block_k: int = 512           # reduction elements per step (16-byte loads of bf16)
    warps: int = 4               # warps per program


EXPERT_GEMV_TILE_VARIANTS = (ExpertGemvTiles(), ExpertGemvTiles(8, 256, 4), ExpertGemvTiles(8, 512, 4),
                             ExpertGemvTiles(4, 1024, 4), ExpertGemvTiles(16, 256, 8))


@triton.jit
def _pair_rows(ids_ptr, n_out, BLOCK_N: tl.constexpr):
    """Program (p, j): pair p, its expert e, output rows offs_n of block j and the weight rows they read (clamped
    to n_out - 1: loads stay unmasked, the stores are masked)."""
    p = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return p, tl.load(ids_ptr + p).to(tl.int64), offs_n, tl.minimum(offs_n, n_out - 1).to(tl.int64)


@triton.jit
def _expert_up_kernel(x_ptr, w_ptr, ids_ptr, h_ptr, top_k, n_out, K, s_x, s_w_e, s_h,
                      EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p, e, offs_n, rows = _pair_rows(ids_ptr, n_out, BLOCK_N)
    r, _, _, _ = dot_tiles(w_ptr + e * s_w_e + rows[:, None] * K, x_ptr + (p // top_k).to(tl.int64) * s_x, 0, 0,
                           K, K, 1, EVEN_K, True, BLOCK_N, BLOCK_K)
    r = tl.sum(r, axis=1)
    r = tl.maximum(r, 0.0)
    tl.store(h_ptr + p.to(tl.int64) * s_h + offs_n, (r * r).to(h_ptr.dtype.element_ty), mask=offs_n < n_out)


@triton.jit
def _expert_down_kernel(h_ptr, w_ptr, ids_ptr, topk_w_ptr, y_ptr, n_out, K, s_h, s_w_e, s_y,
                        EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p, e, offs_n, rows = _pair_rows(ids_ptr, n_out, BLOCK_N)
    r, _, _, _ = dot_tiles(w_ptr + e * s_w_e + rows[:, None] * K, h_ptr + p.to(tl.int64) * s_h, 0, 0, K, K, 1,
                           EVEN_K, True, BLOCK_N, BLOCK_K)
    r = tl.sum(r, axis=1)
    r = r * tl.load(topk_w_ptr + p).to(tl.float32)
    tl.store(y_ptr + p.to(tl.int64) * s_y + offs_n, r.to(y_ptr.dtype.element_ty), mask=offs_n < n_out)


def moe_experts_gemv(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, tiles: ExpertGemvTiles | None = None) -> torch.Tensor:
    """Routed experts as grouped GEMVs (Triton) for T * k <= MAX_GEMV_PAIRS pairs.
    x [T, d_in] (unit stride in d_in), up [E, I, d_in], down [E, d_in, I] (contiguous), topk_weights [T, k]
    (fp32), topk_ids [T, k] -> sum_k w * down(relu(up(x))^2) [T, d_in] in x's dtype."""
    T, d_in, E, inter, top_k = check_experts_args(x, up, down, topk_weights, topk_ids)
    pairs = T * top_k
    if pairs > MAX_GEMV_PAIRS:
        raise ValueError(f"moe_experts_gemv takes up to {MAX_GEMV_PAIRS} (token, slot) pairs, got {pairs}: "
                         "use triton_moe.moe_experts")
    if T == 0:
        return torch.empty(0, d_in, dtype=x.dtype, device=x.device)
    t = tiles or ExpertGemvTiles()
    ids = topk_ids.reshape(-1).contiguous()
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _expert_up_kernel[(pairs, triton.cdiv(inter, t.block_n))](
        x, up, ids, h, top_k, inter, d_in, x.stride(0), up.stride(0), h.stride(0), EVEN_K=d_in % t.block_k == 0,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.warps, num_stages=1)
    y = torch.empty(pairs, d_in, dtype=x.dtype, device=x.device)
    w = topk_weights.to(torch.float32).reshape(-1).contiguous()
    _expert_down_kernel[(pairs, triton.cdiv(d_in, t.block_n))](
        h, down, ids, w, y, d_in, inter, h.stride(0), down.stride(0), y.stride(0), EVEN_K=inter % t.block_k == 0,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.warps, num_stages=1)
    return sum_slots(y, T, top_k)


def moe_experts_by_size(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """Routed experts (Triton), chosen by shape alone: the grouped GEMVs above for T * k <= MAX_GEMV_PAIRS (batch-1/2
    decode: no alignment launch, no padded rows), else `triton_moe.moe_experts` (sorted-token grouped GEMMs).
    Same signature and shapes as `moe.moe_experts_ref`."""
    if topk_ids.numel() <= MAX_GEMV_PAIRS:
        return moe_experts_gemv(x, up, down, topk_weights, topk_ids)
    return triton_moe.moe_experts(x, up, down, topk_weights, topk_ids)
