"""Expert alignment for the sorted-token grouped GEMMs (`triton_moe`): the T*k (token, slot) pairs grouped by expert
in a stable order, each expert's run padded to a multiple of block_m, in one Triton launch with no host sync
(`align_by_expert`; `moe.align_by_expert_ref` is the torch oracle)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.engine.kernels.moe import ExpertAlignment, max_expert_blocks
from service.engine.kernels.tiles import BY_CHUNK_MAX, AlignTiles, align_tiles, hist_bins
from service.engine.kernels.triton_common import check_dim, check_shape


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


@triton.jit(do_not_specialize=("num_pairs", "num_blocks"))  # per-step sizes: triton_common's docstring
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
