"""Triton MoE router: fp32 router logits, sigmoid, (group-limited) top-k and weights in one kernel launch (or two).

Same signature, semantics and dtypes as `moe.moe_route_ref`:
  s = sigmoid(h @ W^T) with exact products summed in fp32 (never TF32), choice = s + bias; with n_group > 1 only
  the topk_group groups with the largest sum of their top-2 choices stay; top-k of choice (ties: lowest index);
  weights = s at the picked experts, / (sum + 1e-20) if norm_topk_prob, * scaling.
Grid (token blocks, expert slices, K slices): program (i, j, c) writes the partial logits of BLOCK_T tokens x
BLOCK_E experts over its K slice into a scratch [K slices, T, E]; each bumps an acq_rel arrival counter of its
token block (none when a token block has a single program) and the last to arrive sums the partials in a fixed
order (L2 loads), applies the sigmoid, selects and sets the counter back to 0. The counters are a fresh zeroed
buffer (one memset launch) unless the caller passes a persistent zeroed one (`counters`; the triton bundle passes
its `ArrivalCounters`), which every launch leaves zeroed. The counter is bumped only after `pdl_wait` (the kernel's
first statement), so a PDL launch never touches it before its predecessor finished. Splitting experts AND the
hidden size spreads the gate weight over ~100-300 programs (decode is a GEMV: one SM streams only a few tens of GB/s).
Products, by `RouteTiles.mode`:
  "fma"    multiply-accumulate on [BLOCK_T, BLOCK_E, BLOCK_K] tiles, K_STEPS unrolled (decode: loads all in flight);
  "ieee"   fp32 tl.dot with input_precision="ieee" (exact fp32 products on the CUDA cores);
  "bf16x3" bf16 h only: W = W1 + W2 + W3 exactly with three bf16 parts (8 significant bits each), so the three
           bf16 tensor-core dots have exact products summed in fp32 (only the summation order differs from fp32).
The top-k packs (order-preserving int of the fp32 choice, E_PAD - 1 - index) into one int64 per expert: one max
reduction per pick, ties to the lowest index. No host sync: graph-capturable.
Two launches (`RouteTiles.select_rows` > 0): the logits kernel only writes the partials (no counters, no selection
code: fewer registers, more programs per SM), then `_route_select_kernel` sums them and selects select_rows rows per
program, so the selection of a large batch runs on ~T / select_rows programs instead of one per token block (PDL
between the two where available).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.engine.kernels.tiles import RouteTiles, route_tiles
from service.engine.kernels.triton_common import (
    block_dim,
    check_dim,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    pdl_args,
    pdl_release,
    pdl_wait,
)
from service.engine.kernels.triton_gemv import arrival_counters, check_counters

MAX_EXPERTS = 1024  # the selection holds a [rows, next_pow2(E)] tile in registers
SELECT_TILE = 2048  # rows * padded experts per selection step (int64 keys)
WEIGHT_TILE = 8192  # rows * padded top_k * padded experts (the weight gather)
REDUCE_TILE = 8192  # K slices * rows * padded experts per partial-sum load
MODES = {"fma": 0, "ieee": 1, "bf16x3": 2}
SELECT_WARPS = 4  # warps of `_route_select_kernel` (two launches)


@triton.jit
def _fma_logits(
    h_rows,
    w_rows,
    k0,
    d,
    mt,
    me,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr,
):
    """h[rows, k0:k0+K_STEPS*BLOCK_K] . W[experts, same] in fp32 by multiply-accumulate: [BLOCK_T, BLOCK_E]."""
    acc3 = tl.zeros((BLOCK_T, BLOCK_E, BLOCK_K), tl.float32)
    for i in tl.static_range(K_STEPS):
        offs_k = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
        mk = offs_k < d
        a = tl.load(h_rows + offs_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
        b = tl.load(w_rows[:, None] + offs_k[None, :], mask=me[:, None] & mk[None, :], other=0.0).to(tl.float32)
        acc3 += a[:, None, :] * b[None, :, :]
    return tl.sum(acc3, axis=2)


@triton.jit
def _dot_logits(
    h_rows,
    w_rows,
    k0,
    d,
    mt,
    me,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr,
    SPLIT_BF16: tl.constexpr,
    DOT_TY: tl.constexpr,
):
    """Same as `_fma_logits` with tl.dot: 'ieee' fp32, or bf16 h times the exact three-part bf16 split of W
    (DOT_TY bf16; fp32 in the CPU interpreter, whose tl.dot multiplies the raw bits of bf16 operands)."""
    acc = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    acc_lo = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for i in range(K_STEPS):
        offs_k = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
        mk = offs_k < d
        a = tl.load(h_rows + offs_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        b = tl.load(w_rows[None, :] + offs_k[:, None], mask=me[None, :] & mk[:, None], other=0.0).to(tl.float32)
        if SPLIT_BF16:
            b1 = b.to(tl.bfloat16)
            r = b - b1.to(tl.float32)  # exact: b1 is b rounded to 8 significant bits
            b2 = r.to(tl.bfloat16)
            b3 = (r - b2.to(tl.float32)).to(tl.bfloat16)  # the last <= 8 bits: exact in bf16
            a = a.to(DOT_TY)
            acc = tl.dot(a, b1.to(DOT_TY), acc)
            acc_lo = tl.dot(a, b2.to(DOT_TY), acc_lo)
            acc_lo = tl.dot(a, b3.to(DOT_TY), acc_lo)
        else:
            acc = tl.dot(a.to(tl.float32), b, acc, input_precision="ieee")
    return acc + acc_lo


@triton.jit
def _argmax_lowest(v, avail, cols, E_PAD: tl.constexpr):
    """Per row: index of the largest v among avail (ties and all -inf: the lowest available index)."""
    v = tl.where(avail, v, float("-inf"))
    m = tl.max(v, axis=1)
    return tl.min(tl.where(avail & (v == m[:, None]), cols[None, :], E_PAD), axis=1)


@triton.jit
def _group_limit(
    choice, avail, cols, n_group, topk_group, group_size, SEL_T: tl.constexpr, E_PAD: tl.constexpr, G_PAD: tl.constexpr
):
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
def _top_k_ids(choice, avail, cols, top_k, SEL_T: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """[SEL_T, K_PAD] int32: the top_k available experts by choice, best first (ties: lowest index), -1 past top_k.
    key = (order-preserving int32 of choice) << 32 | (E_PAD - 1 - index): one int64 max per pick."""
    bits = tl.where(choice == 0.0, 0.0, choice).to(tl.int32, bitcast=True)  # -0.0 ties +0.0
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order = float order (non-NaN)
    low = (E_PAD - 1 - cols).to(tl.int64)[None, :]
    dead = (tl.zeros((SEL_T, E_PAD), tl.int32) - 2147483647 - 1).to(tl.int64) << 32 | low  # below any float
    key = tl.where(avail, bits.to(tl.int64) << 32 | low, dead)
    kcols = tl.arange(0, K_PAD)
    ids = tl.full((SEL_T, K_PAD), -1, tl.int32)
    for j in range(top_k):
        idx = (E_PAD - 1) - (tl.max(key, axis=1) & 0xFFFF).to(tl.int32)
        ids = tl.where(kcols[None, :] == j, idx[:, None], ids)
        key = tl.where(cols[None, :] == idx[:, None], dead, key)
    return ids


@triton.jit
def _row_logits(
    part_ptr, rows, cols, mr, mc, T, E, n_ks, SEL_T: tl.constexpr, KS_TILE: tl.constexpr, E_PAD: tl.constexpr
):
    """Sum over the K slices of the partial logits of rows x cols (fixed order: deterministic)."""
    acc = tl.zeros((SEL_T, E_PAD), tl.float32)
    for k0 in range(0, n_ks, KS_TILE):
        ks = k0 + tl.arange(0, KS_TILE)
        off = (ks.to(tl.int64)[:, None, None] * T + rows[None, :, None]) * E + cols[None, None, :]
        m = (ks < n_ks)[:, None, None] & (mr[:, None] & mc[None, :])[None, :, :]
        acc += tl.sum(tl.load(part_ptr + off, mask=m, other=0.0, cache_modifier=".cg"), axis=0)
    return acc


@triton.jit
def _select_rows(
    part_ptr,
    bias_ptr,
    w_out_ptr,
    ids_ptr,
    row0,
    T,
    E,
    n_ks,
    s_b,
    top_k,
    n_group,
    topk_group,
    scaling,
    SEL_T: tl.constexpr,
    KS_TILE: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    G_PAD: tl.constexpr,
    GROUPED: tl.constexpr,
    NORM: tl.constexpr,
):
    """Top-k of rows [row0, row0 + SEL_T): writes weights and ids [T, top_k]."""
    rows = row0 + tl.arange(0, SEL_T)
    cols = tl.arange(0, E_PAD)
    mr = rows < T
    mc = cols < E
    bias = tl.load(bias_ptr + cols * s_b, mask=mc, other=0.0).to(tl.float32)  # issued with the partials
    s = tl.sigmoid(_row_logits(part_ptr, rows, cols, mr, mc, T, E, n_ks, SEL_T, KS_TILE, E_PAD))
    choice = s + bias[None, :]
    avail = mc[None, :] & (rows >= 0)[:, None]
    if GROUPED:
        avail = _group_limit(choice, avail, cols, n_group, topk_group, E // n_group, SEL_T, E_PAD, G_PAD)
    ids = _top_k_ids(choice, avail, cols, top_k, SEL_T, E_PAD, K_PAD)
    w = tl.sum(tl.where(cols[None, None, :] == ids[:, :, None], s[:, None, :], 0.0), axis=2)  # 0 past top_k
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    w = w * scaling
    kcols = tl.arange(0, K_PAD)
    out = rows.to(tl.int64)[:, None] * top_k + kcols[None, :]
    mk = mr[:, None] & (kcols < top_k)[None, :]
    tl.store(w_out_ptr + out, w, mask=mk)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=mk)


@triton.jit
def _select_block(
    part_ptr,
    bias_ptr,
    w_out_ptr,
    ids_ptr,
    pid_t,
    T,
    E,
    n_ks,
    s_b,
    top_k,
    n_group,
    topk_group,
    scaling,
    BLOCK_T: tl.constexpr,
    SEL_T: tl.constexpr,
    KS_TILE: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    G_PAD: tl.constexpr,
    GROUPED: tl.constexpr,
    NORM: tl.constexpr,
):
    for r0 in range(0, BLOCK_T, SEL_T):
        _select_rows(
            part_ptr,
            bias_ptr,
            w_out_ptr,
            ids_ptr,
            pid_t * BLOCK_T + r0,
            T,
            E,
            n_ks,
            s_b,
            top_k,
            n_group,
            topk_group,
            scaling,
            SEL_T,
            KS_TILE,
            E_PAD,
            K_PAD,
            G_PAD,
            GROUPED,
            NORM,
        )


@triton.jit(do_not_specialize=("T",))  # per-step sizes: triton_common's docstring
def _moe_route_kernel(
    h_ptr,
    w_ptr,
    bias_ptr,
    part_ptr,
    count_ptr,
    w_out_ptr,
    ids_ptr,
    T,
    E,
    d,
    s_h,
    s_w,
    s_b,
    top_k,
    n_group,
    topk_group,
    scaling,
    MODE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr,
    N_ARRIVE: tl.constexpr,
    SEL_T: tl.constexpr,
    KS_TILE: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    G_PAD: tl.constexpr,
    GROUPED: tl.constexpr,
    NORM: tl.constexpr,
    DOT_TY: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    mt = offs_t < T
    me = offs_e < E
    h_rows = h_ptr + offs_t.to(tl.int64)[:, None] * s_h
    w_rows = w_ptr + offs_e.to(tl.int64) * s_w
    k0 = pid_k * (BLOCK_K * K_STEPS)
    if MODE == 0:
        acc = _fma_logits(h_rows, w_rows, k0, d, mt, me, BLOCK_T, BLOCK_E, BLOCK_K, K_STEPS)
    else:
        acc = _dot_logits(h_rows, w_rows, k0, d, mt, me, BLOCK_T, BLOCK_E, BLOCK_K, K_STEPS, MODE == 2, DOT_TY)
    pdl_release(PDL)
    tl.store(
        part_ptr + (pid_k * T + offs_t.to(tl.int64))[:, None] * E + offs_e[None, :], acc, mask=mt[:, None] & me[None, :]
    )
    if N_ARRIVE == 0:  # two launches: `_route_select_kernel` sums and selects
        return
    tl.debug_barrier()  # every thread's stores are done before the read-back / the counter
    if N_ARRIVE == 1:
        _select_block(
            part_ptr,
            bias_ptr,
            w_out_ptr,
            ids_ptr,
            pid_t,
            T,
            E,
            tl.num_programs(2),
            s_b,
            top_k,
            n_group,
            topk_group,
            scaling,
            BLOCK_T,
            SEL_T,
            KS_TILE,
            E_PAD,
            K_PAD,
            G_PAD,
            GROUPED,
            NORM,
        )
    else:
        arrived = tl.atomic_add(count_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        if arrived == N_ARRIVE - 1:  # the last program of this token block: every partial is in L2
            _select_block(
                part_ptr,
                bias_ptr,
                w_out_ptr,
                ids_ptr,
                pid_t,
                T,
                E,
                tl.num_programs(2),
                s_b,
                top_k,
                n_group,
                topk_group,
                scaling,
                BLOCK_T,
                SEL_T,
                KS_TILE,
                E_PAD,
                K_PAD,
                G_PAD,
                GROUPED,
                NORM,
            )
            tl.store(count_ptr + pid_t, 0)  # leaves a persistent counter buffer zeroed for the next launch


@triton.jit(do_not_specialize=("T",))  # per-step sizes: triton_common's docstring
def _route_select_kernel(
    part_ptr,
    bias_ptr,
    w_out_ptr,
    ids_ptr,
    T,
    E,
    n_ks,
    s_b,
    top_k,
    n_group,
    topk_group,
    scaling,
    SEL_T: tl.constexpr,
    KS_TILE: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    G_PAD: tl.constexpr,
    GROUPED: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows [program_id(0) * SEL_T, + SEL_T): the n_ks partial logits summed, sigmoid, top-k, weights."""
    pdl_wait(PDL)
    pdl_release(PDL)
    _select_rows(
        part_ptr,
        bias_ptr,
        w_out_ptr,
        ids_ptr,
        tl.program_id(0) * SEL_T,
        T,
        E,
        n_ks,
        s_b,
        top_k,
        n_group,
        topk_group,
        scaling,
        SEL_T,
        KS_TILE,
        E_PAD,
        K_PAD,
        G_PAD,
        GROUPED,
        NORM,
    )


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


def _check_tiles(t: RouteTiles, h: torch.Tensor) -> None:
    if t.mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {t.mode!r}")
    if t.mode == "bf16x3" and h.dtype != torch.bfloat16:
        raise ValueError(f"mode 'bf16x3' needs bf16 h (its products are exact only then), got {h.dtype}")
    dims = (t.block_t, t.block_e, t.block_k)
    if any(v < 1 or v & (v - 1) for v in dims) or t.k_steps < 1 or (t.mode == "fma" and t.k_steps > 16):
        raise ValueError(f"block sizes must be powers of two and 1 <= k_steps (<= 16 for 'fma'): {t}")
    if t.mode != "fma" and min(dims) < 16:
        raise ValueError(f"tl.dot modes need block_t, block_e, block_k >= 16: {t}")
    if t.select_rows < 0 or t.select_rows & (t.select_rows - 1):
        raise ValueError(f"select_rows must be 0 (one launch) or a power of two: {t}")


def _select_consts(rows: int, n_ks: int, e_pad: int, k_pad: int, n_group: int, norm: bool) -> dict:
    """The selection's constexprs for programs that select `rows` rows each: SEL_T rows per step (the [SEL_T, E_PAD]
    keys and the [SEL_T, K_PAD, E_PAD] weight gather stay within their tile budgets), KS_TILE K slices per load."""
    sel_t = max(1, min(rows, SELECT_TILE // e_pad, WEIGHT_TILE // (e_pad * k_pad)))
    return dict(
        SEL_T=sel_t,
        KS_TILE=min(triton.next_power_of_2(n_ks), max(1, REDUCE_TILE // (sel_t * e_pad))),
        E_PAD=e_pad,
        K_PAD=k_pad,
        G_PAD=triton.next_power_of_2(n_group),
        GROUPED=n_group > 1,
        NORM=bool(norm),
    )


def moe_route(
    h: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, d] (bf16/fp16/fp32, unit stride in d), gate_weight [E, d] (unit stride in d), correction_bias [E]
    -> (topk_weights [T, top_k] fp32, topk_ids [T, top_k] int64), one Triton launch (+ a zero fill of one int32
    arrival counter per token block when a token block spans several programs and counters is None), or two when
    the tiles select apart (`RouteTiles.select_rows`); tiles from `route_tiles`. counters: optional persistent int32
    zeros of >= one element per token block (left zeroed; unused when a token block has a single program or the
    selection runs apart)."""
    return moe_route_tiled(
        h, gate_weight, correction_bias, top_k, n_group, topk_group, norm_topk_prob, scaling, None, counters
    )


def moe_route_tiled(
    h: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    tiles: RouteTiles | None,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route` with a given launch shape (None: `route_tiles`)."""
    _check_route_args(h, gate_weight, correction_bias, top_k, n_group, topk_group)
    check_counters(counters, h)
    T, d = h.shape
    E = gate_weight.shape[0]
    dev = h.device
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=dev)
    if T == 0:
        return weights, ids
    e_pad, k_pad = block_dim(E, 16), triton.next_power_of_2(top_k)
    cfg = tiles or route_tiles(T, e_pad, d, h.dtype)
    _check_tiles(cfg, h)
    grid = (triton.cdiv(T, cfg.block_t), triton.cdiv(E, cfg.block_e), triton.cdiv(d, cfg.block_k * cfg.k_steps))
    part = torch.empty(grid[2], T, E, dtype=torch.float32, device=dev)  # partial logits per K slice
    apart = cfg.select_rows > 0
    n_arrive = 0 if apart else grid[1] * grid[2]
    if n_arrive > 1:  # one arrival counter per token block
        counts = arrival_counters(counters, h, grid[0])
    else:  # never read: a placeholder pointer
        counts = counters if counters is not None else torch.empty(1, dtype=torch.int32, device=dev)
    select = _select_consts(cfg.select_rows if apart else cfg.block_t, grid[2], e_pad, k_pad, n_group, norm_topk_prob)
    scalars = (top_k, n_group, topk_group, float(scaling))
    _moe_route_kernel[grid](
        h,
        gate_weight,
        correction_bias,
        part,
        counts,
        weights,
        ids,
        T,
        E,
        d,
        h.stride(0),
        gate_weight.stride(0),
        correction_bias.stride(0),
        *scalars,
        MODE=MODES[cfg.mode],
        BLOCK_T=cfg.block_t,
        BLOCK_E=cfg.block_e,
        BLOCK_K=cfg.block_k,
        K_STEPS=cfg.k_steps,
        N_ARRIVE=n_arrive,
        DOT_TY=tl.bfloat16 if dev.type == "cuda" else tl.float32,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
        **select,
        **pdl_args(h),
    )
    if apart:
        _route_select_kernel[(triton.cdiv(T, select["SEL_T"]),)](
            part,
            correction_bias,
            weights,
            ids,
            T,
            E,
            grid[2],
            correction_bias.stride(0),
            *scalars,
            num_warps=SELECT_WARPS,
            **select,
            **pdl_args(h),
        )
    return weights, ids
