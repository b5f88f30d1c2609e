"""A norm fused into the prologue of the single-row GEMV after it (batch-1 decode): one launch instead of two.

`add_rms_norm_gemv`: residual add + RMSNorm + linear (a Mamba-2 layer's norm and in_proj):
    new_residual = round(residual + x);  y = round(rms_norm(new_residual) * norm_weight) @ weight^T (+ bias).
`gated_norm_gemv`: gated group RMSNorm + linear (the Mamba-2 output norm and out_proj):
    y = round(gated_group_rms_norm(y_ssm, z)) @ weight^T (+ bias).
round() is the cast to the weight's dtype, so the GEMV sees exactly the activation the unfused path
(`triton_norm` + `triton_gemv.gemv` with the same tiles) stores and reloads.

The launch shape is triton_gemv's (GemvTiles, split-K with persistent arrival counters, PDL). Every program first
reads the whole row (a few KB, L2-resident; after `pdl_wait`) and computes its rms: one scalar over
round(residual + x), or one per group of y * silu(z) (a [BLOCK_G] vector), in 512-element chunks whose sums are
added pairwise (few registers; under the interpreter the order of triton_norm's one reduction, so bit-equal to it
there; on a GPU the orders differ in the last bits). Program (0, 0) also writes new_residual. The K loop is
triton_gemv's register-tile loop (first weight tile loaded before `pdl_wait`, PREFETCH double buffer, one
reduction at the end) whose x load normalises its chunk on the fly: chunks may span groups or lie inside one
(each element takes its group's rms by a select over the SPAN groups a chunk can touch).
sm_90 compile (CPU box, `triton.compile`, no GPU run): Nano's default tiles take 72 registers (in_proj, masked K)
and 56 (out_proj) vs the GEMV's 48 and 44, no spills, no layout conversion in the K loop.
Batch-1 only (M = 1): larger batches keep the norm kernel + GEMV/cuBLAS (`add_rms_norm_linear`,
`gated_norm_linear`: the triton bundle's ops, choosing by shape). References: `norm.add_rms_norm_linear_ref`,
`norm.gated_norm_linear_ref` (pure torch; in norm.py so the torch bundle imports no Triton).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from service.engine.kernels import Kernels, triton_gemv, triton_norm
from service.engine.kernels.tiles import GemvTiles, default_gemv_tiles
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

# triton_gemv's loop pieces: tile loads, the per-split epilogue, the last arriver's reduction
from service.engine.kernels.triton_gemv import (
    _emit_row,
    _load,
    _load_w,
    _rows_block_k,
    arrival_counters,
    arrive_and_reduce,
    program_block,
)

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
PROLOGUE_CHUNK = 512  # elements per step of the rms prologue: a power of two >= 128 (see `_sum_sq`)


@triton.jit
def _h_chunk(a_ptr, b_ptr, res_ptr, offs, m, WRITER, GATED: tl.constexpr):
    """fp32 h at offs (0 where masked): gated (a = y, b = z) y * silu(z); else (a = x, b = residual)
    round(residual + x), which WRITER stores to res_ptr. The same ops as triton_norm's kernels."""
    a = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if GATED:
        h = a * b * tl.sigmoid(b)
    else:
        hr = (b + a).to(res_ptr.dtype.element_ty)  # rounded once, like triton_norm.add_rms_norm
        if WRITER:
            tl.store(res_ptr + offs, hr, mask=m)
        h = hr.to(tl.float32)
    return h


@triton.jit
def _sum_sq(
    a_ptr,
    b_ptr,
    res_ptr,
    base,
    n,
    WRITER,
    GATED: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNK: tl.constexpr,
    LEVELS: tl.constexpr,
):
    """Sum of h^2 over [base, base + n) (n <= BLOCK_P = 2^LEVELS * CHUNK), CHUNK elements at a time (few
    registers), the chunk sums added pairwise: in the interpreter the order of one tl.sum over [BLOCK_P] as
    triton_norm does it (numpy's pairwise summation, CHUNK >= 128 and powers of two), so bit-equal to it there."""
    offs = tl.arange(0, CHUNK)
    cids = tl.arange(0, BLOCK_P // CHUNK)
    sums = tl.zeros((BLOCK_P // CHUNK,), tl.float32)
    for c in range(0, tl.cdiv(n, CHUNK)):
        o = c * CHUNK + offs
        h = _h_chunk(a_ptr + base, b_ptr + base, res_ptr + base, o, o < n, WRITER, GATED)
        sums = tl.where(cids == c, tl.sum(h * h, axis=0), sums)
    for lv in tl.static_range(LEVELS):
        sums = tl.sum(tl.reshape(sums, (BLOCK_P // CHUNK >> (lv + 1), 2)), axis=1)
    return tl.sum(sums, axis=0)


@triton.jit
def _row_rms(
    a_ptr,
    b_ptr,
    res_ptr,
    K,
    eps,
    WRITER,
    GATED: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNK: tl.constexpr,
    LEVELS: tl.constexpr,
):
    """The row's 1/rms: gated, a [BLOCK_G] vector (entry g: group g); else one scalar (WRITER stores the new
    residual). BLOCK_P: triton_norm's block (the group, or the row, rounded up to a power of two)."""
    if GATED:
        gids = tl.arange(0, BLOCK_G)
        r = tl.zeros((BLOCK_G,), tl.float32)
        for g in range(0, K // GROUP):
            ss = _sum_sq(a_ptr, b_ptr, res_ptr, g * GROUP, GROUP, WRITER, GATED, BLOCK_P, CHUNK, LEVELS)
            r = tl.where(gids == g, tl.rsqrt(ss / GROUP + eps), r)
    else:
        r = tl.rsqrt(_sum_sq(a_ptr, b_ptr, res_ptr, 0, K, WRITER, GATED, BLOCK_P, CHUNK, LEVELS) / K + eps)
    return r


@triton.jit
def _load_normed(
    a_rows,
    b_rows,
    nw_rows,
    rstd,
    k0,
    K,
    OUT: tl.constexpr,
    GATED: tl.constexpr,
    GROUP: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The normalised activation chunk at k0 in OUT, broadcast to the weight tile (like triton_gemv's x load)."""
    offs_k = (k0 + tl.arange(0, BLOCK_K))[None, :]
    mk = offs_k < K
    a = _load(a_rows + offs_k, mk, EVEN_K, "evict_last").to(tl.float32)
    b = _load(b_rows + offs_k, mk, EVEN_K, "evict_last").to(tl.float32)
    nw = _load(nw_rows + offs_k, mk, EVEN_K, "evict_last").to(tl.float32)
    if GATED:
        h = a * b * tl.sigmoid(b)
        r = tl.zeros((1, BLOCK_K), tl.float32)  # each element's group rms (0 past K)
        gids = tl.arange(0, BLOCK_G)
        for s in tl.static_range(SPAN):  # the groups this chunk can touch
            g = k0 // GROUP + s
            r = tl.where(offs_k // GROUP == g, tl.sum(tl.where(gids == g, rstd, 0.0), axis=0), r)
    else:
        h = (b + a).to(OUT).to(tl.float32)
        r = rstd
    return (nw * (h * r)).to(OUT)


@triton.jit
def _norm_dot(
    w_rows,
    a_ptr,
    b_ptr,
    nw_ptr,
    res_ptr,
    k_lo,
    k_hi,
    K,
    eps,
    WRITER,
    GATED: tl.constexpr,
    GROUP: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNK: tl.constexpr,
    LEVELS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """triton_gemv.dot_tiles for one row whose x chunks are normalised on the fly: the fp32 [BLOCK_N, BLOCK_K]
    partial-product tile over [k_lo, k_hi). The row's rms is computed after `pdl_wait`."""
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    zero = tl.zeros((BLOCK_N, 1), tl.int32)  # activations broadcast over the tile: w's layout
    a_rows, b_rows, nw_rows = a_ptr + zero, b_ptr + zero, nw_ptr + zero
    OUT: tl.constexpr = w_rows.dtype.element_ty
    if PREFETCH:
        k_last = k_lo + (k_hi - k_lo - 1) // BLOCK_K * BLOCK_K
        w = _load_w(w_rows, k_lo, K, EVEN_K, BLOCK_K)
        pdl_wait(PDL)
        rstd = _row_rms(a_ptr, b_ptr, res_ptr, K, eps, WRITER, GATED, GROUP, BLOCK_G, BLOCK_P, CHUNK, LEVELS)
        x = _load_normed(a_rows, b_rows, nw_rows, rstd, k_lo, K, OUT, GATED, GROUP, SPAN, BLOCK_G, EVEN_K, BLOCK_K)
        for k0 in range(k_lo, k_hi, BLOCK_K):  # the last step re-loads its own tile (an L2 hit)
            k_next = tl.minimum(k0 + BLOCK_K, k_last)
            nw = _load_w(w_rows, k_next, K, EVEN_K, BLOCK_K)
            nx = _load_normed(
                a_rows, b_rows, nw_rows, rstd, k_next, K, OUT, GATED, GROUP, SPAN, BLOCK_G, EVEN_K, BLOCK_K
            )
            acc += w.to(tl.float32) * x.to(tl.float32)
            w, x = nw, nx
    else:
        pdl_wait(PDL)
        rstd = _row_rms(a_ptr, b_ptr, res_ptr, K, eps, WRITER, GATED, GROUP, BLOCK_G, BLOCK_P, CHUNK, LEVELS)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w = _load_w(w_rows, k0, K, EVEN_K, BLOCK_K)
            x = _load_normed(a_rows, b_rows, nw_rows, rstd, k0, K, OUT, GATED, GROUP, SPAN, BLOCK_G, EVEN_K, BLOCK_K)
            acc += w.to(tl.float32) * x.to(tl.float32)
    return acc


@triton.jit
def _norm_gemv_kernel(
    a_ptr,
    b_ptr,
    nw_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    res_ptr,
    part_ptr,
    count_ptr,
    N,
    K,
    k_split,
    eps,
    GATED: tl.constexpr,
    GROUP: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNK: tl.constexpr,
    LEVELS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n, pid_k, offs_n, mn, w_rows, k_lo = program_block(w_ptr, N, K, k_split, BLOCK_N)
    acc = _norm_dot(
        w_rows,
        a_ptr,
        b_ptr,
        nw_ptr,
        res_ptr,
        k_lo,
        tl.minimum(k_lo + k_split, K),
        K,
        eps,
        (pid_n == 0) & (pid_k == 0),
        GATED,
        GROUP,
        SPAN,
        BLOCK_G,
        BLOCK_P,
        CHUNK,
        LEVELS,
        EVEN_K,
        PREFETCH,
        BLOCK_N,
        BLOCK_K,
        PDL,
    )
    pdl_release(PDL)
    _emit_row(tl.sum(acc, axis=1), 0, pid_k, offs_n, mn, bias_ptr, y_ptr, part_ptr, N, 0, 1, HAS_BIAS, SPLIT_K)
    if SPLIT_K > 1:
        arrive_and_reduce(count_ptr, pid_n, offs_n, mn, bias_ptr, y_ptr, part_ptr, N, 0, 1, HAS_BIAS, SPLIT_K)


def _group_span(block_k: int, group: int) -> int:
    """Most groups of `group` channels a chunk [k0, k0 + block_k) with k0 a multiple of block_k can touch."""
    if block_k % group == 0 or group % block_k == 0:
        return max(1, block_k // group)
    return triton.cdiv(block_k - 1, group) + 1


def _norm_consts(K: int, group: int | None, block_k: int) -> dict:
    """The kernel's norm constexprs: add + RMSNorm (group None) or the gated group norm."""
    block_p = block_dim(group or K, 1)  # triton_norm's block: the group, or the row
    chunk = min(block_p, PROLOGUE_CHUNK)
    return dict(
        GATED=group is not None,
        GROUP=group or 1,
        SPAN=_group_span(block_k, group) if group else 1,
        BLOCK_G=block_dim(K // group, 1) if group else 1,
        BLOCK_P=block_p,
        CHUNK=chunk,
        LEVELS=(block_p // chunk).bit_length() - 1,
    )


def _check_gemv_part(name: str, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """a [1, K] (unit stride in K) against weight [N, K] (contiguous, a float dtype), bias [N] or None."""
    check_dim(name, a, 2)
    check_dim("weight", weight, 2)
    if a.shape[0] != 1 or a.shape[1] == 0 or weight.shape[0] == 0:
        raise ValueError(
            f"{name} must be one non-empty row [1, K] and weight non-empty, got {tuple(a.shape)}, "
            f"weight {tuple(weight.shape)}: use the unfused ops"
        )
    check_shape("weight", weight, (weight.shape[0], a.shape[1]))
    if weight.dtype not in FLOATS or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous fp32/fp16/bf16 tensor, got {weight.dtype}")
    if bias is not None:
        check_shape("bias", bias, (weight.shape[0],))
        if bias.dtype != weight.dtype:
            raise ValueError(f"bias must have weight's dtype {weight.dtype}, got {bias.dtype}")
    check_inner_contiguous(name, a)


def _launch(a, b, norm_weight, weight, bias, res_out, eps, group, tiles, counters, pdl) -> torch.Tensor:
    """y [1, N] in weight's dtype; group None = add + RMSNorm (writes res_out), else the gated group norm."""
    N, K = weight.shape
    t = tiles or default_gemv_tiles(N, K)
    bk = _rows_block_k(t, 1)
    k_split = triton.cdiv(triton.cdiv(K, max(1, t.split_k)), bk) * bk
    split = triton.cdiv(K, k_split)  # no empty slices (as triton_gemv.gemv)
    blocks = triton.cdiv(N, t.block_n)
    y = torch.empty(1, N, dtype=weight.dtype, device=weight.device)
    part = cnt = y  # unused unless split > 1
    if split > 1:
        part = torch.empty(split, 1, N, dtype=torch.float32, device=y.device)
        cnt = arrival_counters(counters, y, blocks)
    _norm_gemv_kernel[(blocks, split)](
        a,
        b,
        norm_weight,
        weight,
        bias if bias is not None else y,
        y,
        res_out if res_out is not None else y,
        part,
        cnt,
        N,
        K,
        k_split,
        eps,
        **_norm_consts(K, group, bk),
        HAS_BIAS=bias is not None,
        SPLIT_K=split,
        EVEN_K=K % bk == 0,
        PREFETCH=t.prefetch,
        BLOCK_N=t.block_n,
        BLOCK_K=bk,
        num_warps=t.warps,
        num_stages=1,
        **pdl_args(a, pdl),
    )
    return y


def add_rms_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: GemvTiles | None = None,
    counters: torch.Tensor | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm + linear in one launch (see `norm.add_rms_norm_linear_ref`).
    x, residual [1, K] (same dtype as weight; unit stride in K), norm_weight [K] (any float dtype), weight [N, K]
    contiguous, bias [N] or None -> (y [1, N], new_residual [1, K]), two new tensors in weight's dtype.
    tiles / counters / pdl: as `triton_gemv.gemv` (tiles None = `default_gemv_tiles(N, K)`)."""
    _check_gemv_part("x", x, weight, bias)
    check_shape("residual", residual, tuple(x.shape))
    check_inner_contiguous("residual", residual)
    check_shape("norm_weight", norm_weight, (x.shape[1],))
    if x.dtype != weight.dtype or residual.dtype != weight.dtype:
        raise ValueError(f"x and residual must have weight's dtype {weight.dtype}, got {x.dtype}, {residual.dtype}")
    check_same_device(x=x, residual=residual, norm_weight=norm_weight, weight=weight)
    new_res = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    return _launch(x, residual, norm_weight, weight, bias, new_res, eps, None, tiles, counters, pdl), new_res


def gated_norm_gemv(
    y: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    group_size: int,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: GemvTiles | None = None,
    counters: torch.Tensor | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """Gated group RMSNorm + linear in one launch (see `norm.gated_norm_linear_ref`): the normed activation is
    rounded to weight's dtype. y, z [1, Di] (any float dtypes, unit stride in Di; z may be a strided split),
    norm_weight [Di], group_size dividing Di, weight [N, Di] contiguous, bias [N] or None -> [1, N] in weight's
    dtype. tiles / counters / pdl: as `triton_gemv.gemv`."""
    _check_gemv_part("y", y, weight, bias)
    check_shape("z", z, tuple(y.shape))
    check_inner_contiguous("z", z)
    Di = y.shape[1]
    check_shape("norm_weight", norm_weight, (Di,))
    if group_size < 1 or Di % group_size:
        raise ValueError(f"group_size {group_size} must divide Di={Di}")
    if y.dtype not in FLOATS or z.dtype not in FLOATS:
        raise ValueError(f"y and z must be fp32/fp16/bf16, got {y.dtype}, {z.dtype}")
    check_same_device(y=y, z=z, norm_weight=norm_weight, weight=weight)
    return _launch(y, z, norm_weight, weight, bias, None, eps, group_size, tiles, counters, pdl)


def _gemv_row(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """a [..., K] is one row that `triton_gemv.linear` would run as its GEMV on weight (and the fused kernels take)."""
    return (
        a.numel() == a.shape[-1] > 0
        and weight.numel() <= triton_gemv.MAX_GEMV_WEIGHT_ELEMENTS
        and weight.dtype in FLOATS
        and weight.is_contiguous()
        and a.stride(-1) == 1
    )


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The triton bundle's op (`norm.add_rms_norm_linear_ref` semantics): x, residual [..., K] -> (y [..., N],
    new_residual [..., K]). One row with a GEMV-sized weight of x's dtype: `add_rms_norm_gemv` (one launch); any
    other shape: `triton_norm.add_rms_norm`, then `triton_gemv.linear` (GEMV or cuBLAS). Chosen by shape alone."""
    K, N = x.shape[-1], weight.shape[0]
    if (
        _gemv_row(x, weight)
        and residual.stride(-1) == 1
        and x.dtype == residual.dtype == weight.dtype
        and (bias is None or bias.dtype == weight.dtype)
    ):
        y, new_res = add_rms_norm_gemv(
            x.reshape(1, K), residual.reshape(1, K), norm_weight, eps, weight, bias, counters=counters
        )
        return y.view(*x.shape[:-1], N), new_res.view(residual.shape)
    normed, new_res = triton_norm.add_rms_norm(x, residual, norm_weight, eps)
    return triton_gemv.linear(normed, weight, bias, counters=counters), new_res


def gated_norm_linear(
    y: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    group_size: int,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """The triton bundle's op (`norm.gated_norm_linear_ref` semantics): y, z [T, Di] -> [T, N] in weight's dtype.
    One row with a GEMV-sized weight: `gated_norm_gemv` (one launch); any other shape:
    `triton_norm.gated_group_rms_norm` (to weight's dtype), then `triton_gemv.linear`. Chosen by shape alone."""
    if (
        _gemv_row(y, weight)
        and z.stride(-1) == 1
        and y.dtype in FLOATS
        and z.dtype in FLOATS
        and (bias is None or bias.dtype == weight.dtype)
    ):
        return gated_norm_gemv(y, z, norm_weight, group_size, eps, weight, bias, counters=counters)
    normed = triton_norm.gated_group_rms_norm(y, z, norm_weight, group_size, eps, weight.dtype)
    return triton_gemv.linear(normed, weight, bias, counters=counters)


def without_norm_fusion(k: Kernels) -> Kernels:
    """Bundle k with the two fused ops run unfused: k's norm kernel, then k's `linear` (A/B benchmarks, tests)."""

    def add_rms_norm_linear_(x, residual, norm_weight, eps, weight, bias=None):
        normed, h = k.add_rms_norm(x, residual, norm_weight, eps)
        return k.linear(normed, weight, bias), h

    def gated_norm_linear_(y, z, norm_weight, group_size, eps, weight, bias=None):
        return k.linear(k.gated_rms_norm(y, z, norm_weight, group_size, eps, weight.dtype), weight, bias)

    return dataclasses.replace(k, add_rms_norm_linear=add_rms_norm_linear_, gated_norm_linear=gated_norm_linear_)
