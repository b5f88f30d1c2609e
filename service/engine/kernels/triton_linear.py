"""Triton skinny linear (GEMV) for decode: y = x @ W^T (+ b) for a few rows, W streamed once at full bandwidth.

At batch 1-8 a linear layer reads its whole weight matrix for a handful of dot products: it is a pure weight
stream. cuBLAS picks split-K kernels plus a reduction kernel for these shapes (two launches, ~60 % of copy
bandwidth on the H200 in the engine profile). `skinny_linear` is one launch: program j owns BLOCK_N output
columns for all M rows, walks K in BLOCK_K steps and keeps fp32 accumulators; each weight element is read once.
`linear` routes rows <= MAX_SKINNY_ROWS here and everything else to torch's F.linear (cuBLAS), by shape alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from service.engine.kernels.triton_common import check_dim, check_inner_contiguous, check_same_device, check_shape

MAX_SKINNY_ROWS = 8     # rows up to which a linear is a weight stream (routed to skinny_linear)


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, s_x, s_w, s_y, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mm = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * s_w + offs_k[None, :], mask=mn[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)                                               # [BN, BK]
        x = tl.load(x_ptr + offs_m[:, None] * s_x + offs_k[None, :], mask=mm[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)                                               # [BM, BK]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)                                # [BM, BN]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * s_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


@dataclass(frozen=True)
class SkinnyTiles:
    """Launch shape of `skinny_linear`."""
    block_n: int                  # output columns per program
    block_k: int                  # reduction step (elements of one weight row per load)
    warps: int                    # warps per program


def default_skinny_tiles(n: int) -> SkinnyTiles:
    """Enough programs to keep every SM streaming: narrow column blocks for narrow outputs."""
    return SkinnyTiles(16 if n >= 8192 else 8, 512, 4)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """y = x @ weight^T (+ bias), fp32 accumulation. x [M, K] (M <= MAX_SKINNY_ROWS, unit stride in K),
    weight [N, K] (contiguous), bias [N] or None -> y [M, N] in x's dtype. tiles None picks `default_skinny_tiles`."""
    check_dim("x", x, 2)
    M, K = x.shape
    check_dim("weight", weight, 2)
    N = weight.shape[0]
    check_shape("weight", weight, (N, K))
    if not 1 <= M <= MAX_SKINNY_ROWS:
        raise ValueError(f"skinny_linear takes 1..{MAX_SKINNY_ROWS} rows, got {M}: use F.linear")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    check_inner_contiguous("x", x)
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if bias is not None:
        check_shape("bias", bias, (N,))
        check_same_device(x=x, weight=weight, bias=bias)
    check_same_device(x=x, weight=weight)
    t = tiles or default_skinny_tiles(N)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bm = triton.next_power_of_2(M)
    bk = max(64, t.block_k // bm)           # keeps the [BM, BN, BK] product's registers bounded
    _skinny_linear_kernel[(triton.cdiv(N, t.block_n),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=t.block_n, BLOCK_K=bk, num_warps=t.warps)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` semantics for x [..., K]: skinny_linear when the flattened rows are <= MAX_SKINNY_ROWS and the
    layout allows it, cuBLAS otherwise (chosen by shape, not by trying)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 1 <= rows <= MAX_SKINNY_ROWS and x.dtype == weight.dtype and weight.is_contiguous() and x.stride(-1) == 1:
        return skinny_linear(x.reshape(rows, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: torch's F.linear."""
    return F.linear(x, weight, bias)
