"""Triton paged causal attention (GQA, no positional encoding) over a packed batch.

Same signature and semantics as `attention.paged_attention_ref`. The lengths are device tensors; the launch is
sized from two host ints the caller passes (`max_query_len`, `max_seq_len`), so no call reads the device and a
decode step can be captured in a CUDA graph. Two paths:
  * every request has one new token (max_query_len == 1, decode): `_decode_kernel`, one program per (request, KV head,
    KV split) holding the whole GQA group as the rows of its tile, split-KV partials merged by
    `_combine_kernel` (flash-decoding, log-sum-exp) when one split is not enough to fill the GPU; the split plan
    (`decode_splits`, `DecodeTiles`) comes from the batch size and max_seq_len, splits past a request's context
    store an empty partial that the merge skips;
  * otherwise (prefill, cached prefix, mixed batches): `_prefill_kernel`, flash attention over the
    paged keys [0, p_i + m] per (query block, request, query head).
Softmax in fp32 (exp2 with the scale folded in). The caches may hold another dtype than q (an FP8 KV cache:
float8_e4m3fn, with k_scale / v_scale): tiles are converted to q's dtype on load (exact from e4m3), k_scale is
folded into the softmax scale and v_scale applied to the output (or to each split's partial).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.engine.kernels.tiles import DECODE_TILE_VARIANTS, DecodeTiles, PrefillTiles, decode_splits
from service.engine.kernels.triton_common import (
    block_dim,
    check_dim,
    check_inner_contiguous,
    check_same_device,
    dot_precision,
    pdl_args,
    pdl_release,
    pdl_wait,
)
from service.engine.kernels.triton_kv import check_kv_scales

_LOG2E = 1.4426950408889634


@triton.jit
def _kv_slots(pt_row_ptr, offs_n, mn, page_size):
    """Cache slots of keys offs_n of one request (page 0's slots where masked)."""
    page = tl.load(pt_row_ptr + offs_n // page_size, mask=mn, other=0).to(tl.int64)
    return page * page_size + offs_n % page_size


@triton.jit
def _load_kv_tile(
    cache_ptr, pt_row_ptr, offs_n, n_end, kvh, offs_d, s_slot, s_head, page_size, Dh, TRANSPOSED: tl.constexpr
):
    """Keys/values at positions offs_n of one request: [BLOCK_D, BLOCK_N] if TRANSPOSED else [BLOCK_N, BLOCK_D]."""
    mn = offs_n < n_end
    slot = _kv_slots(pt_row_ptr, offs_n, mn, page_size)
    md = offs_d < Dh
    if TRANSPOSED:
        tile = tl.load(
            cache_ptr + slot[None, :] * s_slot + kvh * s_head + offs_d[:, None],
            mask=mn[None, :] & md[:, None],
            other=0.0,
        )
    else:
        tile = tl.load(
            cache_ptr + slot[:, None] * s_slot + kvh * s_head + offs_d[None, :],
            mask=mn[:, None] & md[None, :],
            other=0.0,
        )
    return tile


@triton.jit(do_not_specialize=("num_splits", "s_pt"))  # per-step sizes: triton_common's docstring
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pt_ptr,
    prefix_ptr,
    o_ptr,
    part_o_ptr,
    part_ml_ptr,
    ks_ptr,
    vs_ptr,
    qk_scale,
    Dh,
    page_size,
    num_splits,
    min_split,
    s_q_t,
    s_q_h,
    s_k_slot,
    s_k_head,
    s_v_slot,
    s_v_head,
    s_pt,
    s_o_t,
    s_o_h,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    SCALED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: request b, KV head kvh, keys [lo, hi) of split sp, the GROUP query heads of kvh as the rows of
    one [BLOCK_G, BLOCK_D] x [BLOCK_D, BLOCK_N] dot per step. SPLIT: store the unnormalised partial (times v_scale)
    and (m, l); an empty split stores only m = -inf, l = 0. SCALED: the caches hold k / k_scale and v / v_scale."""
    pdl_wait(PDL)
    v_scale = 1.0
    if SCALED:
        qk_scale = qk_scale * tl.load(ks_ptr)
        v_scale = tl.load(vs_ptr)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(prefix_ptr + b) + 1
    keys_per_split = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N, min_split)
    lo = sp * keys_per_split
    hi = tl.minimum(lo + keys_per_split, ctx)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mg, md = offs_g < GROUP, offs_d < Dh
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + b * s_q_t + heads[:, None] * s_q_h + offs_d[None, :], mask=mg[:, None] & md[None, :], other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    pt_row = pt_ptr + b * s_pt
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mn = offs_n < hi
        slot = _kv_slots(pt_row, offs_n, mn, page_size)
        kt = tl.load(
            k_ptr + slot[None, :] * s_k_slot + kvh * s_k_head + offs_d[:, None],
            mask=mn[None, :] & md[:, None],
            other=0.0,
        )
        s = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(mn[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + slot[:, None] * s_v_slot + kvh * s_v_head + offs_d[None, :],
            mask=mn[:, None] & md[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    pdl_release(PDL)
    acc = acc * v_scale
    if SPLIT:
        row = (b * (GROUP * tl.num_programs(1)) + heads) * num_splits + sp  # [(b, head), split]
        nonempty = offs_g < tl.where(lo < hi, GROUP, 0)  # (a scalar & vector mask trips the interpreter)
        tl.store(part_o_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=nonempty[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=mg)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=mg)
    else:
        out = acc / l_i[:, None]
        tl.store(
            o_ptr + b * s_o_t + heads[:, None] * s_o_h + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=mg[:, None] & md[None, :],
        )


@triton.jit(do_not_specialize=("num_splits",))  # per-step sizes: triton_common's docstring
def _combine_kernel(
    part_o_ptr,
    part_ml_ptr,
    o_ptr,
    Hq,
    Dh,
    num_splits,
    s_o_t,
    s_o_h,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the split partials of (request b, query head h) by log-sum-exp; empty splits (l = 0) are not read."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    ms = offs_s < num_splits
    row = (b * Hq + h) * num_splits + offs_s
    m = tl.load(part_ml_ptr + row * 2, mask=ms, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=ms, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(l > 0, tl.exp2(m - m_max), 0.0)
    acc = tl.load(part_o_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=(l > 0)[:, None], other=0.0)
    pdl_release(PDL)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(o_ptr + b * s_o_t + h * s_o_h + offs_d, out.to(o_ptr.dtype.element_ty), mask=offs_d < Dh)


@triton.jit
def _attend_block(
    q,
    m_i,
    l_i,
    acc,
    k_ptr,
    v_ptr,
    pt_row,
    offs_n,
    qpos,
    kv_end,
    kvh,
    offs_d,
    s_k_slot,
    s_k_head,
    s_v_slot,
    s_v_head,
    page_size,
    Dh,
    qk_scale,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the keys at offs_n (CAUSAL: mask keys after each row's position)."""
    kt = _load_kv_tile(k_ptr, pt_row, offs_n, kv_end, kvh, offs_d, s_k_slot, s_k_head, page_size, Dh, True)
    s = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
    if CAUSAL:
        s = tl.where((offs_n[None, :] <= qpos[:, None]) & (offs_n < kv_end)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    pr = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    v = _load_kv_tile(v_ptr, pt_row, offs_n, kv_end, kvh, offs_d, s_v_slot, s_v_head, page_size, Dh, False)
    acc = acc * alpha[:, None] + tl.dot(pr.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=("s_pt",))  # per-step sizes: triton_common's docstring
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pt_ptr,
    qsl_ptr,
    prefix_ptr,
    o_ptr,
    ks_ptr,
    vs_ptr,
    qk_scale,
    Dh,
    page_size,
    s_q_t,
    s_q_h,
    s_k_slot,
    s_k_head,
    s_v_slot,
    s_v_head,
    s_pt,
    s_o_t,
    s_o_h,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    q0 = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q0
    if m0 >= q_len:
        return
    v_scale = 1.0
    if SCALED:  # the caches hold k / k_scale and v / v_scale
        qk_scale = qk_scale * tl.load(ks_ptr)
        v_scale = tl.load(vs_ptr)
    p = tl.load(prefix_ptr + b)
    kvh = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mm, md = offs_m < q_len, offs_d < Dh
    rows = (q0 + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * s_q_t + h * s_q_h + offs_d[None, :], mask=mm[:, None] & md[None, :], other=0.0)
    qpos = p + offs_m
    kv_end = p + tl.minimum(m0 + BLOCK_M, q_len)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    pt_row = pt_ptr + b * s_pt
    full_end = ((p + m0) // BLOCK_N) * BLOCK_N  # keys below p + m0 are visible to every row
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q,
            m_i,
            l_i,
            acc,
            k_ptr,
            v_ptr,
            pt_row,
            n0 + tl.arange(0, BLOCK_N),
            qpos,
            kv_end,
            kvh,
            offs_d,
            s_k_slot,
            s_k_head,
            s_v_slot,
            s_v_head,
            page_size,
            Dh,
            qk_scale,
            False,
            DOT_PRECISION,
        )
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q,
            m_i,
            l_i,
            acc,
            k_ptr,
            v_ptr,
            pt_row,
            n0 + tl.arange(0, BLOCK_N),
            qpos,
            kv_end,
            kvh,
            offs_d,
            s_k_slot,
            s_k_head,
            s_v_slot,
            s_v_head,
            page_size,
            Dh,
            qk_scale,
            True,
            DOT_PRECISION,
        )
    out = acc * v_scale / l_i[:, None]
    tl.store(
        o_ptr + rows[:, None] * s_o_t + h * s_o_h + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=mm[:, None] & md[None, :],
    )


def _check(q, k_cache, v_cache, page_table, query_start_loc, prefix_lens, max_query_len, max_seq_len) -> None:
    check_dim("q", q, 3)
    check_dim("k_cache", k_cache, 3)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    if k_cache.shape[2] != q.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k_cache ({k_cache.shape[2]}) differ")
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of KV heads {k_cache.shape[1]}")
    cache_dtypes = (q.dtype, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    if k_cache.dtype not in cache_dtypes or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must share a dtype, q's ({q.dtype}), bfloat16, float16 or float8_e4m3fn; got "
            f"{k_cache.dtype} and {v_cache.dtype}"
        )
    check_dim("page_table", page_table, 2)
    check_dim("prefix_lens", prefix_lens, 1)
    B = prefix_lens.shape[0]
    if tuple(query_start_loc.shape) != (B + 1,) or page_table.shape[0] < B:
        raise ValueError(
            f"query_start_loc (shape {tuple(query_start_loc.shape)}) must have B+1 entries and "
            f"page_table ({page_table.shape[0]} rows) B rows for B={B} prefix_lens"
        )
    if max_query_len < 1 or not B <= q.shape[0] <= B * max_query_len:
        raise ValueError(f"q has {q.shape[0]} tokens: not within [B, B * max_query_len] = [{B}, {B * max_query_len}]")
    if max_query_len == 1 and q.shape[0] != B:
        raise ValueError(f"max_query_len=1 (decode) needs one query per request: q has {q.shape[0]}, B={B}")
    if max_seq_len < max_query_len:
        raise ValueError(f"max_seq_len {max_seq_len} is below max_query_len {max_query_len}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_inner_contiguous(name, t)
    check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=page_table,
        query_start_loc=query_start_loc,
        prefix_lens=prefix_lens,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    page_size: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged causal GQA attention (Triton), see `paged_attention_tiled`."""
    tiles = PrefillTiles() if q.element_size() <= 2 else PrefillTiles(64, 64, 4, 2)  # fp32 tiles: half the smem
    return paged_attention_tiled(
        q,
        k_cache,
        v_cache,
        page_table,
        query_start_loc,
        prefix_lens,
        max_query_len,
        max_seq_len,
        page_size,
        scale,
        tiles,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def paged_attention_tiled(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    page_size: int,
    scale: float,
    tiles: PrefillTiles,
    decode: DecodeTiles = DECODE_TILE_VARIANTS[0],
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged causal GQA attention (Triton). q [T, Hq, Dh]; k/v_cache [S, Hkv, Dh] (new K/V already written);
    page_table [B, max_pages]; query_start_loc [B+1] int64 and prefix_lens [B] int64 (p_i) on q's device;
    max_query_len >= max l_i and max_seq_len >= max p_i + l_i (host ints, launch sizes).
    Request i's queries sit at positions p_i + [0, l_i) and see keys [0, pos]. Returns [T, Hq, Dh] in q's dtype.
    `tiles` shapes the prefill path, `decode` the decode path (max_query_len == 1). k_scale, v_scale: fp32
    one-element tensors (both or neither) when the caches hold k / k_scale and v / v_scale."""
    _check(q, k_cache, v_cache, page_table, query_start_loc, prefix_lens, max_query_len, max_seq_len)
    scaled = check_kv_scales(k_cache, k_scale, v_scale)
    T, Hq, Dh = q.shape
    B, Hkv = prefix_lens.shape[0], k_cache.shape[1]
    out = torch.empty_like(q)
    if T == 0:
        return out
    common = dict(GROUP=Hq // Hkv, BLOCK_D=block_dim(Dh), DOT_PRECISION=dot_precision(q.dtype), SCALED=scaled)
    scales = (k_scale, v_scale) if scaled else (out, out)  # unread when not SCALED
    qk_scale = scale * _LOG2E
    if max_query_len == 1:
        _decode(
            q, k_cache, v_cache, page_table, prefix_lens, max_seq_len, page_size, qk_scale, out, scales, common, decode
        )
        return out
    bm = 16 if max_query_len <= 16 else tiles.block_m
    _prefill_kernel[(triton.cdiv(max_query_len, bm), B, Hq)](
        q,
        k_cache,
        v_cache,
        page_table,
        query_start_loc,
        prefix_lens,
        out,
        *scales,
        qk_scale,
        Dh,
        page_size,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_M=bm,
        BLOCK_N=tiles.block_n,
        num_warps=tiles.warps if bm >= 64 else 4,
        num_stages=tiles.stages,
        **common,
    )
    return out


def _decode(
    q, k_cache, v_cache, page_table, prefix_lens, max_seq_len, page_size, qk_scale, out, scales, common, tiles
) -> None:
    """Split-KV decode: `_decode_kernel` over (request, KV head, split), then `_combine_kernel` when split.
    scales: (k_scale, v_scale) tensors (read when common["SCALED"]); tiles: the `DecodeTiles`."""
    B, Hq, Dh = q.shape
    Hkv = k_cache.shape[1]
    block_n = tiles.block_n if q.element_size() <= 2 else max(16, tiles.block_n // 2)
    splits = decode_splits(B, Hkv, max_seq_len, tiles)
    bd = common["BLOCK_D"]
    part_o = torch.empty(B * Hq * splits * bd if splits > 1 else 1, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(B * Hq * splits * 2 if splits > 1 else 1, dtype=torch.float32, device=q.device)
    _decode_kernel[(B, Hkv, splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        prefix_lens,
        out,
        part_o,
        part_ml,
        *scales,
        qk_scale,
        Dh,
        page_size,
        splits,
        triton.cdiv(tiles.min_split, block_n) * block_n,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_G=block_dim(common["GROUP"]),
        BLOCK_N=block_n,
        SPLIT=splits > 1,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
        **pdl_args(q),
        **common,
    )
    if splits > 1:
        _combine_kernel[(B, Hq)](
            part_o,
            part_ml,
            out,
            Hq,
            Dh,
            splits,
            out.stride(0),
            out.stride(1),
            BLOCK_S=block_dim(splits, 1),
            BLOCK_D=bd,
            num_warps=4,
            **pdl_args(q),
        )
