"""Triton MoE experts for a handful of (token, slot) pairs (batch-1/2 decode) as grouped GEMVs.

Same signature and semantics as `moe.moe_experts_ref` and `triton_moe.moe_experts` (h and the per-slot outputs are
rounded to x's dtype at the same points as the tiled path). At batch 1 the tiled path runs 16-row tiles with one
valid row per expert; here there is no alignment and no padding. Each token has k routed slots, plus one for the
shared expert (weight 1) when shared_up/shared_down are given: rows q = t * slots + j of the h and y scratch.
Up pass: one program per (slot q, block j of BLOCK_N rows) of slot q's up matrix (`up[ids[t, j]]` [I, d_in], or
shared_up [S, d_in]): it streams those rows against token t's x and writes relu(.)² of them. Down pass: one program
per (unit, block of BLOCK_N rows) of a down matrix against its h row, times the pair's routing weight: a unit is a
routed slot (K = I) or one of `ExpertGemvTiles.shared_chunks` K chunks of the shared slot (S ~ 2 I: two chunks give
every program the same length instead of a tail of programs twice as long). Both grids are 1-d, each slot's blocks
consecutive: neighbouring programs stream neighbouring rows (an earlier 2-d grid (slot, block) interleaved 7
matrices and launched max(I, S) / BLOCK_N blocks for every slot).
Each program keeps fp32 partial products in a [BLOCK_N, BLOCK_K] register tile with the next step's tile loaded
before this step's FMAs (`triton_gemv.dot_tiles`, one reduction at the end; `ExpertGemvTiles.depth` / `.stages` are
tuning knobs for more tiles in flight, off by default; `.mma` > 0 runs the same products on tensor cores,
`triton_gemv.mma_tiles`, the default for FP8 experts). `triton_moe.sum_slots` then sums each token's units in fp32
with one rounding: one MoE layer with its shared expert is route + up + down + sum = 4 launches at batch 1 (summing
in the down pass's last program per row block, behind an arrival counter, measured slower on H200). PDL launches
on Hopper+ (triton_common).
FP8 experts (float8_e4m3fn, fp32 per-expert weight scales; the shared expert's per-tensor): the same kernels with FP8
set read the weight bytes, make them fp32 in registers (`triton_gemv.weight_f32`) and multiply each row sum by its
matrix's scale; x and h stay in x's dtype (weight-only, as `fp8.fp8_moe_experts_ref` without quantize_activations).
Weight bytes are read once per pair, so the tiled path (one read per expert) wins as soon as pairs share experts:
this path is for T * k up to MAX_GEMV_PAIRS. One launcher per op, BF16 or FP8 by the experts' dtype:
`moe_experts_gemv`, `moe_experts_tiled_shared`, `moe_experts_by_size`; `fp8_moe_experts` adapts the FP8 reference's
signature (the bundle's op) to them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.engine.kernels import fp8, triton_fp8, triton_gemv, triton_moe
from service.engine.kernels.fp8 import Fp8Linear
from service.engine.kernels.tiles import EXPERT_GEMV_FP8_DOWN_TILES, EXPERT_GEMV_FP8_TILES, ExpertGemvTiles
from service.engine.kernels.triton_activation import relu2
from service.engine.kernels.triton_common import pdl_args, pdl_release, pdl_wait
from service.engine.kernels.triton_gemv import _load_w, _load_x, dot_tiles, mma_tiles, weight_f32
from service.engine.kernels.triton_moe import (
    Fp8ExpertScales,
    SharedLinear,
    check_experts_args,
    check_shared_args,
    shared_weight_and_scale,
    sum_slots,
)

MAX_GEMV_PAIRS = 16  # (token, slot) pairs up to which `moe_experts_gemv` accepts a batch


@triton.jit
def _expert_dot(
    w_rows,
    x_ptr,
    K,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DEPTH: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
    FP8: tl.constexpr = False,
    MMA: tl.constexpr = 0,
):
    """Weight rows at w_rows [BLOCK_N, 1] (unit stride along K) times the x row at x_ptr over [0, K): the fp32
    [BLOCK_N, BLOCK_K] partial products (the caller reduces axis 1; FP8: e4m3 weight bytes, unscaled). DEPTH 1-2 with
    STAGES 1 is `dot_tiles`
    (DEPTH 2: its register prefetch, the default); DEPTH 3-4 keeps DEPTH - 1 further tiles in registers (the last
    steps re-load the last tile, an L2 hit); STAGES > 1 is a plain loop that Triton software-pipelines.
    PDL: the first weight tiles are loaded before `pdl_wait` (STAGES > 1: it waits first), x after it."""
    if MMA > 0:  # tensor cores (`triton_gemv.mma_tiles`): [BLOCK_N, 16], column 0 the products
        acc, _, _, _ = mma_tiles(w_rows, x_ptr, 0, 0, K, K, 1, EVEN_K, BLOCK_N, BLOCK_K, MMA, PDL, FP8)
    elif STAGES > 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        x_rows = x_ptr + tl.zeros((BLOCK_N, 1), tl.int32)
        pdl_wait(PDL)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            w = _load_w(w_rows, k0, K, EVEN_K, BLOCK_K)
            x, _, _, _ = _load_x(x_rows, 0, k0, K, 1, EVEN_K, BLOCK_K)
            acc += weight_f32(w, FP8) * x.to(tl.float32)
    elif DEPTH > 2:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        x_rows = x_ptr + tl.zeros((BLOCK_N, 1), tl.int32)
        k_last = (K - 1) // BLOCK_K * BLOCK_K
        k1 = tl.minimum(k_last, BLOCK_K)
        k2 = tl.minimum(k_last, 2 * BLOCK_K)
        w0 = _load_w(w_rows, 0, K, EVEN_K, BLOCK_K)
        w1 = _load_w(w_rows, k1, K, EVEN_K, BLOCK_K)
        w2 = w1
        if DEPTH > 3:
            w2 = _load_w(w_rows, k2, K, EVEN_K, BLOCK_K)
        pdl_wait(PDL)
        x0, _, _, _ = _load_x(x_rows, 0, 0, K, 1, EVEN_K, BLOCK_K)
        x1, _, _, _ = _load_x(x_rows, 0, k1, K, 1, EVEN_K, BLOCK_K)
        x2 = x1
        if DEPTH > 3:
            x2, _, _, _ = _load_x(x_rows, 0, k2, K, 1, EVEN_K, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k_next = tl.minimum(k0 + (DEPTH - 1) * BLOCK_K, k_last)
            nw = _load_w(w_rows, k_next, K, EVEN_K, BLOCK_K)
            nx, _, _, _ = _load_x(x_rows, 0, k_next, K, 1, EVEN_K, BLOCK_K)
            acc += weight_f32(w0, FP8) * x0.to(tl.float32)
            if DEPTH > 3:
                w0, x0, w1, x1, w2, x2 = w1, x1, w2, x2, nw, nx
            else:
                w0, x0, w1, x1 = w1, x1, nw, nx
    else:
        acc, _, _, _ = dot_tiles(w_rows, x_ptr, 0, 0, K, K, 1, EVEN_K, DEPTH == 2, BLOCK_N, BLOCK_K, PDL, FP8)
    return acc


@triton.jit
def _slot_expert(q, ids_ptr, w_ptr, w_shared_ptr, s_w_e, top_k, n_routed, n_shared, SHARED: tl.constexpr):
    """Row q of the [T, k + SHARED] slot layout (slot k: the shared expert) -> its token t, its routed pair index
    t * k + slot (not read for the shared slot), whether it is the shared slot, its expert e (0 for the shared
    slot), its expert's weight matrix ([I, d_in] / [d_in, I], or the shared [S, d_in] / [d_in, S]) and its
    intermediate size (I or S)."""
    t = q // (top_k + SHARED)
    slot = q - t * (top_k + SHARED)
    p = t * top_k + slot
    shared = slot == top_k
    e = tl.load(ids_ptr + p, mask=slot < top_k, other=0).to(tl.int64)
    w = tl.where(shared, w_shared_ptr, w_ptr + e * s_w_e)
    return t.to(tl.int64), p, shared, e, w, tl.where(shared, n_shared, n_routed)


@triton.jit
def _slot_scale(shared, e, scale_ptr, shared_scale_ptr, FP8: tl.constexpr):
    """The factor of a slot's row sums: 1, or with FP8 its matrix's weight scale (the expert's, or the shared
    expert's per-tensor one)."""
    if FP8:
        routed = tl.load(scale_ptr + e)
        return tl.where(shared, tl.load(shared_scale_ptr), routed)
    return 1.0


@triton.jit
def _up_program(top_k, nb_routed, nb_shared, SHARED: tl.constexpr):
    """Program -> (slot row q, row block j) of the up pass: per token, k * nb_routed blocks of its routed slots, then
    nb_shared blocks of its shared slot, each slot's blocks consecutive (programs stream contiguous rows)."""
    pid = tl.program_id(0)
    per_token = top_k * nb_routed + nb_shared
    t = pid // per_token
    r = pid - t * per_token
    slot = tl.where(r < top_k * nb_routed, r // nb_routed, top_k)
    j = tl.where(r < top_k * nb_routed, r - slot * nb_routed, r - top_k * nb_routed)
    return t * (top_k + SHARED) + slot, j


@triton.jit
def _expert_up_kernel(
    x_ptr,
    w_ptr,
    w_shared_ptr,
    scale_ptr,
    shared_scale_ptr,
    ids_ptr,
    h_ptr,
    top_k,
    n_routed,
    n_shared,
    nb_routed,
    nb_shared,
    K,
    s_x,
    s_w_e,
    s_h,
    SHARED: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DEPTH: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
    FP8: tl.constexpr,
    MMA: tl.constexpr,
):
    """h[q, :n] = relu(W_q x_t)^2 for slot q's expert W_q [n, K] (n = I, or S for the shared slot).
    PDL: waits first (the expert ids are the router's output, usually the kernel just before)."""
    pdl_wait(PDL)
    q, j = _up_program(top_k, nb_routed, nb_shared, SHARED)
    t, _, shared, e, w, n_out = _slot_expert(q, ids_ptr, w_ptr, w_shared_ptr, s_w_e, top_k, n_routed, n_shared, SHARED)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, n_out - 1).to(tl.int64)  # loads unmasked, stores masked
    r = _expert_dot(w + rows[:, None] * K, x_ptr + t * s_x, K, EVEN_K, BLOCK_N, BLOCK_K, DEPTH, STAGES, False, FP8, MMA)
    pdl_release(PDL)
    r = tl.maximum(tl.sum(r, axis=1) * _slot_scale(shared, e, scale_ptr, shared_scale_ptr, FP8), 0.0)
    tl.store(h_ptr + q.to(tl.int64) * s_h + offs_n, (r * r).to(h_ptr.dtype.element_ty), mask=offs_n < n_out)


@triton.jit
def _down_unit(u, ids_ptr, w_ptr, w_shared_ptr, s_w_e, top_k, n_routed, n_shared, k_chunk, units, SHARED: tl.constexpr):
    """Down-pass unit u of the [T, units] layout (units = k routed slots + the shared slot's K chunks) -> its
    h row q (t * slots + slot), routed pair index p (not read for the shared slot), whether it is shared, its expert
    e (0 for the shared slot), the first weight element of its K range, its matrix's row length (I or S), the first
    K index k0 and the K length of its range (I, or one chunk of S)."""
    t = u // units
    r = u - t * units
    slot = tl.minimum(r, top_k)
    k0 = (r - slot) * k_chunk  # the shared slot's chunk r - k
    p = t * top_k + slot
    shared = slot == top_k
    e = tl.load(ids_ptr + p, mask=~shared, other=0).to(tl.int64)
    w = tl.where(shared, w_shared_ptr, w_ptr + e * s_w_e) + k0
    row_len = tl.where(shared, n_shared, n_routed)
    k_len = tl.where(shared, tl.minimum(k_chunk, n_shared - k0), n_routed)
    return t * (top_k + SHARED) + slot, p, shared, e, w, row_len, k0, k_len


@triton.jit
def _expert_down_kernel(
    h_ptr,
    w_ptr,
    w_shared_ptr,
    scale_ptr,
    shared_scale_ptr,
    ids_ptr,
    topk_w_ptr,
    y_ptr,
    top_k,
    n_routed,
    n_shared,
    k_chunk,
    units,
    n_out,
    nb_out,
    s_h,
    s_w_e,
    s_y,
    SHARED: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DEPTH: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
    FP8: tl.constexpr,
    MMA: tl.constexpr,
):
    """y[u] = w_q * W_q[:, K range] h[q, K range] for unit u (`_down_unit`: a routed slot with its routing weight, or
    one K chunk of the shared slot, weight 1); program -> (u, row block j), each unit's blocks consecutive.
    PDL: the ids are read and the first weight tile loaded before the wait (the ids were written before the up
    pass started, and a PDL kernel releases its successor only after its own wait: so they are final here);
    h, the up pass's output, after it."""
    u = tl.program_id(0) // nb_out
    j = tl.program_id(0) - u * nb_out
    q, p, shared, e, w, row_len, k0, K = _down_unit(
        u, ids_ptr, w_ptr, w_shared_ptr, s_w_e, top_k, n_routed, n_shared, k_chunk, units, SHARED
    )
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, n_out - 1).to(tl.int64)
    x = h_ptr + q.to(tl.int64) * s_h + k0
    r = _expert_dot(w + rows[:, None] * row_len, x, K, EVEN_K, BLOCK_N, BLOCK_K, DEPTH, STAGES, PDL, FP8, MMA)
    pdl_release(PDL)
    r = tl.sum(r, axis=1) * _slot_scale(shared, e, scale_ptr, shared_scale_ptr, FP8)
    r = r * tl.load(topk_w_ptr + p, mask=~shared, other=1.0).to(tl.float32)
    u = u.to(tl.int64)
    tl.store(y_ptr + u * s_y + offs_n, r.to(y_ptr.dtype.element_ty), mask=offs_n < n_out)


def _launch_args(t: ExpertGemvTiles, like: torch.Tensor) -> dict:
    return dict(
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        DEPTH=t.depth,
        STAGES=t.stages,
        MMA=t.mma,
        num_warps=t.warps,
        num_stages=1,
        **pdl_args(like),
    )


def expert_up_pass(
    x: torch.Tensor,
    up: torch.Tensor,
    ids: torch.Tensor,
    top_k: int,
    tiles: ExpertGemvTiles,
    shared_up: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    shared_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The up pass of `moe_experts_gemv` (arguments checked there): x [T, d_in], up [E, I, d_in], ids [T * k]
    contiguous, shared_up [S, d_in] or None -> h [T * slots, max(I, S)], row t * slots + j = relu(W x_t)^2 of
    slot j (slot k: the shared expert). FP8 up / shared_up: scale [E] and shared_scale (one element) fp32."""
    T, d_in = x.shape
    inter, n_shared = up.shape[1], 0 if shared_up is None else shared_up.shape[0]
    slots = top_k + (1 if n_shared else 0)
    h = torch.empty(T * slots, max(inter, n_shared), dtype=x.dtype, device=x.device)
    nb_routed, nb_shared = triton.cdiv(inter, tiles.block_n), triton.cdiv(n_shared, tiles.block_n)
    is_fp8 = up.dtype == fp8.FP8_DTYPE
    _expert_up_kernel[(T * (top_k * nb_routed + nb_shared),)](
        x,
        _bytes(up),
        _bytes(shared_up if n_shared else up),
        scale if is_fp8 else x,
        shared_scale if is_fp8 and n_shared else x,
        ids,
        h,
        top_k,
        inter,
        n_shared,
        nb_routed,
        nb_shared,
        d_in,
        x.stride(0),
        up.stride(0),
        h.stride(0),
        SHARED=slots - top_k,
        EVEN_K=d_in % tiles.block_k == 0,
        FP8=is_fp8,
        **_launch_args(tiles, x),
    )
    return h


def expert_down_pass(
    h: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    top_k: int,
    tiles: ExpertGemvTiles,
    shared_down: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    shared_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The down pass of `moe_experts_gemv` and the slot sum (`sum_slots`): h [T * slots, >= max(I, S)] from
    `expert_up_pass`, down [E, d_in, I], ids [T * k], weights [T * k] fp32 contiguous, shared_down [d_in, S] or None
    -> [T, d_in], row t = the sum over t's slots q of the routing weight (1 for the shared slot) times W_q h[q]. The
    shared slot's K is cut into `tiles.shared_chunks` chunks, each a unit like a routed slot (units rounded to x's
    dtype, then added in fp32 with one rounding by `sum_slots`). FP8 down / shared_down: scale [E], shared_scale."""
    d_in, inter = down.shape[1], down.shape[2]
    n_shared = 0 if shared_down is None else shared_down.shape[1]
    chunks = tiles.shared_chunks if n_shared else 0
    T, units = h.shape[0] // (top_k + min(chunks, 1)), top_k + chunks
    k_chunk = triton.cdiv(n_shared, max(chunks, 1))
    y = torch.empty(T * units, d_in, dtype=h.dtype, device=h.device)
    nb_out = triton.cdiv(d_in, tiles.block_n)
    is_fp8 = down.dtype == fp8.FP8_DTYPE
    _expert_down_kernel[(T * units * nb_out,)](
        h,
        _bytes(down),
        _bytes(shared_down if n_shared else down),
        scale if is_fp8 else h,
        shared_scale if is_fp8 and n_shared else h,
        ids,
        weights,
        y,
        top_k,
        inter,
        n_shared,
        k_chunk,
        units,
        d_in,
        nb_out,
        h.stride(0),
        down.stride(0),
        y.stride(0),
        SHARED=min(chunks, 1),
        EVEN_K=inter % tiles.block_k == 0 and k_chunk % tiles.block_k == 0 and k_chunk * max(chunks, 1) == n_shared,
        FP8=is_fp8,
        **_launch_args(tiles, h),
    )
    return sum_slots(y, T, units)


def _bytes(w: torch.Tensor) -> torch.Tensor:
    """An FP8 weight as its uint8 bytes (the kernels decode them), any other as it is."""
    return w.view(torch.uint8) if w.dtype == fp8.FP8_DTYPE else w


def moe_experts_gemv(
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: ExpertGemvTiles | None = None,
    *,
    shared_up: SharedLinear | None = None,
    shared_down: SharedLinear | None = None,
    down_tiles: ExpertGemvTiles | None = None,
    scales: Fp8ExpertScales | None = None,
) -> torch.Tensor:
    """Routed experts (+ the shared expert) as grouped GEMVs (Triton) for T * k <= MAX_GEMV_PAIRS pairs.
    x [T, d_in] (unit stride in d_in), up [E, I, d_in], down [E, d_in, I] (contiguous), topk_weights [T, k]
    (fp32), topk_ids [T, k], optional shared_up [S, d_in] and shared_down [d_in, S] (both or neither, contiguous)
    -> sum_k w * down(relu(up(x))^2) (+ shared_down(relu(shared_up(x))^2)) [T, d_in] in x's dtype.
    FP8 experts: up / down float8_e4m3fn with their `scales` (weight-only: the input scales are not used; x and h
    stay in x's dtype), the shared expert as `Fp8Linear`s; `fp8.fp8_moe_experts_ref` without quantize_activations.
    tiles: both passes' launch shape (None: `ExpertGemvTiles()`, FP8: `EXPERT_GEMV_FP8_TILES` for the up pass and
    `EXPERT_GEMV_FP8_DOWN_TILES` for the down pass); down_tiles: the down pass's (None: tiles, or the FP8
    default)."""
    T, d_in, E, inter, top_k = check_experts_args(x, up, down, topk_weights, topk_ids, scales)
    n_shared = check_shared_args(x, shared_up, shared_down, scales is not None)
    if T * top_k > MAX_GEMV_PAIRS:
        raise ValueError(
            f"moe_experts_gemv takes up to {MAX_GEMV_PAIRS} (token, slot) pairs, got {T * top_k}: "
            "use triton_moe.moe_experts"
        )
    if T == 0:
        return torch.empty(0, d_in, dtype=x.dtype, device=x.device)
    t = tiles or (ExpertGemvTiles() if scales is None else EXPERT_GEMV_FP8_TILES)
    dt = down_tiles or (EXPERT_GEMV_FP8_DOWN_TILES if scales is not None and tiles is None else t)
    ids = topk_ids.reshape(-1).contiguous()
    su, su_scale = shared_weight_and_scale(shared_up if n_shared else None)
    sd, sd_scale = shared_weight_and_scale(shared_down if n_shared else None)
    h = expert_up_pass(x, up, ids, top_k, t, su, None if scales is None else scales.up, su_scale)
    w = topk_weights.to(torch.float32).reshape(-1).contiguous()
    return expert_down_pass(h, down, ids, w, top_k, dt, sd, None if scales is None else scales.down, sd_scale)


TILED_FP8_W8A8 = True  # FP8 experts above MAX_GEMV_PAIRS: W8A8 e4m3 tensor-core GEMMs (False: weight-only)


def moe_experts_tiled_shared(
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    shared_up: SharedLinear | None = None,
    shared_down: SharedLinear | None = None,
    scales: Fp8ExpertScales | None = None,
    w8a8: bool = TILED_FP8_W8A8,
) -> torch.Tensor:
    """`triton_moe.moe_experts_tiled` (sorted-token grouped GEMMs) for the routed experts, plus the shared expert as
    linear -> `triton_activation.relu2` -> linear when given (`triton_gemv.linear`; FP8: `triton_fp8.fp8_linear`,
    W8A8 for more than one row). Same shapes as `moe.moe_experts_ref`; FP8 experts with `scales` (w8a8: activations
    quantized with the static input scales, e4m3 tensor cores; else weight-only), the shared expert as `Fp8Linear`s.
    The routed sum is rounded to x's dtype once before the add (torch adds fp16/bf16 in fp32 and rounds once): one
    rounding more than the reference, which adds both in fp32."""
    n_shared = check_shared_args(x, shared_up, shared_down, scales is not None)
    routed = triton_moe.moe_experts_tiled(x, up, down, topk_weights, topk_ids, None, scales, w8a8)
    if not n_shared:
        return routed
    if scales is None:
        return routed + triton_gemv.linear(relu2(triton_gemv.linear(x, shared_up)), shared_down)
    u, d = shared_up, shared_down
    h = relu2(triton_fp8.fp8_linear(x, u.weight, u.weight_scale, u.input_scale))
    return routed + triton_fp8.fp8_linear(h, d.weight, d.weight_scale, d.input_scale)


def moe_experts_by_size(
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    shared_up: SharedLinear | None = None,
    shared_down: SharedLinear | None = None,
    scales: Fp8ExpertScales | None = None,
    w8a8: bool = TILED_FP8_W8A8,
) -> torch.Tensor:
    """Routed experts (+ the shared expert when shared_up/shared_down are given), Triton, chosen by shape alone: the
    grouped GEMVs above for T * k <= MAX_GEMV_PAIRS (batch-1/2 decode: no alignment launch, no padded rows, the
    shared expert folded into the same launches; FP8: weight-only), else
    `moe_experts_tiled_shared` (FP8: w8a8 or weight-only). Same signature and shapes as `moe.moe_experts_ref` (FP8
    experts: with `scales`)."""
    shared = dict(shared_up=shared_up, shared_down=shared_down, scales=scales)
    if topk_ids.numel() <= MAX_GEMV_PAIRS:
        return moe_experts_gemv(x, up, down, topk_weights, topk_ids, **shared)
    return moe_experts_tiled_shared(x, up, down, topk_weights, topk_ids, **shared, w8a8=w8a8)


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
    *,
    shared_up: Fp8Linear | None = None,
    shared_down: Fp8Linear | None = None,
    w8a8: bool = TILED_FP8_W8A8,
) -> torch.Tensor:
    """The bundle's FP8 experts op in `fp8.fp8_moe_experts_ref`'s signature (up_scale / down_scale [E], the input
    scales one element each): `moe_experts_by_size` with those scales. Its oracle is the reference weight-only
    for T * k <= MAX_GEMV_PAIRS, else with quantize_activations = w8a8 (the shared expert then W8A8 for T > 1)."""
    fp8.check_fp8_experts_args(x, up, down, up_scale, down_scale, up_input_scale, down_input_scale, topk_ids)
    scales = Fp8ExpertScales(
        up_scale.float().contiguous(),
        down_scale.float().contiguous(),
        up_input_scale.float().reshape(1),
        down_input_scale.float().reshape(1),
    )
    return moe_experts_by_size(
        x,
        up,
        down,
        topk_weights,
        topk_ids,
        shared_up=shared_up,
        shared_down=shared_down,
        scales=scales,
        w8a8=w8a8,
    )
