"""Triton GEMV for decode: y = x @ W^T (+ b) for 1-4 rows of x, each weight element read once.

At batch 1 a linear layer is a pure weight stream. Program (j, s) owns BLOCK_N weight rows (output columns) and
the s-th of SPLIT_K slices of K. Per step it loads a [BLOCK_N, BLOCK_K] weight tile (16-byte vectors along K) and
the matching x slice of each row, and accumulates the elementwise products in fp32 [BLOCK_N, BLOCK_K] register
tiles (one per x row): no cross-thread traffic inside the loop, ONE reduction over BLOCK_K at the end. With PREFETCH
the next step's loads are issued before this step's FMAs (a register double buffer: two tiles in flight per
thread; Triton's num_stages pipelines only loads feeding tl.dot, so it is 1 here). Rows past N
are clamped to N-1 (the loads stay unmasked, the stores are masked); K is masked only when BLOCK_K does not divide
it. SPLIT_K > 1: each program writes its fp32 row sums to a scratch [SPLIT_K, M, N], then bumps an acq_rel arrival
counter of its column block; the last to arrive adds the SPLIT_K partials in split order (deterministic), adds the
bias, writes y in x's dtype and sets the counter back to 0. The counters are a fresh zeroed buffer (one memset
launch) unless the caller passes a persistent zeroed one, which every launch leaves zeroed (then the GEMV is one
launch, graph-capturable either way: no host sync); the triton bundle passes its `ArrivalCounters`. The counter is
bumped only after `pdl_wait` (in `dot_tiles`), so a PDL launch never touches it before its predecessor finished.
On Hopper+ the launch uses PDL (triton_common): the first weight tile is loaded before waiting for the previous
kernel, x after; the next kernel is released after the K loop.
FP8 weights (float8_e4m3fn with an fp32 per-tensor scale; `triton_fp8.fp8_linear`): the same kernel with FP8 set reads the
weight's bytes (half of bf16's), turns them into fp32 in registers (`e4m3_to`: the hardware e4m3 conversion, exact)
and multiplies the row sums by the scale; x stays in its dtype (weight-only: the activation is not quantized).
Tensor-core tiles (`GemvTiles.mma` > 0, `mma_tiles`): the weight tile (FP8: decoded to x's dtype) times x^T as a
[BLOCK_K, 16] operand whose first ROWS columns are x's rows, the K loop pipelined by Triton (cp.async stages): the
same products with fewer instructions per weight byte and more bytes in flight; the summation order differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from service.engine.kernels import fp8
from service.engine.kernels.tiles import GemvTiles, default_gemv_tiles
from service.engine.kernels.triton_common import (
    check_dim,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    pdl_args,
    pdl_release,
    pdl_wait,
)

MAX_ROWS = 4  # rows of x one launch takes (one fp32 register tile per row)
ACC_PER_THREAD = 64  # fp32 accumulator registers per thread over all rows before block_k is halved


@triton.jit
def e4m3_to(b, dtype: tl.constexpr):
    """uint8 e4m3 bit patterns -> their values in dtype (fp32, or fp16/bf16: every e4m3 value is exact in each):
    reinterpreted as float8e4nv and converted, which on Hopper+ is the hardware cvt (two bytes per instruction)."""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(dtype)


@triton.jit
def weight_f32(w, FP8: tl.constexpr):
    """A weight tile in fp32; FP8: w holds uint8 e4m3 bytes (`e4m3_to`), the caller applies the scale."""
    if FP8:
        return e4m3_to(w, tl.float32)
    return w.to(tl.float32)


@triton.jit
def _load(ptrs, mask, EVEN_K: tl.constexpr, POLICY: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs, eviction_policy=POLICY)
    return tl.load(ptrs, mask=mask, other=0.0, eviction_policy=POLICY)


@triton.jit
def _load_w(w_rows, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at k0."""
    offs_k = (k0 + tl.arange(0, BLOCK_K))[None, :]
    return _load(w_rows + offs_k, offs_k < K, EVEN_K, "evict_first")


@triton.jit
def _load_x(x_rows, s_x, k0, K, ROWS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The x slices at k0 of each row broadcast to the weight tile (rows >= ROWS repeat row 0, unused)."""
    offs_k = (k0 + tl.arange(0, BLOCK_K))[None, :]
    mk = offs_k < K  # k_split is a multiple of BLOCK_K: only K itself cuts a step
    x0 = _load(x_rows + offs_k, mk, EVEN_K, "evict_last")
    x1 = x0
    x2 = x0
    x3 = x0
    if ROWS > 1:
        x1 = _load(x_rows + s_x + offs_k, mk, EVEN_K, "evict_last")
    if ROWS > 2:
        x2 = _load(x_rows + 2 * s_x + offs_k, mk, EVEN_K, "evict_last")
    if ROWS > 3:
        x3 = _load(x_rows + 3 * s_x + offs_k, mk, EVEN_K, "evict_last")
    return x0, x1, x2, x3


@triton.jit
def _fma_step(acc0, acc1, acc2, acc3, w, x0, x1, x2, x3, ROWS: tl.constexpr, FP8: tl.constexpr = False):
    """acc_m += w * x_m elementwise in fp32 (no reduction); FP8: w holds e4m3 bytes (see `weight_f32`)."""
    wf = weight_f32(w, FP8)
    acc0 += wf * x0.to(tl.float32)
    if ROWS > 1:
        acc1 += wf * x1.to(tl.float32)
    if ROWS > 2:
        acc2 += wf * x2.to(tl.float32)
    if ROWS > 3:
        acc3 += wf * x3.to(tl.float32)
    return acc0, acc1, acc2, acc3


@triton.jit
def _emit_row(
    r,
    m,
    pid_k,
    offs_n,
    mn,
    b_ptr,
    y_ptr,
    part_ptr,
    N,
    s_y,
    ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Row m's sums r [BLOCK_N]: + bias into y (one split), else into the scratch row (pid_k, m)."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            r += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * s_y + offs_n, r.to(y_ptr.dtype.element_ty), mask=mn)
    else:
        tl.store(part_ptr + (pid_k * ROWS + m) * N + offs_n, r, mask=mn)


@triton.jit
def _reduce_splits(
    offs_n, mn, b_ptr, y_ptr, part_ptr, N, s_y, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr
):
    """y[m, offs_n] = sum over the splits of the scratch rows (split order) + bias, for every row m."""
    for m in tl.static_range(ROWS):
        tot = tl.load(part_ptr + m * N + offs_n, mask=mn, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            tot += tl.load(part_ptr + (s * ROWS + m) * N + offs_n, mask=mn, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            tot += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * s_y + offs_n, tot.to(y_ptr.dtype.element_ty), mask=mn)


@triton.jit
def program_block(w_ptr, N, K, k_split, BLOCK_N: tl.constexpr):
    """This program's (column block pid_n, K split pid_k, its output columns offs_n [BLOCK_N] and their mask, its
    weight row pointers [BLOCK_N, 1] (rows past N clamped to N-1), the first K index of its split)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * K
    return pid_n, pid_k, offs_n, offs_n < N, w_rows, pid_k * k_split


@triton.jit
def arrive_and_reduce(
    count_ptr,
    pid_n,
    offs_n,
    mn,
    b_ptr,
    y_ptr,
    part_ptr,
    N,
    s_y,
    ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Split-K epilogue, after this program stored its partials: bump column block pid_n's arrival counter; the
    last split to arrive adds the SPLIT_K partials (split order: deterministic) into y and sets the counter back
    to 0 (a persistent counter buffer stays zeroed for the next launch)."""
    tl.debug_barrier()  # every thread's partial stores are issued before the arrival
    arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:  # the last split of this column block: every partial is in L2
        _reduce_splits(offs_n, mn, b_ptr, y_ptr, part_ptr, N, s_y, ROWS, HAS_BIAS, SPLIT_K)
        tl.store(count_ptr + pid_n, 0)


@triton.jit
def mma_tiles(
    w_rows,
    x_ptr,
    s_x,
    k_lo,
    k_hi,
    K,
    ROWS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
    FP8: tl.constexpr = False,
):
    """`dot_tiles` on tensor cores: acc [BLOCK_N, 16] fp32 += W tile [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, 16] (the
    ROWS rows of x as columns, the other columns zero), the K loop pipelined STAGES deep (Triton's pipeliner: loads
    feeding tl.dot). The weight tile is made x's dtype in registers (FP8: `e4m3_to`, exact), so the products are
    those of the FMA path; only the summation order differs. Returns acc with column m alone kept as row m's tile
    (a sum over axis 1 gives its dot products; rows >= ROWS: zero). PDL: waits before the first load.
    BLOCK_N >= 16 and BLOCK_K >= 16 (tl.dot)."""
    offs_c = tl.arange(0, 16)[None, :]
    x_cols = x_ptr + offs_c * s_x
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    pdl_wait(PDL)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        w = _load_w(w_rows, k0, K, EVEN_K, BLOCK_K)
        offs_k = (k0 + tl.arange(0, BLOCK_K))[:, None]
        xt = tl.load(x_cols + offs_k, mask=(offs_c < ROWS) & (offs_k < K), other=0.0, eviction_policy="evict_last")
        if FP8:
            w = e4m3_to(w, xt.dtype)
        acc = tl.dot(w, xt, acc, input_precision="ieee")  # ieee: exact fp32 operands; bf16/fp16 ignore it
    zero = tl.zeros_like(acc)
    return (
        tl.where(offs_c == 0, acc, zero),
        tl.where(offs_c == 1, acc, zero),
        tl.where(offs_c == 2, acc, zero),
        tl.where(offs_c == 3, acc, zero),
    )


@triton.jit
def fma_tiles(
    w_rows,
    x_ptr,
    s_x,
    k_lo,
    k_hi,
    K,
    ROWS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    FP8: tl.constexpr,
):
    """The FMA path of `dot_tiles` (its arguments and result)."""
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    x_rows = x_ptr + tl.zeros((BLOCK_N, 1), tl.int32)  # x broadcast over the tile: w's layout, no shuffle
    if PREFETCH:  # step k+1's loads are issued before step k's FMAs: two tiles in flight
        k_last = k_lo + (k_hi - k_lo - 1) // BLOCK_K * BLOCK_K
        w = _load_w(w_rows, k_lo, K, EVEN_K, BLOCK_K)
        pdl_wait(PDL)
        x0, x1, x2, x3 = _load_x(x_rows, s_x, k_lo, K, ROWS, EVEN_K, BLOCK_K)
        for k0 in range(k_lo, k_hi, BLOCK_K):  # the last step re-loads its own tile (an L2 hit)
            k_next = tl.minimum(k0 + BLOCK_K, k_last)
            nw = _load_w(w_rows, k_next, K, EVEN_K, BLOCK_K)
            n0, n1, n2, n3 = _load_x(x_rows, s_x, k_next, K, ROWS, EVEN_K, BLOCK_K)
            acc0, acc1, acc2, acc3 = _fma_step(acc0, acc1, acc2, acc3, w, x0, x1, x2, x3, ROWS, FP8)
            w, x0, x1, x2, x3 = nw, n0, n1, n2, n3
    else:
        pdl_wait(PDL)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w = _load_w(w_rows, k0, K, EVEN_K, BLOCK_K)
            x0, x1, x2, x3 = _load_x(x_rows, s_x, k0, K, ROWS, EVEN_K, BLOCK_K)
            acc0, acc1, acc2, acc3 = _fma_step(acc0, acc1, acc2, acc3, w, x0, x1, x2, x3, ROWS, FP8)
    return acc0, acc1, acc2, acc3


@triton.jit
def dot_tiles(
    w_rows,
    x_ptr,
    s_x,
    k_lo,
    k_hi,
    K,
    ROWS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    FP8: tl.constexpr = False,
    MMA: tl.constexpr = 0,
):
    """Weight rows at w_rows [BLOCK_N, 1] (unit stride along K) times the ROWS rows of x (row stride s_x) over
    [k_lo, k_hi): fp32 [BLOCK_N, BLOCK_K] partial-product tiles acc0..acc3 (rows >= ROWS stay zero); the caller
    reduces them over axis 1. k_hi - k_lo is a multiple of BLOCK_K unless k_hi == K (EVEN_K: BLOCK_K divides K).
    PDL: the first weight tile is loaded before `pdl_wait`, x after it (x is the previous kernel's output).
    FP8: the weights are e4m3 bytes, decoded to fp32 by `weight_f32` (the scale is the caller's).
    MMA > 0: `mma_tiles` with MMA pipeline stages instead (tensor cores; [BLOCK_N, 16] tiles, PREFETCH unused)."""
    if MMA > 0:
        acc0, acc1, acc2, acc3 = mma_tiles(
            w_rows, x_ptr, s_x, k_lo, k_hi, K, ROWS, EVEN_K, BLOCK_N, BLOCK_K, MMA, PDL, FP8
        )
    else:
        acc0, acc1, acc2, acc3 = fma_tiles(
            w_rows, x_ptr, s_x, k_lo, k_hi, K, ROWS, EVEN_K, PREFETCH, BLOCK_N, BLOCK_K, PDL, FP8
        )
    return acc0, acc1, acc2, acc3


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    N,
    K,
    k_split,
    s_x,
    s_y,
    ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    FP8: tl.constexpr,
    MMA: tl.constexpr,
):
    """FP8: w_ptr holds e4m3 bytes, every row sum is multiplied by the fp32 scale at scale_ptr (before the bias);
    else scale_ptr is not read."""
    pid_n, pid_k, offs_n, mn, w_rows, k_lo = program_block(w_ptr, N, K, k_split, BLOCK_N)
    acc0, acc1, acc2, acc3 = dot_tiles(
        w_rows,
        x_ptr,
        s_x,
        k_lo,
        tl.minimum(k_lo + k_split, K),
        K,
        ROWS,
        EVEN_K,
        PREFETCH,
        BLOCK_N,
        BLOCK_K,
        PDL,
        FP8,
        MMA,
    )
    pdl_release(PDL)  # after the loads: releasing at the start lets dependents launch and stall
    sc = 1.0
    if FP8:
        sc = tl.load(scale_ptr)
    _emit_row(tl.sum(acc0, axis=1) * sc, 0, pid_k, offs_n, mn, b_ptr, y_ptr, part_ptr, N, s_y, ROWS, HAS_BIAS, SPLIT_K)
    if ROWS > 1:
        r = tl.sum(acc1, axis=1) * sc
        _emit_row(r, 1, pid_k, offs_n, mn, b_ptr, y_ptr, part_ptr, N, s_y, ROWS, HAS_BIAS, SPLIT_K)
    if ROWS > 2:
        r = tl.sum(acc2, axis=1) * sc
        _emit_row(r, 2, pid_k, offs_n, mn, b_ptr, y_ptr, part_ptr, N, s_y, ROWS, HAS_BIAS, SPLIT_K)
    if ROWS > 3:
        r = tl.sum(acc3, axis=1) * sc
        _emit_row(r, 3, pid_k, offs_n, mn, b_ptr, y_ptr, part_ptr, N, s_y, ROWS, HAS_BIAS, SPLIT_K)
    if SPLIT_K > 1:
        arrive_and_reduce(count_ptr, pid_n, offs_n, mn, b_ptr, y_ptr, part_ptr, N, s_y, ROWS, HAS_BIAS, SPLIT_K)


def _rows_block_k(t: GemvTiles, rows: int) -> int:
    """block_k for `rows` fp32 register tiles: halved (not below 128) while they would exceed 64 per thread
    (tensor-core tiles keep theirs: one [block_n, 16] accumulator for every row)."""
    bk = t.block_k
    while not t.mma and bk > 128 and rows * t.block_n * bk > ACC_PER_THREAD * 32 * t.warps:
        bk //= 2
    return bk


def _check_gemv_args(x, weight, bias, counters, weight_scale) -> None:
    check_dim("x", x, 2)
    check_dim("weight", weight, 2)
    check_shape("weight", weight, (weight.shape[0], x.shape[1]))
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows of x, got {x.shape[0]}: use F.linear")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp32/fp16/bf16, got {x.dtype}")
    if weight.dtype == fp8.FP8_DTYPE:
        if weight_scale is None or weight_scale.numel() != 1 or weight_scale.dtype != torch.float32:
            raise ValueError("an FP8 weight needs its per-tensor weight_scale: an fp32 tensor of one element")
        check_same_device(x=x, weight_scale=weight_scale)
    elif weight.dtype != x.dtype:
        raise ValueError(f"weight must have x's dtype {x.dtype} (or be {fp8.FP8_DTYPE} with a weight_scale)")
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(f"bias must have x's dtype {x.dtype}")
    check_inner_contiguous("x", x)
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    check_same_device(x=x, weight=weight)
    if bias is not None:
        check_shape("bias", bias, (weight.shape[0],))
        check_same_device(x=x, bias=bias)
    check_counters(counters, x)


def check_counters(counters: torch.Tensor | None, like: torch.Tensor, needed: int = 0) -> None:
    """A persistent arrival-counter buffer (None: nothing to check) must be a contiguous 1-d int32 tensor on like's
    device with >= needed elements (one per counter a launch bumps)."""
    if counters is None:
        return
    if counters.dtype != torch.int32 or counters.dim() != 1 or not counters.is_contiguous():
        raise ValueError(
            f"counters must be a contiguous 1-d int32 tensor, got {counters.dtype} "
            f"{tuple(counters.shape)} strides {counters.stride()}"
        )
    check_same_device(x=like, counters=counters)
    if counters.numel() < needed:
        raise ValueError(f"counters needs >= {needed} elements, got {counters.numel()}")


def arrival_counters(counters: torch.Tensor | None, like: torch.Tensor, needed: int) -> torch.Tensor:
    """The arrival counters of a launch that bumps `needed` of them: counters itself (checked, see
    `check_counters`; all zero, as every launch leaves it) or, when None, a fresh zeroed buffer (one memset)."""
    if counters is None:
        return torch.zeros(needed, dtype=torch.int32, device=like.device)
    check_counters(counters, like, needed)
    return counters


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: GemvTiles | None = None,
    counters: torch.Tensor | None = None,
    pdl: bool | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ weight^T (+ bias) with fp32 accumulation, one Triton launch (+ a counter memset for split-K
    without `counters`).
    x [M, K] (1 <= M <= 4; fp32/fp16/bf16, unit stride in K), weight [N, K] contiguous in x's dtype, or
    float8_e4m3fn with weight_scale (fp32, one element: W = weight * weight_scale), bias [N] or None (x's
    dtype) -> y [M, N] in x's dtype. tiles None picks `default_gemv_tiles(N, K, fp8)`. counters: optional persistent
    int32 zeros of >= cdiv(N, block_n) elements for split-K (left zeroed; unused without a split); None allocates
    a zeroed one.
    pdl: programmatic dependent launch (triton_common); None = `use_pdl(x)`."""
    _check_gemv_args(x, weight, bias, counters, weight_scale)
    M, K = x.shape
    N = weight.shape[0]
    if N == 0 or K == 0:
        y = torch.zeros(M, N, dtype=x.dtype, device=x.device)
        return y + bias if bias is not None else y
    is_fp8 = weight.dtype == fp8.FP8_DTYPE
    t = tiles or default_gemv_tiles(N, K, is_fp8)
    bk = _rows_block_k(t, M)
    k_split = triton.cdiv(triton.cdiv(K, max(1, t.split_k)), bk) * bk
    split = triton.cdiv(K, k_split)  # no empty slices
    blocks = triton.cdiv(N, t.block_n)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    part = cnt = y  # unused unless split > 1
    if split > 1:
        part = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        cnt = arrival_counters(counters, x, blocks)
    _gemv_kernel[(blocks, split)](
        x,
        weight.view(torch.uint8) if is_fp8 else weight,
        weight_scale if is_fp8 else y,
        bias if bias is not None else y,
        y,
        part,
        cnt,
        N,
        K,
        k_split,
        x.stride(0),
        y.stride(0),
        ROWS=M,
        HAS_BIAS=bias is not None,
        SPLIT_K=split,
        EVEN_K=K % bk == 0,
        PREFETCH=t.prefetch,
        BLOCK_N=t.block_n,
        BLOCK_K=bk,
        FP8=is_fp8,
        MMA=t.mma,
        num_warps=t.warps,
        num_stages=1,
        **pdl_args(x, pdl),
    )
    return y


# Up to this the GEMV runs single rows, mamba in_proj (27.7 M) included; lm_head (352 M) stays on cuBLAS, which
# streams it at copy bandwidth (measured on H200 with benchmarks/pdl_bench.py, see benchmarks/RESULTS.md).
MAX_GEMV_WEIGHT_ELEMENTS = 32 * 2**20


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, counters: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear` for x [..., K]: a single row (batch-1 decode) on a weight of <= MAX_GEMV_WEIGHT_ELEMENTS runs
    `gemv` (one launch; cuBLAS picks split-K + a reduce kernel there, which is slower), every
    other case cuBLAS. Chosen by shape alone. counters: `gemv`'s persistent split-K arrival counters (or None)."""
    K = x.shape[-1]
    if (
        x.numel() == K
        and weight.numel() <= MAX_GEMV_WEIGHT_ELEMENTS
        and x.dtype == weight.dtype
        and weight.is_contiguous()
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    ):
        return gemv(x.reshape(1, K), weight, bias, counters=counters).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
