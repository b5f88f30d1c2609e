"""Triton MoE router: fp32 router logits, sigmoid, (group-limited) top-k and weights in ONE kernel launch.

Same signature, semantics and dtypes as `moe.moe_route_ref`:
  s = sigmoid(h @ W^T) in fp32 with exact fp32 products ('ieee' tl.dot or a plain multiply-accumulate, never TF32),
  choice = s + bias; with n_group > 1 only the topk_group groups with the largest sum of their top-2 choices stay;
  top-k of choice by repeated argmax (ties: lowest index); weights = s at the picked experts, / (sum + 1e-20) if
  norm_topk_prob, * scaling.
Grid (token blocks, expert slices): program (i, j) writes s for BLOCK_T tokens x BLOCK_E experts into a scratch
[T, E]. With one slice per token block that program selects right away; with several, each slice program bumps an
acq_rel counter of its token block (zeroed by the launcher) and the last one to arrive reads the full rows back
(L2 loads) and selects. Slicing the experts spreads the gate weight over many SMs (decode is a GEMV: one program
streaming all of W would be bandwidth-bound on one SM). T <= 64: multiply-accumulate on [BLOCK_T, 4, BLOCK_K]
tiles; larger T: an 'ieee' tl.dot on [16 or 64, >= 16] tiles. No host sync: graph-capturable.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from service.engine.kernels.triton_common import (TARGET_PROGRAMS, block_dim, check_dim, check_inner_contiguous,
                                                  check_same_device, check_shape)

MAX_EXPERTS = 1024          # the selection holds a [rows, next_pow2(E)] tile in registers
SELECT_TILE = 2048          # rows * padded experts per selection step


@triton.jit
def _gate_scores(h_ptr, w_ptr, offs_t, offs_e, mt, me, d, s_h, s_w,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr):
    """sigmoid(h[offs_t] . W[offs_e]) in fp32, exact fp32 products: [BLOCK_T, BLOCK_E]."""
    h_rows = h_ptr + offs_t.to(tl.int64)[:, None] * s_h
    w_rows = offs_e.to(tl.int64) * s_w
    if USE_DOT:
        acc = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
        for k0 in range(0, d, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < d
            a = tl.load(h_rows + offs_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
            b = tl.load(w_ptr + w_rows[None, :] + offs_k[:, None], mask=me[None, :] & mk[:, None],
                        other=0.0).to(tl.float32)
            acc += tl.dot(a, b, input_precision="ieee")
    else:
        acc3 = tl.zeros((BLOCK_T, BLOCK_E, BLOCK_K), tl.float32)
        for k0 in range(0, d, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < d
            a = tl.load(h_rows + offs_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
            b = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :], mask=me[:, None] & mk[None, :],
                        other=0.0).to(tl.float32)
            acc3 += a[:, None, :] * b[None, :, :]
        acc = tl.sum(acc3, axis=2)
    return tl.sigmoid(acc)


@triton.jit
def _argmax_lowest(v, avail, cols, E_PAD: tl.constexpr):
    """Per row: index of the largest v among avail (ties and all -inf: the lowest available index)."""
    v = tl.where(avail, v, float("-inf"))
    m = tl.max(v, axis=1)
    return tl.min(tl.where(avail & (v == m[:, None]), cols[None, :], E_PAD), axis=1)


@triton.jit
def _group_limit(choice, avail, cols, n_group, topk_group, group_size, SEL_T: tl.constexpr, E_PAD: tl.constexpr,
                 G_PAD: tl.constexpr):
    """avail restricted to the topk_group groups with the largest (top-1 + top-2) choice."""
    grp = cols // group_size
    gcols = tl.arange(0, G_PAD)
    gscore = tl.full((SEL_T, G_PAD), float("-inf"), tl.float32)
    for g in range(n_group):
        in_g = avail & (grp == g)[None, :]
        i1 = _argmax_lowest(choice, in_g, cols, E_PAD)
        top1 = tl.max(tl.where(in_g, choice, float("-inf")), axis=1)
        top2 = tl.max(tl.where(in_g & (cols[None, :] != i1[:, None]), choice, float("-inf")), axis=1)
        gscore = tl.where(gcols[None, :] == g, (top1 + top2)[:, None], gscore)
    gavail = tl.broadcast_to((gcols < n_group)[None, :], (SEL_T, G_PAD))
    keep = avail & (cols < 0)[None, :]
    for _ in range(topk_group):
        gi = _argmax_lowest(gscore, gavail, gcols, G_PAD)
        gavail = gavail & (gcols[None, :] != gi[:, None])
        keep = keep | (grp[None, :] == gi[:, None])
    return avail & keep


@triton.jit
def _select_rows(s_ptr, bias_ptr, w_out_ptr, ids_ptr, row0, T, E, s_b, top_k, n_group, topk_group, scaling,
                 SEL_T: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, G_PAD: tl.constexpr,
                 GROUPED: tl.constexpr, NORM: tl.constexpr):
    """Top-k of rows [row0, row0 + SEL_T) of the scratch s [T, E]; writes weights and ids [T, top_k]."""
    rows = row0 + tl.arange(0, SEL_T)
    cols = tl.arange(0, E_PAD)
    mr = rows < T
    mc = cols < E
    s = tl.load(s_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], mask=mr[:, None] & mc[None, :], other=0.0,
                cache_modifier=".cg")
    choice = s + tl.load(bias_ptr + cols * s_b, mask=mc, other=0.0).to(tl.float32)[None, :]
    avail = mc[None, :] & (rows >= 0)[:, None]
    if GROUPED:
        avail = _group_limit(choice, avail, cols, n_group, topk_group, E // n_group, SEL_T, E_PAD, G_PAD)
    kcols = tl.arange(0, K_PAD)
    ids = tl.zeros((SEL_T, K_PAD), tl.int32)
    w = tl.zeros((SEL_T, K_PAD), tl.float32)
    for j in range(top_k):
        idx = _argmax_lowest(choice, avail, cols, E_PAD)
        pick = cols[None, :] == idx[:, None]
        ids = tl.where(kcols[None, :] == j, idx[:, None], ids)
        w = tl.where(kcols[None, :] == j, tl.sum(tl.where(pick, s, 0.0), axis=1)[:, None], w)
        avail = avail & ~pick
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    w = w * scaling
    out = rows.to(tl.int64)[:, None] * top_k + kcols[None, :]
    mk = mr[:, None] & (kcols < top_k)[None, :]
    tl.store(w_out_ptr + out, w, mask=mk)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=mk)


@triton.jit
def _moe_route_kernel(h_ptr, w_ptr, bias_ptr, s_ptr, count_ptr, w_out_ptr, ids_ptr,
                      T, E, d, s_h, s_w, s_b, top_k, n_group, topk_group, scaling,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                      N_SPLIT: tl.constexpr, SEL_T: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                      G_PAD: tl.constexpr, GROUPED: tl.constexpr, NORM: tl.constexpr):
    pid_t = tl.program_id(0)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    mt = offs_t < T
    me = offs_e < E
    s = _gate_scores(h_ptr, w_ptr, offs_t, offs_e, mt, me, d, s_h, s_w, BLOCK_T, BLOCK_E, BLOCK_K, USE_DOT)
    tl.store(s_ptr + offs_t.to(tl.int64)[:, None] * E + offs_e[None, :], s, mask=mt[:, None] & me[None, :])
    tl.debug_barrier()          # every thread's stores are done before the read-back / the counter
    if N_SPLIT == 1:
        for r0 in range(0, BLOCK_T, SEL_T):
            _select_rows(s_ptr, bias_ptr, w_out_ptr, ids_ptr, pid_t * BLOCK_T + r0, T, E, s_b, top_k, n_group,
                         topk_group, scaling, SEL_T, E_PAD, K_PAD, G_PAD, GROUPED, NORM)
    else:
        arrived = tl.atomic_add(count_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        if arrived == N_SPLIT - 1:          # the last slice of this token block: every s row is in L2
            for r0 in range(0, BLOCK_T, SEL_T):
                _select_rows(s_ptr, bias_ptr, w_out_ptr, ids_ptr, pid_t * BLOCK_T + r0, T, E, s_b, top_k, n_group,
                             topk_group, scaling, SEL_T, E_PAD, K_PAD, G_PAD, GROUPED, NORM)


@dataclass(frozen=True)
class RouteTiles:
    """Launch shape of the router."""
    block_t: int                  # tokens per program
    block_e: int                  # experts per program (a slice of the padded experts)
    block_k: int                  # reduction step over the hidden size
    use_dot: bool                 # 'ieee' tl.dot (block_t, block_e >= 16) or a multiply-accumulate
    warps: int


def route_tiles(T: int, e_pad: int) -> RouteTiles:
    """Decode (T <= 64): 4-expert slices so the gate weight streams through E/4 programs; larger T: 'ieee' dots
    on 16-token (64 past 1024 tokens) blocks, the experts split in a power of two of slices (<= e_pad / 16) so that
    there are at most about TARGET_PROGRAMS programs (T=8192, E=128: 128 x 2 programs of 64 x 64)."""
    if T <= 64:
        bt = min(8, triton.next_power_of_2(T))
        return RouteTiles(bt, 4, max(32, min(512, 2048 // (4 * bt))), False, 4)
    bt = 16 if T <= 1024 else 64
    n_split = min(e_pad // 16, 1 << (max(1, TARGET_PROGRAMS // triton.cdiv(T, bt)).bit_length() - 1))
    be = e_pad // n_split
    return RouteTiles(bt, be, 32, True, 8 if bt * be >= 8192 else 4)


def _check_route_args(h, gate_weight, correction_bias, top_k, n_group, topk_group) -> None:
    check_dim("h", h, 2)
    check_dim("gate_weight", gate_weight, 2)
    E = gate_weight.shape[0]
    check_shape("gate_weight", gate_weight, (E, h.shape[1]))
    check_shape("correction_bias", correction_bias, (E,))
    check_inner_contiguous("h", h)
    check_inner_contiguous("gate_weight", gate_weight)
    check_same_device(h=h, gate_weight=gate_weight, correction_bias=correction_bias)
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"number of experts must be in [1, {MAX_EXPERTS}], got {E}")
    if n_group < 1 or E % n_group or (n_group > 1 and E // n_group < 2):
        raise ValueError(f"n_group={n_group} must divide E={E} into groups of >= 2 experts")
    if n_group > 1 and not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    kept = E if n_group == 1 else topk_group * (E // n_group)
    if not 1 <= top_k <= kept:
        raise ValueError(f"top_k={top_k} must be in [1, {kept}] (experts left after the group limit)")


def moe_route(h: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
              n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, d] (bf16/fp16/fp32, unit stride in d), gate_weight [E, d] (unit stride in d), correction_bias [E]
    -> (topk_weights [T, top_k] fp32, topk_ids [T, top_k] int64), one Triton launch (+ a zero fill of one int32
    counter per token block when the experts are split across programs)."""
    _check_route_args(h, gate_weight, correction_bias, top_k, n_group, topk_group)
    T, d = h.shape
    E = gate_weight.shape[0]
    dev = h.device
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=dev)
    if T == 0:
        return weights, ids
    e_pad = block_dim(E, 16)
    cfg = route_tiles(T, e_pad)
    n_tb, n_split = triton.cdiv(T, cfg.block_t), e_pad // cfg.block_e
    s = torch.empty(T, E, dtype=torch.float32, device=dev)
    if n_split > 1:             # one arrival counter per token block
        counts = torch.zeros(n_tb, dtype=torch.int32, device=dev)
    else:
        counts = torch.empty(1, dtype=torch.int32, device=dev)
    _moe_route_kernel[(n_tb, n_split)](
        h, gate_weight, correction_bias, s, counts, weights, ids, T, E, d, h.stride(0), gate_weight.stride(0),
        correction_bias.stride(0), top_k, n_group, topk_group, float(scaling),
        BLOCK_T=cfg.block_t, BLOCK_E=cfg.block_e, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot, N_SPLIT=n_split,
        SEL_T=max(1, min(cfg.block_t, SELECT_TILE // e_pad)), E_PAD=e_pad, K_PAD=triton.next_power_of_2(top_k),
        G_PAD=triton.next_power_of_2(n_group), GROUPED=n_group > 1, NORM=bool(norm_topk_prob),
        num_warps=cfg.warps, num_stages=2)
    return weights, ids
