"""Triton causal depthwise conv1d: varlen prefill with per-request initial states, and the decode update.

Same signatures and semantics as `conv1d.causal_conv1d_varlen_ref` / `conv1d.causal_conv1d_update_ref`.
Request i reads `ext_i = [init_state_i (K-1 columns, rounded to x's dtype) | x_i]`; the output is
silu(conv + bias) in x's dtype, accumulated in fp32. `conv_state_windows` stays the torch reference
(`conv1d.conv_state_windows_ref`): it is one gather of n * D * (K-1) elements per call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from service.engine.kernels.triton_common import (block_dim, check_dim, check_inner_contiguous, check_same_device,
                                                  check_shape)


@dataclass(frozen=True)
class ConvTiles:
    """Launch shape of `_conv_varlen_kernel`."""
    block_t: int = 16             # tokens per program
    block_d: int = 128            # channels per program
    warps: int = 4                # warps per program


@triton.jit
def _conv_varlen_kernel(x_ptr, w_ptr, bias_ptr, init_ptr, qsl_ptr, token_req_ptr, out_ptr, T, Dm,
                        s_x_t, s_w_d, s_w_k, s_i_b, s_i_d, s_i_k, s_o_t,
                        K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mt, md = offs_t < T, offs_d < Dm
    req = tl.load(token_req_ptr + offs_t, mask=mt, other=0)
    j = offs_t - tl.load(qsl_ptr + req, mask=mt, other=0)        # position inside the request's extend
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    needs_state = tl.min(tl.where(mt, j, K)) < K - 1              # some row reads its request's initial state
    for k in tl.static_range(K):
        m = j + k                                                 # column of ext_i
        rows = (offs_t + (k - (K - 1))).to(tl.int64)
        xv = tl.load(x_ptr + rows[:, None] * s_x_t + offs_d[None, :],
                     mask=(mt & (m >= K - 1))[:, None] & md[None, :], other=0.0)
        w = tl.load(w_ptr + offs_d * s_w_d + k * s_w_k, mask=md, other=0.0).to(tl.float32)
        xf = xv.to(tl.float32)
        if k < K - 1:
            if needs_state:
                sv = tl.load(init_ptr + req.to(tl.int64)[:, None] * s_i_b + offs_d[None, :] * s_i_d
                             + m[:, None] * s_i_k, mask=(mt & (m < K - 1))[:, None] & md[None, :], other=0.0)
                xf += sv.to(xv.dtype).to(tl.float32)
        acc += xf * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=md, other=0.0).to(tl.float32)[None, :]
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * s_o_t + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mt[:, None] & md[None, :])


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


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         init_states: torch.Tensor, query_start_loc: torch.Tensor,
                         token_req: torch.Tensor) -> torch.Tensor:
    """Varlen causal conv (Triton), see `causal_conv1d_varlen_tiled`."""
    return causal_conv1d_varlen_tiled(x, weight, bias, init_states, query_start_loc, token_req, ConvTiles())


def causal_conv1d_varlen_tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               init_states: torch.Tensor, query_start_loc: torch.Tensor, token_req: torch.Tensor,
                               tiles: ConvTiles) -> torch.Tensor:
    """Varlen causal conv (Triton). x [T, D] (rows may be strided, unit stride in D), weight [D, K],
    bias [D] or None, init_states [Bq, D, K-1], query_start_loc [Bq+1], token_req [T].
    Returns silu(conv(x) + bias) [T, D] in x's dtype."""
    T, Dm, K = _check_conv_args(x, weight, bias)
    check_dim("init_states", init_states, 3)
    Bq = init_states.shape[0]
    check_shape("init_states", init_states, (Bq, Dm, K - 1))
    check_shape("query_start_loc", query_start_loc, (Bq + 1,))
    check_shape("token_req", token_req, (T,))
    check_inner_contiguous("x", x)
    check_same_device(x=x, weight=weight, init_states=init_states, query_start_loc=query_start_loc,
                      token_req=token_req)
    out = torch.empty(T, Dm, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    bt, bd = tiles.block_t, min(block_dim(Dm), tiles.block_d)
    _conv_varlen_kernel[(triton.cdiv(T, bt), triton.cdiv(Dm, bd))](
        x, weight, bias if bias is not None else weight, init_states, query_start_loc, token_req, out, T, Dm,
        x.stride(0), weight.stride(0), weight.stride(1), *init_states.stride(), out.stride(0),
        K=K, HAS_BIAS=bias is not None, BLOCK_T=bt, BLOCK_D=bd, num_warps=tiles.warps)
    return out


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, new_ptr, slot_ptr, Dm,
                        s_x_b, s_w_d, s_w_k, s_s_b, s_s_d, s_s_k, s_n_b, s_n_d, s_n_k, s_o_b,
                        K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """HAS_SLOTS: state rows are pool slots slot_ptr[b] and new_ptr is the pool (in place: column k is read
    before column k-1 is overwritten, each by the thread that owns it)."""
    b = tl.program_id(0).to(tl.int64)
    row = b
    dst_ptr = new_ptr
    if HAS_SLOTS:                      # one base pointer for the in-place read and write
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
    tl.store(dst_ptr + row * s_n_b + offs_d * s_n_d + (K - 2) * s_n_k, xv.to(dst_ptr.dtype.element_ty), mask=md)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + b * s_o_b + offs_d, out.to(out_ptr.dtype.element_ty), mask=md)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        x, weight, bias if bias is not None else weight, state, out, new, x, Dm, x.stride(0),
        weight.stride(0), weight.stride(1), *state.stride(), *new.stride(), out.stride(0),
        K=K, HAS_BIAS=bias is not None, BLOCK_D=bd, HAS_SLOTS=False, num_warps=4)
    return out, new


def causal_conv1d_update_slots(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               conv_pool: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
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
        x, weight, bias if bias is not None else weight, conv_pool, out, conv_pool, slot_ids, Dm, x.stride(0),
        weight.stride(0), weight.stride(1), *conv_pool.stride(), *conv_pool.stride(), out.stride(0),
        K=K, HAS_BIAS=bias is not None, BLOCK_D=bd, HAS_SLOTS=True, num_warps=4)
    return out
