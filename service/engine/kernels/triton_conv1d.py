"""Triton causal depthwise conv1d: varlen prefill with per-request initial states, and the decode update.

Same signatures and semantics as `conv1d.causal_conv1d_varlen_ref` / `conv1d.causal_conv1d_update_ref`.
Request i reads `ext_i = [init_state_i (K-1 columns, rounded to x's dtype) | x_i]`; the output is
silu(conv + bias) in x's dtype, accumulated in fp32. `conv_state_windows` stays the torch reference
(`conv1d.conv_state_windows_ref`): it is one gather of n * D * (K-1) elements per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.engine.kernels.tiles import CONV_TILE_VARIANTS, ConvTiles
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


@triton.jit
def _window_col(
    x_ptr,
    init_ptr,
    t,
    j,
    req,
    offs_d,
    Dm,
    s_x_t,
    s_i_b,
    s_i_d,
    s_i_k,
    s: tl.constexpr,
    K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """fp32 input s rows before token t, at position j of request req: x[t - s] when j >= s, else column
    j - s + K - 1 of req's initial state rounded to x's dtype; zeros when s >= K (the conv has no such tap)."""
    out = tl.zeros((BLOCK_D,), tl.float32)
    if s < K:  # masks as channel limits (a scalar & vector mask trips the interpreter)
        xv = tl.load(
            x_ptr + tl.cast(t - s, tl.int64) * s_x_t + offs_d, mask=offs_d < tl.where(j >= s, Dm, 0), other=0.0
        )
        sv = tl.load(
            init_ptr + req.to(tl.int64) * s_i_b + offs_d * s_i_d + (j - s + K - 1) * s_i_k,
            mask=offs_d < tl.where(j < s, Dm, 0),
            other=0.0,
        )
        out = xv.to(tl.float32) + sv.to(xv.dtype).to(tl.float32)
    return out


@triton.jit
def _window(x_ptr, init_ptr, t, j, req, offs_d, Dm, s_x_t, s_i_b, s_i_d, s_i_k, K: tl.constexpr, BLOCK_D: tl.constexpr):
    """The inputs 1, 2 and 3 rows before token t (see `_window_col`)."""
    w1 = _window_col(x_ptr, init_ptr, t, j, req, offs_d, Dm, s_x_t, s_i_b, s_i_d, s_i_k, 1, K, BLOCK_D)
    w2 = _window_col(x_ptr, init_ptr, t, j, req, offs_d, Dm, s_x_t, s_i_b, s_i_d, s_i_k, 2, K, BLOCK_D)
    w3 = _window_col(x_ptr, init_ptr, t, j, req, offs_d, Dm, s_x_t, s_i_b, s_i_d, s_i_k, 3, K, BLOCK_D)
    return w1, w2, w3


@triton.jit
def _weight_col(w_ptr, offs_d, md, s_w_d, s_w_k, k: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 weight column k; zeros for k < 0 (a tap the conv does not have)."""
    w = tl.zeros((BLOCK_D,), tl.float32)
    if k >= 0:
        w = tl.load(w_ptr + offs_d * s_w_d + k * s_w_k, mask=md, other=0.0).to(tl.float32)
    return w


@triton.jit
def _load_rows(x_ptr, rows, t_end, s_x_t, offs_d, md):
    """x rows [ROWS, BLOCK_D] (zeros at rows >= t_end)."""
    return tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * s_x_t + offs_d[None, :],
        mask=(rows < t_end)[:, None] & md[None, :],
        other=0.0,
    )


@triton.jit
def _silu_store(out_ptr, row, s_o_t, offs_d, lim, y):
    """Store silu(y) as output row `row`, channels below lim."""
    tl.store(
        out_ptr + tl.cast(row, tl.int64) * s_o_t + offs_d,
        (y * tl.sigmoid(y)).to(out_ptr.dtype.element_ty),
        mask=offs_d < lim,
    )


@triton.jit
def _rows_one_request(out_ptr, xs, t, t_end, s_o_t, offs_d, Dm, w1, w2, w3, wx, wa, wb, wc, bias, ROWS: tl.constexpr):
    """Conv of a step's rows t + [0, ROWS) (xs [ROWS, BLOCK_D] fp32, all of one request), each stored as soon as
    it is done; returns the slid window."""
    offs_r = tl.arange(0, ROWS)
    for u in tl.static_range(ROWS):
        xu = tl.sum(tl.where(offs_r[:, None] == u, xs, 0.0), axis=0)  # row u: in-thread, no shuffle
        _silu_store(
            out_ptr, t + u, s_o_t, offs_d, tl.where(t + u < t_end, Dm, 0), bias + wx * xu + wa * w1 + wb * w2 + wc * w3
        )
        w3, w2, w1 = w2, w1, xu
    return w1, w2, w3


@triton.jit(do_not_specialize=("T",))  # per-step sizes: triton_common's docstring
def _conv_varlen_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    init_ptr,
    qsl_ptr,
    token_req_ptr,
    out_ptr,
    T,
    Dm,
    s_x_t,
    s_w_d,
    s_w_k,
    s_i_b,
    s_i_d,
    s_i_k,
    s_o_t,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    VEC: tl.constexpr,
):
    """w1, w2, w3: the inputs 1, 2, 3 rows back in the current request's ext (fp32), slid along the tokens. A step
    of ROWS tokens inside one request (token_req is non-decreasing, so: its last token has the request of the
    token before the step) runs unrolled; a step where a request starts goes token by token, and at a request's
    first token the window becomes its initial state."""
    t0 = tl.program_id(0) * BLOCK_T
    # at most VEC = BLOCK_D / threads contiguous channels per access: each thread then holds whole columns of a
    # [ROWS, BLOCK_D] step (rows in-thread) instead of the compiler spreading rows over warps for wider vectors
    offs_d = tl.max_contiguous(tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D), VEC)
    md = offs_d < Dm
    offs_r = tl.arange(0, ROWS)
    t_end = tl.minimum(t0 + BLOCK_T, T)
    wx = _weight_col(w_ptr, offs_d, md, s_w_d, s_w_k, K - 1, BLOCK_D)
    wa = _weight_col(w_ptr, offs_d, md, s_w_d, s_w_k, K - 2, BLOCK_D)
    wb = _weight_col(w_ptr, offs_d, md, s_w_d, s_w_k, K - 3, BLOCK_D)
    wc = _weight_col(w_ptr, offs_d, md, s_w_d, s_w_k, K - 4, BLOCK_D)
    bias = tl.zeros((BLOCK_D,), tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    r_prev = tl.load(token_req_ptr + t0)
    w1, w2, w3 = _window(
        x_ptr, init_ptr, t0, t0 - tl.load(qsl_ptr + r_prev), r_prev, offs_d, Dm, s_x_t, s_i_b, s_i_d, s_i_k, K, BLOCK_D
    )
    xs = _load_rows(x_ptr, t0 + offs_r, t_end, s_x_t, offs_d, md)
    for t in range(t0, t_end, ROWS):
        xs_next = _load_rows(x_ptr, t + ROWS + offs_r, t_end, s_x_t, offs_d, md)  # in flight during this step
        r_last = tl.load(token_req_ptr + tl.minimum(t + ROWS - 1, T - 1))
        if r_last == r_prev:  # no request starts in this step
            w1, w2, w3 = _rows_one_request(
                out_ptr, xs.to(tl.float32), t, t_end, s_o_t, offs_d, Dm, w1, w2, w3, wx, wa, wb, wc, bias, ROWS
            )
        else:
            for row in range(t, tl.minimum(t + ROWS, t_end)):
                req = tl.load(token_req_ptr + row)
                if req != r_prev:  # the first token of request req (j = 0)
                    w1, w2, w3 = _window(
                        x_ptr, init_ptr, row, 0 * req, req, offs_d, Dm, s_x_t, s_i_b, s_i_d, s_i_k, K, BLOCK_D
                    )
                xu = tl.load(x_ptr + tl.cast(row, tl.int64) * s_x_t + offs_d, mask=md, other=0.0).to(tl.float32)
                _silu_store(out_ptr, row, s_o_t, offs_d, Dm, bias + wx * xu + wa * w1 + wb * w2 + wc * w3)
                w3, w2, w1, r_prev = w2, w1, xu, req
        xs = xs_next


def _check_conv_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int, int]:
    """Shared checks of the conv launchers: x [rows, D], weight [D, K], bias [D] or None; returns (rows, D, K)."""
    check_dim("x", x, 2)
    rows, Dm = x.shape
    check_dim("weight", weight, 2)
    K = weight.shape[1]
    check_shape("weight", weight, (Dm, K))
    if bias is not None:
        check_shape("bias", bias, (Dm,))
    return rows, Dm, K


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    init_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req: torch.Tensor,
) -> torch.Tensor:
    """Varlen causal conv (Triton), see `causal_conv1d_varlen_tiled`."""
    return causal_conv1d_varlen_tiled(x, weight, bias, init_states, query_start_loc, token_req, CONV_TILE_VARIANTS[0])


def causal_conv1d_varlen_tiled(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    init_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req: torch.Tensor,
    tiles: ConvTiles,
) -> torch.Tensor:
    """Varlen causal conv (Triton). x [T, D] (rows may be strided, unit stride in D), weight [D, K] with
    2 <= K <= 4, bias [D] or None, init_states [Bq, D, K-1], query_start_loc [Bq+1], token_req [T] (non-decreasing).
    Returns silu(conv(x) + bias) [T, D] in x's dtype."""
    T, Dm, K = _check_conv_args(x, weight, bias)
    if not 2 <= K <= 4:
        raise ValueError(f"conv width must be 2..4 (the kernel keeps K-1 rows in registers), got {K}")
    if tiles.block_t % tiles.rows:
        raise ValueError(f"block_t {tiles.block_t} must be a multiple of rows {tiles.rows}")
    if any(n & (n - 1) for n in (tiles.rows, tiles.block_d, tiles.warps)):
        raise ValueError(f"rows, block_d and warps must be powers of two, got {tiles}")
    check_dim("init_states", init_states, 3)
    Bq = init_states.shape[0]
    check_shape("init_states", init_states, (Bq, Dm, K - 1))
    check_shape("query_start_loc", query_start_loc, (Bq + 1,))
    check_shape("token_req", token_req, (T,))
    check_inner_contiguous("x", x)
    check_same_device(x=x, weight=weight, init_states=init_states, query_start_loc=query_start_loc, token_req=token_req)
    out = torch.empty(T, Dm, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    bd = min(block_dim(Dm), tiles.block_d)
    warps = max(1, min(tiles.warps, bd // 32))
    _conv_varlen_kernel[(triton.cdiv(T, tiles.block_t), triton.cdiv(Dm, bd))](
        x,
        weight,
        bias if bias is not None else weight,
        init_states,
        query_start_loc,
        token_req,
        out,
        T,
        Dm,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        *init_states.stride(),
        out.stride(0),
        K=K,
        HAS_BIAS=bias is not None,
        BLOCK_T=tiles.block_t,
        BLOCK_D=bd,
        ROWS=tiles.rows,
        VEC=bd // (32 * warps) if bd >= 32 * warps else 1,
        num_warps=warps,
    )
    return out


@triton.jit
def _conv_update_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    state_ptr,
    out_ptr,
    new_ptr,
    slot_ptr,
    Dm,
    s_x_b,
    s_w_d,
    s_w_k,
    s_s_b,
    s_s_d,
    s_s_k,
    s_n_b,
    s_n_d,
    s_n_k,
    s_o_b,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """HAS_SLOTS: state rows are pool slots slot_ptr[b] and new_ptr is the pool (in place: column k is read
    before column k-1 is overwritten, each by the thread that owns it)."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    row = b
    dst_ptr = new_ptr
    if HAS_SLOTS:  # one base pointer for the in-place read and write
        row = tl.load(slot_ptr + b).to(tl.int64)
        dst_ptr = state_ptr
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < Dm
    xv = tl.load(x_ptr + b * s_x_b + offs_d, mask=md, other=0.0)
    acc = xv.to(tl.float32) * tl.load(w_ptr + offs_d * s_w_d + (K - 1) * s_w_k, mask=md, other=0.0).to(tl.float32)
    for k in tl.static_range(K - 1):
        sv = tl.load(state_ptr + row * s_s_b + offs_d * s_s_d + k * s_s_k, mask=md, other=0.0).to(xv.dtype)
        acc += sv.to(tl.float32) * tl.load(w_ptr + offs_d * s_w_d + k * s_w_k, mask=md, other=0.0).to(tl.float32)
        if k > 0:
            tl.store(dst_ptr + row * s_n_b + offs_d * s_n_d + (k - 1) * s_n_k, sv.to(dst_ptr.dtype.element_ty), mask=md)
    pdl_release(PDL)
    tl.store(dst_ptr + row * s_n_b + offs_d * s_n_d + (K - 2) * s_n_k, xv.to(dst_ptr.dtype.element_ty), mask=md)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + b * s_o_b + offs_d, out.to(out_ptr.dtype.element_ty), mask=md)


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode conv (Triton). x [Bq, D] (unit stride in D), weight [D, K], bias [D] or None,
    state [Bq, D, K-1]. Returns (silu(conv) [Bq, D] in x's dtype, new_state [Bq, D, K-1] in state's dtype)."""
    Bq, Dm, K = _check_conv_args(x, weight, bias)
    check_shape("state", state, (Bq, Dm, K - 1))
    check_inner_contiguous("x", x)
    check_same_device(x=x, weight=weight, state=state)
    out = torch.empty(Bq, Dm, dtype=x.dtype, device=x.device)
    new = torch.empty(Bq, Dm, K - 1, dtype=state.dtype, device=x.device)
    if Bq == 0:
        return out, new
    bd = min(block_dim(Dm), 256)
    _conv_update_kernel[(Bq, triton.cdiv(Dm, bd))](
        x,
        weight,
        bias if bias is not None else weight,
        state,
        out,
        new,
        x,
        Dm,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        *state.stride(),
        *new.stride(),
        out.stride(0),
        K=K,
        HAS_BIAS=bias is not None,
        BLOCK_D=bd,
        HAS_SLOTS=False,
        PDL=False,
        num_warps=4,
    )
    return out, new


def causal_conv1d_update_slots(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    """Decode conv on the pool in place (Triton), see `conv1d.causal_conv1d_update_slots_ref`.
    x [Bq, D] (unit stride in D), conv_pool [S, D, K-1], slot_ids [Bq] int64. Returns silu(conv) [Bq, D]."""
    Bq, Dm, K = _check_conv_args(x, weight, bias)
    check_dim("conv_pool", conv_pool, 3)
    check_shape("conv_pool", conv_pool[:0], (0, Dm, K - 1))
    check_shape("slot_ids", slot_ids, (Bq,))
    check_inner_contiguous("x", x)
    check_same_device(x=x, weight=weight, conv_pool=conv_pool, slot_ids=slot_ids)
    out = torch.empty(Bq, Dm, dtype=x.dtype, device=x.device)
    if Bq == 0:
        return out
    bd = min(block_dim(Dm), 256)
    _conv_update_kernel[(Bq, triton.cdiv(Dm, bd))](
        x,
        weight,
        bias if bias is not None else weight,
        conv_pool,
        out,
        conv_pool,
        slot_ids,
        Dm,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        *conv_pool.stride(),
        *conv_pool.stride(),
        out.stride(0),
        K=K,
        HAS_BIAS=bias is not None,
        BLOCK_D=bd,
        HAS_SLOTS=True,
        num_warps=4,
        **pdl_args(x),
    )
    return out
