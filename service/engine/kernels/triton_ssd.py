"""Triton chunk-aligned varlen SSD (Mamba-2 prefill) and the decode recurrence.

Same signatures and semantics as `ssd.ssd_varlen_ref` / `ssd.selective_state_update_ref`; the chunk
decomposition is the caller's `ChunkLayout` (docs/design.md: Chunk-aligned SSD): no chunk spans two requests and chunk ends
fall on absolute multiples of C, so `chunk_states[k]` is exactly the state a snapshot needs.

`ssd_varlen` runs four launches:
  1. `_chunk_cumsum_kernel`  cs[c, h, l] = sum_{s<=l} dt[s, h] * A[h] inside chunk c        [Nc, H, C] fp32
  2. `_chunk_state_kernel`   local[c, h] = sum_s exp(cs_last - cs_s) dt_s x_s B_s^T           [Nc, H, P, N] fp32
  3. `_state_passing_kernel` per request, sequential over its chunks (in place on the same buffer):
                             S_c = exp(cs_last_c) * S_{c-1} + local_c, S_{c0-1} = initial state; it also
                             writes S_{c-1} in the operands' dtype for step 4                 [Nc, H, P, N]
  4. `_chunk_scan_kernel`    y[l] = sum_{s<=l} (C_l.B_s) exp(cs_l - cs_s) dt_s x_s
                                    + exp(cs_l) C_l . S_{c-1} + D x_l                            [T, H, P] fp32
States stay fp32 in memory; matrix products take the operands' dtype (bf16/fp16) or exact fp32.

The decode step `_ssu_kernel` is one launch; `selective_state_update_slots_raw_dt` also folds the mamba layer's
dt preprocessing (softplus(dt + dt_bias), clamp) and A = -exp(A_log) into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from service.engine.kernels.ssd import ChunkLayout
from service.engine.kernels.tiles import SsdTiles
from service.engine.kernels.triton_common import (
    block_dim,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    dot_precision,
    pdl_args,
    pdl_release,
    pdl_wait,
)

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)  # SSM states: exact fp32, or bf16 (rounded wherever stored)


@triton.jit
def _chunk_cumsum_kernel(
    dt_ptr,
    A_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    cs_ptr,
    H,
    s_dt_t,
    s_dt_h,
    CHUNK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    c = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    start = tl.load(chunk_start_ptr + c)
    n = tl.load(chunk_len_ptr + c)
    offs_l = tl.arange(0, BLOCK_L)
    mh = offs_h < H
    m = (offs_l[:, None] < n) & mh[None, :]
    dt = tl.load(dt_ptr + (start + offs_l)[:, None] * s_dt_t + offs_h[None, :] * s_dt_h, mask=m, other=0.0)
    a = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    cs = tl.cumsum(dt.to(tl.float32) * a[None, :], axis=0)
    out = cs_ptr + c.to(tl.int64) * H * CHUNK + offs_h[None, :] * CHUNK + offs_l[:, None]
    tl.store(out, cs, mask=(offs_l[:, None] < CHUNK) & mh[None, :])


@triton.jit
def _chunk_state_kernel(
    x_ptr,
    B_ptr,
    dt_ptr,
    cs_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    states_ptr,
    H,
    P,
    N,
    heads_per_group,
    s_x_t,
    s_x_h,
    s_x_p,
    s_b_t,
    s_b_g,
    s_b_n,
    s_dt_t,
    s_dt_h,
    CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    num_nb = tl.cdiv(N, BLOCK_N)
    offs_p = (tl.program_id(2) // num_nb) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = (tl.program_id(2) % num_nb) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(chunk_start_ptr + c)
    n = tl.load(chunk_len_ptr + c)
    g = h // heads_per_group
    cs_base = cs_ptr + (c.to(tl.int64) * H + h) * CHUNK
    cs_last = tl.load(cs_base + n - 1)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, n, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < n
        tok = (start + offs_k).to(tl.int64)
        xt = tl.load(
            x_ptr + tok[None, :] * s_x_t + h * s_x_h + offs_p[:, None] * s_x_p,
            mask=mk[None, :] & (offs_p[:, None] < P),
            other=0.0,
        )  # [BP, BK]
        b = tl.load(
            B_ptr + tok[:, None] * s_b_t + g * s_b_g + offs_n[None, :] * s_b_n,
            mask=mk[:, None] & (offs_n[None, :] < N),
            other=0.0,
        )  # [BK, BN]
        dt = tl.load(dt_ptr + tok * s_dt_t + h * s_dt_h, mask=mk, other=0.0).to(tl.float32)
        cs = tl.load(cs_base + offs_k, mask=mk, other=0.0)
        w = tl.where(mk, tl.exp(cs_last - cs) * dt, 0.0)
        b = (b.to(tl.float32) * w[:, None]).to(xt.dtype)
        acc += tl.dot(xt, b, input_precision=DOT_PRECISION)
    out = states_ptr + (c.to(tl.int64) * H + h) * P * N + offs_p[:, None] * N + offs_n[None, :]
    tl.store(out, acc, mask=(offs_p[:, None] < P) & (offs_n[None, :] < N))


@triton.jit
def _round_to_bf16(v):
    """fp32 v rounded to the nearest bfloat16 (ties to even), still as fp32: integer arithmetic on the bits, so the
    GPU and the CPU interpreter (whose fp32 -> bf16 cast truncates) give the same bits as torch's cast."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _state_passing_kernel(
    states_ptr,
    prev_ptr,
    init_ptr,
    cs_ptr,
    first_chunk_ptr,
    num_chunks_ptr,
    chunk_len_ptr,
    H,
    PN,
    s_init_b,
    s_init_h,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """states[c] <- end state of chunk c (fp32, in place over the local states); prev[c] <- state entering
    chunk c in the operands' dtype (what `_chunk_scan_kernel` multiplies by C). ROUND_BF16 (bf16 initial states):
    every chunk's end state is rounded to bf16 before it is stored and carried on."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    m = offs < PN
    carry = tl.load(init_ptr + b.to(tl.int64) * s_init_b + h * s_init_h + offs, mask=m, other=0.0).to(tl.float32)
    c0 = tl.load(first_chunk_ptr + b)
    nc = tl.load(num_chunks_ptr + b)
    for j in range(nc):
        c = (c0 + j).to(tl.int64)
        n = tl.load(chunk_len_ptr + c)
        decay = tl.exp(tl.load(cs_ptr + (c * H + h) * CHUNK + n - 1))
        off = (c * H + h) * PN + offs
        tl.store(prev_ptr + off, carry.to(prev_ptr.dtype.element_ty), mask=m)
        carry = decay * carry + tl.load(states_ptr + off, mask=m, other=0.0)
        if ROUND_BF16:
            carry = _round_to_bf16(carry)
        tl.store(states_ptr + off, carry, mask=m)


@triton.jit
def _chunk_scan_kernel(
    x_ptr,
    B_ptr,
    C_ptr,
    dt_ptr,
    cs_ptr,
    D_ptr,
    prev_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    y_ptr,
    H,
    P,
    N,
    heads_per_group,
    s_x_t,
    s_x_h,
    s_x_p,
    s_b_t,
    s_b_g,
    s_b_n,
    s_c_t,
    s_c_g,
    s_c_n,
    s_dt_t,
    s_dt_h,
    s_y_t,
    s_y_h,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    n = tl.load(chunk_len_ptr + c)
    if m0 >= n:
        return
    start = tl.load(chunk_start_ptr + c)
    g = h // heads_per_group
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mm, mp, mn = offs_m < n, offs_p < P, offs_n < N
    tok_m = (start + offs_m).to(tl.int64)
    cs_base = cs_ptr + (c.to(tl.int64) * H + h) * CHUNK
    cs_m = tl.load(cs_base + offs_m, mask=mm, other=0.0)
    cm = tl.load(
        C_ptr + tok_m[:, None] * s_c_t + g * s_c_g + offs_n[None, :] * s_c_n, mask=mm[:, None] & mn[None, :], other=0.0
    )  # [BM, BN]
    # state entering the chunk (written by `_state_passing_kernel`), read as [BN, BP]
    st = tl.load(
        prev_ptr + (c.to(tl.int64) * H + h) * P * N + offs_n[:, None] + offs_p[None, :] * N,
        mask=mn[:, None] & mp[None, :],
        other=0.0,
    )
    acc = tl.dot(cm, st, input_precision=DOT_PRECISION) * tl.exp(cs_m)[:, None]  # [BM, BP]
    k_end = tl.minimum(m0 + BLOCK_M, n)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < n
        tok_k = (start + offs_k).to(tl.int64)
        bt = tl.load(
            B_ptr + tok_k[None, :] * s_b_t + g * s_b_g + offs_n[:, None] * s_b_n,
            mask=mk[None, :] & mn[:, None],
            other=0.0,
        )  # [BN, BK]
        cb = tl.dot(cm, bt, input_precision=DOT_PRECISION)  # [BM, BK]
        cs_k = tl.load(cs_base + offs_k, mask=mk, other=0.0)
        dt_k = tl.load(dt_ptr + tok_k * s_dt_t + h * s_dt_h, mask=mk, other=0.0).to(tl.float32)
        causal = (offs_k[None, :] <= offs_m[:, None]) & mk[None, :]
        seg = tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf"))
        cb = cb * tl.exp(seg) * dt_k[None, :]
        xk = tl.load(
            x_ptr + tok_k[:, None] * s_x_t + h * s_x_h + offs_p[None, :] * s_x_p,
            mask=mk[:, None] & mp[None, :],
            other=0.0,
        )  # [BK, BP]
        acc += tl.dot(cb.to(xk.dtype), xk, input_precision=DOT_PRECISION)
    xm = tl.load(
        x_ptr + tok_m[:, None] * s_x_t + h * s_x_h + offs_p[None, :] * s_x_p, mask=mm[:, None] & mp[None, :], other=0.0
    )
    acc += tl.load(D_ptr + h).to(tl.float32) * xm.to(tl.float32)
    tl.store(y_ptr + tok_m[:, None] * s_y_t + h * s_y_h + offs_p[None, :], acc, mask=mm[:, None] & mp[None, :])


def _check_scan_inputs(x, dt, A, B, C, D) -> tuple[int, int, int, int, int]:
    """x [rows, H, P], dt [rows, H], A/D [H], B/C [rows, G, N]; returns (rows, H, P, G, N)."""
    check_dim("x", x, 3)
    rows, H, P = x.shape
    check_dim("B", B, 3)
    G, N = B.shape[1], B.shape[2]
    check_shape("dt", dt, (rows, H))
    check_shape("A", A, (H,))
    check_shape("B", B, (rows, G, N))
    check_shape("C", C, (rows, G, N))
    check_shape("D", D, (H,))
    return rows, H, P, G, N


def _check_ssd_args(x, dt, A, B, C, D, initial_states, layout) -> None:
    T, H, P, G, N = _check_scan_inputs(x, dt, A, B, C, D)
    check_dim("initial_states", initial_states, 4)
    check_shape("initial_states", initial_states, (initial_states.shape[0], H, P, N))
    check_dtype("initial_states", initial_states, _STATE_DTYPES)
    check_dtype("x", x, _FLOATS)
    for name, t in (("B", B), ("C", C)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    if H % G:
        raise ValueError(f"heads {H} not divisible by groups {G} (x [T, H, P], B [T, G, N])")
    if layout.num_chunks.numel() != initial_states.shape[0]:
        raise ValueError(
            f"initial_states has {initial_states.shape[0]} requests, layout has {layout.num_chunks.numel()}"
        )
    if sum(layout.chunk_lens_host) != T:
        raise ValueError(f"layout covers {sum(layout.chunk_lens_host)} tokens, x has T={T}")
    check_same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, initial_states=initial_states, chunk_start=layout.chunk_start)


def ssd_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_states: torch.Tensor,
    layout: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-aligned varlen SSD (Triton).

    x [T, H, P] (rows may be strided), dt [T, H] fp32 (softplus'd, clamped), A [H] fp32 (negative),
    B/C [T, G, N] (x's dtype), D [H], initial_states [Bq, H, P, N] fp32 or bf16 (bf16: every chunk-end state is
    rounded to bf16, as `ssd.ssd_varlen_ref` does), layout for Bq requests.
    Returns y [T, H, P] fp32 and chunk_states [Nc, H, P, N] fp32 (state after each chunk's last token).
    """
    return ssd_varlen_tiled(x, dt, A, B, C, D, initial_states, layout, SsdTiles())


def ssd_varlen_tiled(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_states: torch.Tensor,
    layout: ChunkLayout,
    tiles: SsdTiles,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ssd_varlen` with explicit launch shapes (benchmarks compare tiles through this)."""
    _check_ssd_args(x, dt, A, B, C, D, initial_states, layout)
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    Nc, chunk = len(layout.chunk_lens_host), layout.chunk_size
    init = initial_states.contiguous()
    dev = x.device
    cs = torch.empty(Nc, H, chunk, dtype=torch.float32, device=dev)
    states = torch.empty(Nc, H, P, N, dtype=torch.float32, device=dev)
    y = torch.empty(T, H, P, dtype=torch.float32, device=dev)
    if Nc == 0:
        return y, states
    prev = torch.empty(Nc, H, P, N, dtype=x.dtype, device=dev)  # state entering each chunk, operand dtype
    prec = dot_precision(x.dtype)
    bl, bh = block_dim(chunk, 1), min(block_dim(H, 1), 16)
    _chunk_cumsum_kernel[(Nc, triton.cdiv(H, bh))](
        dt,
        A,
        layout.chunk_start,
        layout.chunk_len,
        cs,
        H,
        dt.stride(0),
        dt.stride(1),
        CHUNK=chunk,
        BLOCK_L=bl,
        BLOCK_H=bh,
    )
    bp, bn = min(block_dim(P), 64), min(block_dim(N), 128)
    grid = (Nc, H, triton.cdiv(P, bp) * triton.cdiv(N, bn))
    _chunk_state_kernel[grid](
        x,
        B,
        dt,
        cs,
        layout.chunk_start,
        layout.chunk_len,
        states,
        H,
        P,
        N,
        H // G,
        *x.stride(),
        *B.stride(),
        *dt.stride(),
        CHUNK=chunk,
        BLOCK_P=bp,
        BLOCK_N=bn,
        BLOCK_K=min(block_dim(chunk), tiles.state_block_k),
        DOT_PRECISION=prec,
        num_warps=4,
        num_stages=2,
    )
    blk = min(block_dim(P * N), tiles.pass_block)
    _state_passing_kernel[(init.shape[0], H, triton.cdiv(P * N, blk))](
        states,
        prev,
        init,
        cs,
        layout.first_chunk,
        layout.num_chunks,
        layout.chunk_len,
        H,
        P * N,
        init.stride(0),
        init.stride(1),
        CHUNK=chunk,
        BLOCK=blk,
        ROUND_BF16=init.dtype == torch.bfloat16,
        num_warps=4 if blk >= 512 else 2,
    )
    bm = min(block_dim(chunk), tiles.scan_block_m)
    _chunk_scan_kernel[(Nc, H, triton.cdiv(chunk, bm))](
        x,
        B,
        C,
        dt,
        cs,
        D,
        prev,
        layout.chunk_start,
        layout.chunk_len,
        y,
        H,
        P,
        N,
        H // G,
        *x.stride(),
        *B.stride(),
        *C.stride(),
        *dt.stride(),
        y.stride(0),
        y.stride(1),
        CHUNK=chunk,
        BLOCK_M=bm,
        BLOCK_K=min(bm, tiles.scan_block_k),
        BLOCK_P=block_dim(P),
        BLOCK_N=block_dim(N),
        DOT_PRECISION=prec,
        num_warps=tiles.scan_warps,
        num_stages=2,
    )
    return y, states


@dataclass(frozen=True)
class SsuTiles:
    """Launch shape of `_ssu_kernel` on the pool: a program holds block_p rows of one (request, head) state [P, N]."""

    block_p: int = 16  # state rows (of P) per program
    warps: int = 4  # warps per program


# Launch shapes benchmarks/ssu_bench.py compares at Nano's decode sizes (the GPU tests check each); the first is the
# default below LARGE_SSU_BATCH requests, the third (whole 64-row heads) from there on.
SSU_TILE_VARIANTS = tuple(SsuTiles(p, w) for p, w in ((16, 4), (32, 4), (64, 4), (64, 8), (32, 8), (16, 2), (8, 2)))
# From this many requests a program takes 64 state rows: on the H200 (ssu_bench, Nano shapes) 64-row programs move
# the fp32 state at 88-89 % of copy bandwidth at B = 256 and 1024 against 85 / 81 % for 16-row ones (bf16 states:
# 85-87 against 78-80 %); small batches keep more, smaller programs.
LARGE_SSU_BATCH = 128


def ssu_tiles(batch: int) -> SsuTiles:
    """The decode SSU's launch shape for `batch` requests."""
    return SSU_TILE_VARIANTS[2] if batch >= LARGE_SSU_BATCH else SSU_TILE_VARIANTS[0]


@triton.jit
def _softplus(v):
    """torch's F.softplus (threshold 20) in fp32: max(v, 0) + log1p(exp(-|v|)). log1p(u), u in (0, 1], is a series
    below 1/16 (truncation < 3e-11 relative): on the GPU tl.log is lg2.approx, whose absolute error would swamp
    log(1 + u) for small u; above it log(1 + u) >= 0.06 and the approximation is good to ~2e-6 relative."""
    u = tl.exp(-tl.abs(v))
    series = u * (1.0 - u * (0.5 - u * (1.0 / 3 - u * (0.25 - u * (0.2 - u * (1.0 / 6 - u * (1.0 / 7 - u * 0.125)))))))
    lp = tl.where(u < 0.0625, series, tl.log(1.0 + u))
    return tl.where(v > 20.0, v, tl.maximum(v, 0.0) + lp)


@triton.jit
def _ssu_kernel(
    state_ptr,
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    y_ptr,
    new_ptr,
    slot_ptr,
    dt_bias_ptr,
    dt_lo,
    dt_hi,
    H,
    P,
    N,
    heads_per_group,
    s_st_b,
    s_st_h,
    s_x_b,
    s_x_h,
    s_dt_b,
    s_dt_h,
    s_b_b,
    s_b_g,
    s_c_b,
    s_c_g,
    s_y_b,
    s_y_h,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    RAW_DT: tl.constexpr,
    DT_CLAMP: tl.constexpr,
    PDL: tl.constexpr,
    STATE_BF16: tl.constexpr = False,
):
    """One program: request b, head h, BLOCK_P rows of the head's [P, N] state (read, advanced and read out into y in
    fp32, stored in the state's dtype).
    HAS_SLOTS: state rows are pool slots slot_ptr[b] and new_ptr is the pool itself (in place).
    RAW_DT: dt is in_proj's raw dt and A_ptr holds A_log: dt <- softplus(dt + dt_bias) (clamped to [dt_lo, dt_hi]
    if DT_CLAMP), A = -exp(A_log), all fp32."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // heads_per_group
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp, mn = offs_p < P, offs_n < N
    m2 = mp[:, None] & mn[None, :]
    st_off = offs_p[:, None] * N + offs_n[None, :]
    row = b
    dst_ptr = new_ptr
    a = tl.load(A_ptr + h).to(tl.float32)
    d_skip = tl.load(D_ptr + h).to(tl.float32)
    pdl_wait(PDL)  # weights above, everything an earlier kernel writes below
    if HAS_SLOTS:  # one base pointer for the in-place read and write
        row = tl.load(slot_ptr + b).to(tl.int64)
        dst_ptr = state_ptr
    st = tl.load(state_ptr + row * s_st_b + h * s_st_h + st_off, mask=m2, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b * s_x_b + h * s_x_h + offs_p, mask=mp, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b * s_dt_b + h * s_dt_h).to(tl.float32)
    if RAW_DT:
        dt = _softplus(dt + tl.load(dt_bias_ptr + h).to(tl.float32))
        if DT_CLAMP:
            dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
        a = -tl.exp(a)
    bv = tl.load(B_ptr + b * s_b_b + g * s_b_g + offs_n, mask=mn, other=0.0).to(tl.float32)
    cv = tl.load(C_ptr + b * s_c_b + g * s_c_g + offs_n, mask=mn, other=0.0).to(tl.float32)
    pdl_release(PDL)
    new = st * tl.exp(dt * a) + (dt * x)[:, None] * bv[None, :]
    stored = new
    if STATE_BF16:
        stored = _round_to_bf16(new).to(tl.bfloat16)  # exact: the value is a bf16 already
    tl.store(dst_ptr + row * s_st_b + h * s_st_h + st_off, stored, mask=m2)
    y = tl.sum(new * cv[None, :], axis=1) + d_skip * x
    tl.store(y_ptr + b * s_y_b + h * s_y_h + offs_p, y, mask=mp)


def _check_ssu_args(x, dt, A, B, C, D) -> tuple[int, int, int, int, int]:
    """Shared checks of the decode launchers; returns (Bq, H, P, G, N)."""
    Bq, H, P, G, N = _check_scan_inputs(x, dt, A, B, C, D)
    if H % G:
        raise ValueError(f"heads {H} not divisible by groups {G}")
    for name, t in (("x", x), ("B", B), ("C", C)):
        check_inner_contiguous(name, t)
    return Bq, H, P, G, N


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step (Triton). state [Bq, H, P, N] fp32, x [Bq, H, P], dt [Bq, H] fp32, A [H],
    B/C [Bq, G, N] (unit stride in N), D [H]. Returns (y [Bq, H, P] fp32, new_state [Bq, H, P, N] fp32)."""
    Bq, H, P, G, N = _check_ssu_args(x, dt, A, B, C, D)
    check_shape("state", state, (Bq, H, P, N))
    check_dtype("state", state, (torch.float32,))
    check_same_device(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D)
    state = state.contiguous()
    new = torch.empty_like(state)
    y = torch.empty(Bq, H, P, dtype=torch.float32, device=x.device)
    if Bq == 0:
        return y, new
    bp = min(block_dim(P, 1), 16)
    _ssu_kernel[(Bq, H, triton.cdiv(P, bp))](
        state,
        x,
        dt,
        A,
        B,
        C,
        D,
        y,
        new,
        x,
        dt,
        0.0,
        0.0,
        H,
        P,
        N,
        H // G,
        state.stride(0),
        state.stride(1),
        x.stride(0),
        x.stride(1),
        dt.stride(0),
        dt.stride(1),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        y.stride(0),
        y.stride(1),
        BLOCK_P=bp,
        BLOCK_N=block_dim(N, 1),
        HAS_SLOTS=False,
        RAW_DT=False,
        PDL=False,
        DT_CLAMP=False,
        num_warps=4,
    )
    return y, new


def selective_state_update_slots(
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    tiles: SsuTiles | None = None,
) -> torch.Tensor:
    """One decode step on the pool in place (Triton), see `ssd.selective_state_update_slots_ref`.
    ssm_pool [S, H, P, N] fp32 (or bf16: read into fp32, stored back rounded to nearest) with unit-stride (P, N) rows,
    slot_ids [Bq] int64. Returns y [Bq, H, P] fp32."""
    _check_ssu_slots_args(ssm_pool, slot_ids, x, dt, A, B, C, D)
    return _launch_ssu_slots(ssm_pool, slot_ids, x, dt, A, B, C, D, None, None, tiles)


def selective_state_update_slots_raw_dt(
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_clamp: tuple[float, float],
    tiles: SsuTiles | None = None,
) -> torch.Tensor:
    """One decode step on the pool in place from the raw parameters, in one launch (Triton), see
    `ssd.selective_state_update_slots_raw_dt_ref`: dt [Bq, H] raw (any float dtype, rows may be strided, e.g. a split
    of in_proj's output), A_log [H], dt_bias [H]; softplus(dt + dt_bias), the clamp and A = -exp(A_log) are computed
    in fp32 inside the kernel. Other arguments as `selective_state_update_slots`. Returns y [Bq, H, P] fp32."""
    _check_ssu_slots_args(ssm_pool, slot_ids, x, dt, A_log, B, C, D)
    check_shape("dt_bias", dt_bias, (x.shape[1],))
    check_dtype("dt", dt, _FLOATS)
    check_same_device(x=x, dt_bias=dt_bias)
    return _launch_ssu_slots(ssm_pool, slot_ids, x, dt, A_log, B, C, D, dt_bias, dt_clamp, tiles)


def _check_ssu_slots_args(ssm_pool, slot_ids, x, dt, A, B, C, D) -> None:
    Bq, H, P, G, N = _check_ssu_args(x, dt, A, B, C, D)
    check_dim("ssm_pool", ssm_pool, 4)
    check_shape("ssm_pool", ssm_pool[:0], (0, H, P, N))
    check_dtype("ssm_pool", ssm_pool, _STATE_DTYPES)
    if ssm_pool.stride(3) != 1 or ssm_pool.stride(2) != N:
        raise ValueError(f"ssm_pool must have contiguous [P, N] rows, got strides {ssm_pool.stride()}")
    check_shape("slot_ids", slot_ids, (Bq,))
    check_same_device(ssm_pool=ssm_pool, slot_ids=slot_ids, x=x, dt=dt, A=A, B=B, C=C, D=D)


def _launch_ssu_slots(ssm_pool, slot_ids, x, dt, A, B, C, D, dt_bias, dt_clamp, tiles: SsuTiles | None) -> torch.Tensor:
    """dt_bias None: dt and A are final (fp32 dt, A); else dt is raw, A is A_log and dt_clamp = (lo, hi).
    tiles None: `ssu_tiles` of the batch."""
    Bq, H, P = x.shape
    tiles = tiles or ssu_tiles(Bq)
    G, N = B.shape[1], B.shape[2]
    y = torch.empty(Bq, H, P, dtype=torch.float32, device=x.device)
    if Bq == 0:
        return y
    raw = dt_bias is not None
    lo, hi = dt_clamp if raw else (0.0, float("inf"))
    clamp = raw and (lo > 0.0 or hi != float("inf"))  # exactly when `ssd.dt_softplus_clamp` clamps
    hi = min(float(hi), torch.finfo(torch.float32).max)  # a finite scalar argument; same clamp on finite dt
    bp = min(block_dim(P, 1), tiles.block_p)
    _ssu_kernel[(Bq, H, triton.cdiv(P, bp))](
        ssm_pool,
        x,
        dt,
        A,
        B,
        C,
        D,
        y,
        ssm_pool,
        slot_ids,
        dt_bias if raw else dt,
        float(lo),
        hi,
        H,
        P,
        N,
        H // G,
        ssm_pool.stride(0),
        ssm_pool.stride(1),
        x.stride(0),
        x.stride(1),
        dt.stride(0),
        dt.stride(1),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        y.stride(0),
        y.stride(1),
        BLOCK_P=bp,
        BLOCK_N=block_dim(N, 1),
        HAS_SLOTS=True,
        RAW_DT=raw,
        DT_CLAMP=clamp,
        STATE_BF16=ssm_pool.dtype == torch.bfloat16,
        num_warps=tiles.warps,
        **pdl_args(x),
    )
    return y
