"""Causal depthwise conv1d over a packed batch, with per-request initial conv states.

Request i's input is conceptually `ext_i = [conv_state_i (K-1 columns) | x_i (l_i columns)]`; token j of
request i reads `ext_i[j : j+K]`. The conv state after r new tokens is `ext_i[r : r+K-1]`, i.e. the raw
pre-conv inputs at absolute positions [p_i + r - (K-1), p_i + r), falling back to the initial state
columns near the start of the extend (docs/design.md: Chunk-aligned SSD, conv window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _ext_index(
    query_start_loc: torch.Tensor, req_idx: torch.Tensor, m: torch.Tensor, k_minus_1: int, num_reqs: int
) -> torch.Tensor:
    """Index into buf = [states as B*(K-1) rows | x rows] of column m of ext_{req_idx}."""
    in_state = m < k_minus_1
    state_idx = req_idx * k_minus_1 + m
    x_idx = num_reqs * k_minus_1 + query_start_loc[req_idx] + m - k_minus_1
    return torch.where(in_state, state_idx, x_idx)


def _ext_buffer(x: torch.Tensor, init_states: torch.Tensor) -> torch.Tensor:
    """x [T, D], init_states [B, D, K-1] -> buf [B*(K-1) + T, D]."""
    return torch.cat([init_states.transpose(1, 2).reshape(-1, x.shape[1]).to(x.dtype), x], dim=0)


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    init_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req: torch.Tensor,
) -> torch.Tensor:
    """x [T, D] raw inputs, weight [D, K], bias [D] or None, init_states [B, D, K-1],
    query_start_loc [B+1], token_req [T] (request index of each token).
    Returns silu(conv(x) + bias) [T, D] in x's dtype (accumulated in fp32)."""
    T, Dm = x.shape
    K = weight.shape[1]
    B = init_states.shape[0]
    buf = _ext_buffer(x, init_states).float()
    j = torch.arange(T, device=x.device) - query_start_loc[token_req]  # local position
    m = j[:, None] + torch.arange(K, device=x.device)[None, :]  # [T, K]
    idx = _ext_index(query_start_loc, token_req[:, None].expand(T, K), m, K - 1, B)
    windows = buf[idx]  # [T, K, D]
    out = torch.einsum("tkd,dk->td", windows, weight.float())
    if bias is not None:
        out = out + bias.float()
    return F.silu(out).to(x.dtype)


def conv_state_windows_ref(
    x: torch.Tensor,
    init_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    req_idx: torch.Tensor,
    num_new_tokens: torch.Tensor,
) -> torch.Tensor:
    """Conv state of request req_idx[j] after num_new_tokens[j] of its new tokens: [n, D, K-1].

    x [T, D], init_states [B, D, K-1]; num_new_tokens in [0, l_i]."""
    km1 = init_states.shape[2]
    B = init_states.shape[0]
    buf = _ext_buffer(x, init_states)
    m = num_new_tokens[:, None] + torch.arange(km1, device=x.device)[None, :]  # [n, K-1]
    idx = _ext_index(query_start_loc, req_idx[:, None].expand_as(m), m, km1, B)
    return buf[idx].transpose(1, 2).to(init_states.dtype)  # [n, D, K-1]


def causal_conv1d_update_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode: x [B, D], state [B, D, K-1] -> (silu(conv) [B, D], new_state [B, D, K-1])."""
    window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [B, D, K]
    out = (window.float() * weight.float()[None]).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return F.silu(out).to(x.dtype), window[:, :, 1:].to(state.dtype)


def causal_conv1d_update_slots_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    """Decode conv on the pool in place: x [B, D], conv_pool [S, D, K-1], slot_ids [B] int64 (distinct, except
    padding rows on the scratch slot 0). conv_pool[slot_ids] becomes the new state; returns silu(conv) [B, D]."""
    out, new = causal_conv1d_update_ref(x, weight, bias, conv_pool[slot_ids])
    conv_pool[slot_ids] = new
    return out
