"""Triton MoE experts: sorted-token grouped GEMMs (bf16 operands, fp32 accumulation), ReLU² between.

Same signature and semantics as `moe.moe_experts_ref`. Steps (no host sync, so a step can be graph-captured):
  1. `align_by_expert` (one Triton launch; `align_by_expert_ref` is the torch oracle): the T*k (token, slot)
     pairs sorted by expert (stable), each expert's run padded to a multiple of BLOCK_M with the sentinel T*k;
     `block_expert[b]` = expert of block b (-1 past the end).
  2. `_up_kernel`:   H[r] = relu(x[pair_r // k] @ up[e]^T)^2 for every sorted row r         [rows, I]
  3. `_down_kernel`: Y[pair_r] = w[pair_r] * (H[r] @ down[e]^T)                             [T*k, d_in]
  4. `_sum_slots_kernel`: out[t] = sum over the k slots of Y, in fp32, cast to x's dtype.
`moe_route` (re-exported here) is the one-launch Triton router of `triton_moe_route`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.engine.kernels.moe import ExpertAlignment, max_expert_blocks
from service.engine.kernels.tiles import BY_CHUNK_MAX, AlignTiles, MoeTiles, align_tiles, default_tiles, hist_bins
from service.engine.kernels.triton_common import (
    block_dim,
    check_dim,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    dot_precision,
    pdl_args,
    pdl_release,
    pdl_wait,
)
from service.engine.kernels.triton_moe_route import moe_route  # noqa: F401  (the backend's moe_route)


@triton.jit
def _expert_counts(ids_ptr, num_pairs, E, CHUNK: tl.constexpr, HIST: tl.constexpr):
    """Pairs per expert over all ids: [HIST] int32 (bins >= E are 0); the next chunk loads while one is counted."""
    counts = tl.zeros((HIST,), tl.int32)
    offs = tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E).to(tl.int32)  # E: an in-range spare bin
    for c0 in range(CHUNK, num_pairs + CHUNK, CHUNK):
        nxt = tl.load(ids_ptr + c0 + offs, mask=c0 + offs < num_pairs, other=E).to(tl.int32)
        counts += tl.histogram(ids, HIST)
        ids = nxt
    return tl.where(tl.arange(0, HIST) < E, counts, 0)


@triton.jit
def _write_expert_pairs(ids_ptr, pairs_ptr, num_pairs, mine, start, EPP: tl.constexpr, CHUNK: tl.constexpr):
    """Pair indices of experts `mine` [EPP] at start[e] + (stable rank among that expert's pairs)."""
    run = tl.zeros((EPP,), tl.int32)
    offs = tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    for c0 in range(CHUNK, num_pairs + CHUNK, CHUNK):
        nxt = tl.load(ids_ptr + c0 + offs, mask=c0 + offs < num_pairs, other=-1).to(tl.int32)
        match = (ids[:, None] == mine[None, :]).to(tl.int32)  # [CHUNK, EPP]
        rank = run[None, :] + tl.cumsum(match, axis=0) - 1
        tl.store(
            pairs_ptr + start[None, :] + rank,
            tl.broadcast_to((c0 - CHUNK + offs)[:, None], (CHUNK, EPP)),
            mask=match != 0,
        )
        run += tl.sum(match, axis=0)
        ids = nxt


@triton.jit
def _write_expert_padding(
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    block_m,
    mine,
    start,
    count,
    padded,
    EPP: tl.constexpr,
    BM_PAD: tl.constexpr,
    BFILL: tl.constexpr,
):
    """Runs [start, start + padded) of experts `mine`: sentinels after their pairs, block_expert of their blocks."""
    offs = tl.arange(0, BM_PAD)
    tl.store(
        pairs_ptr + (start + count)[:, None] + offs[None, :], num_pairs, mask=offs[None, :] < (padded - count)[:, None]
    )
    nb = padded // block_m
    for b0 in range(0, tl.max(nb, axis=0), BFILL):
        offs_b = b0 + tl.arange(0, BFILL)
        tl.store(
            block_expert_ptr + (start // block_m)[:, None] + offs_b[None, :],
            tl.broadcast_to(mine[:, None], (EPP, BFILL)),
            mask=offs_b[None, :] < nb[:, None],
        )


@triton.jit
def _fill_tail(pairs_ptr, block_expert_ptr, num_pairs, block_m, num_blocks, total, FILL: tl.constexpr):
    """This program's 1/num_programs share of the tail past the last run: sentinel pairs, block_expert -1."""
    nprog = tl.num_programs(0)
    span = tl.cdiv(num_blocks * block_m - total, nprog)
    lo = total + tl.program_id(0) * span
    hi = tl.minimum(lo + span, num_blocks * block_m)
    for r0 in range(lo, hi, FILL):
        offs = r0 + tl.arange(0, FILL)
        tl.store(pairs_ptr + offs, num_pairs, mask=offs < hi)
    span_b = tl.cdiv(num_blocks - total // block_m, nprog)
    lo_b = total // block_m + tl.program_id(0) * span_b
    hi_b = tl.minimum(lo_b + span_b, num_blocks)
    for b0 in range(lo_b, hi_b, FILL):
        offs = b0 + tl.arange(0, FILL)
        tl.store(block_expert_ptr + offs, -1, mask=offs < hi_b)


@triton.jit
def _pick(values, sel):
    """values [HIST] at the experts of sel [N, HIST] (one-hot rows): [N]."""
    return tl.sum(tl.where(sel, values[None, :], 0), axis=1)


@triton.jit
def _write_chunk_pairs(
    ids_ptr, pairs_ptr, num_pairs, E, starts, ids_all, offs_all, HIST: tl.constexpr, CHUNK: tl.constexpr
):
    """Pairs [p*CHUNK, (p+1)*CHUNK) at starts[e] + (pairs of e before the chunk) + (rank of e inside the chunk)."""
    lo = tl.program_id(0) * CHUNK
    before = tl.histogram(tl.where(offs_all < lo, ids_all, E), HIST)  # E: the spare bin
    mine = lo + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + mine, mask=mine < num_pairs, other=-1).to(tl.int32)
    base = _pick(starts + before, tl.arange(0, HIST)[None, :] == ids[:, None])
    ci = tl.arange(0, CHUNK)
    rank = tl.sum(((ids[None, :] == ids[:, None]) & (ci[None, :] < ci[:, None])).to(tl.int32), axis=1)
    tl.store(pairs_ptr + base + rank, mine, mask=mine < num_pairs)


@triton.jit
def _align_kernel(
    ids_ptr,
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    E,
    block_m,
    num_blocks,
    BY_CHUNK: tl.constexpr,
    EPP: tl.constexpr,
    CHUNK: tl.constexpr,
    TK_PAD: tl.constexpr,
    HIST: tl.constexpr,
    BM_PAD: tl.constexpr,
    BFILL: tl.constexpr,
    FILL: tl.constexpr,
):
    """Every program counts all pairs per expert (a histogram) and takes the run starts from the exclusive cumsum
    of the padded counts. BY_CHUNK (all ids in one [TK_PAD] tile): program p places the pairs of chunk p;
    else program p scans all ids for the pairs of its experts. Then program p writes the sentinels and blocks of
    experts [p*EPP, (p+1)*EPP) and a 1/num_programs share of the tail past the last run (sentinels, -1)."""
    if BY_CHUNK:
        offs_all = tl.arange(0, TK_PAD)
        ids_all = tl.load(ids_ptr + offs_all, mask=offs_all < num_pairs, other=E).to(tl.int32)
        counts = tl.where(tl.arange(0, HIST) < E, tl.histogram(ids_all, HIST), 0)
    else:
        counts = _expert_counts(ids_ptr, num_pairs, E, CHUNK, HIST)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = tl.cumsum(padded, axis=0) - padded
    mine = tl.program_id(0) * EPP + tl.arange(0, EPP)
    sel = tl.arange(0, HIST)[None, :] == mine[:, None]  # [EPP, HIST]
    my_start = _pick(starts, sel)
    if BY_CHUNK:
        _write_chunk_pairs(ids_ptr, pairs_ptr, num_pairs, E, starts, ids_all, offs_all, HIST, CHUNK)
    else:
        _write_expert_pairs(ids_ptr, pairs_ptr, num_pairs, mine, my_start, EPP, CHUNK)
    _write_expert_padding(
        pairs_ptr,
        block_expert_ptr,
        num_pairs,
        block_m,
        mine,
        my_start,
        _pick(counts, sel),
        _pick(padded, sel),
        EPP,
        BM_PAD,
        BFILL,
    )
    _fill_tail(pairs_ptr, block_expert_ptr, num_pairs, block_m, num_blocks, tl.sum(padded, axis=0), FILL)


def align_into(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    tiles: AlignTiles | None = None,
) -> ExpertAlignment:
    """`align_by_expert` into given buffers (every element is written); tiles None: `align_tiles`."""
    tk = topk_ids.numel()
    num_blocks = max_expert_blocks(tk, num_experts, block_m)
    check_shape("sorted_pairs", sorted_pairs, (num_blocks * block_m,))
    check_shape("block_expert", block_expert, (num_blocks,))
    if sorted_pairs.dtype != torch.int32 or block_expert.dtype != torch.int32:
        raise ValueError("sorted_pairs and block_expert must be int32")
    cfg = tiles or align_tiles(tk, num_experts)
    if cfg.by_chunk and tk > BY_CHUNK_MAX:
        raise ValueError(f"by_chunk alignment holds at most {BY_CHUNK_MAX} pairs, got {tk}")
    if cfg.chunk < 1 or cfg.chunk & (cfg.chunk - 1) or cfg.epp < 1 or cfg.epp & (cfg.epp - 1):
        raise ValueError(f"chunk and epp must be powers of two: {cfg}")
    if not cfg.by_chunk and cfg.chunk < 32 * cfg.warps:
        raise ValueError(f"a scan step must hold >= one id per lane (tl.histogram), chunk >= {32 * cfg.warps}: {cfg}")
    progs = triton.cdiv(num_experts, cfg.epp)
    if cfg.by_chunk:
        progs = max(progs, triton.cdiv(tk, cfg.chunk))
    _align_kernel[(progs,)](
        topk_ids.reshape(-1),
        sorted_pairs,
        block_expert,
        tk,
        num_experts,
        block_m,
        num_blocks,
        BY_CHUNK=cfg.by_chunk,
        EPP=cfg.epp,
        CHUNK=cfg.chunk,
        HIST=hist_bins(num_experts),
        TK_PAD=max(32 * cfg.warps, triton.next_power_of_2(tk)) if cfg.by_chunk else 1,  # >= one id per lane
        BM_PAD=triton.next_power_of_2(block_m),
        BFILL=min(256, triton.next_power_of_2(triton.cdiv(tk, block_m) + 1)),
        FILL=256,
        num_warps=cfg.warps,
    )
    return ExpertAlignment(sorted_pairs, block_expert, block_m)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """topk_ids [T, k] (ids in [0, num_experts)) -> the (token, slot) pairs grouped by expert in a
    stable order, each group padded to a multiple of block_m with the sentinel T*k, `max_expert_blocks` blocks
    (a fixed bound, no host sync); one Triton launch, equal to `align_by_expert_ref`."""
    check_dim("topk_ids", topk_ids, 2)
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64, got {topk_ids.dtype}")
    topk_ids = topk_ids.contiguous()  # the router's output already is: no copy
    num_blocks = max_expert_blocks(topk_ids.numel(), num_experts, block_m)
    dev = topk_ids.device
    return align_into(
        topk_ids,
        num_experts,
        block_m,
        torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev),
        torch.empty(num_blocks, dtype=torch.int32, device=dev),
    )


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
):
    """acc [BLOCK_M, BLOCK_N] fp32 = A @ W[e]^T over k_in: A's rows at the pointers a_rows [BLOCK_M, 1] (unit
    stride along k_in; rows where `valid`), expert e's weight rows of n-block program_id(1). Also returns the
    output columns offs_n and their mask."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < k_in
        a = tl.load(a_rows + offs_k[None, :], mask=valid[:, None] & mk[None, :], other=0.0)
        b = tl.load(
            w_ptr + e * s_w_e + offs_n[None, :] * s_w_n + offs_k[:, None], mask=mn[None, :] & mk[:, None], other=0.0
        )
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    return acc, offs_n, mn


@triton.jit
def _up_kernel(
    x_ptr,
    w_ptr,
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
    )
    acc = tl.maximum(acc, 0.0)
    acc = acc * acc
    tl.store(
        h_ptr + offs_m.to(tl.int64)[:, None] * s_h_r + offs_n[None, :],
        acc.to(h_ptr.dtype.element_ty),
        mask=valid[:, None] & mn[None, :],
    )


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
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
    )
    wt = tl.load(topk_w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
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
) -> torch.Tensor:
    """Routed experts (Triton); tiles None picks `default_tiles`.
    x [T, d_in] (unit stride in d_in), up [E, I, d_in], down [E, d_in, I]
    (contiguous), topk_weights [T, k] (fp32), topk_ids [T, k] int64 -> sum_k w * down(relu(up(x))^2) [T, d_in]."""
    T, d_in, E, inter, top_k = check_experts_args(x, up, down, topk_weights, topk_ids)
    if T == 0:
        return torch.empty(0, d_in, dtype=x.dtype, device=x.device)
    cfg = tiles or default_tiles(T * top_k / E, x.element_size())
    bm, bn, bk, warps, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.warps, cfg.stages
    al = align_by_expert(topk_ids, E, bm)
    rows = al.sorted_pairs.numel()
    prec = dot_precision(x.dtype)
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    _up_kernel[(rows // bm, triton.cdiv(inter, bn))](
        x,
        up,
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
        num_warps=warps,
        num_stages=stages,
    )
    y = torch.empty(T * top_k, d_in, dtype=x.dtype, device=x.device)
    w = topk_weights.to(torch.float32).contiguous()
    _down_kernel[(rows // bm, triton.cdiv(d_in, bn))](
        h,
        down,
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
    x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """Shape/dtype/device checks of the routed-experts ops; returns (T, d_in, E, I, top_k)."""
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
    return T, d_in, E, inter, topk_ids.shape[1]
