"""Fast pure-torch causal depthwise conv1d for the `torch` bundle (tuned on CPU). Same contracts as
`conv1d.causal_conv1d_varlen_ref`, `conv1d.conv_state_windows_ref` and `conv1d.causal_conv1d_update_slots_ref`
(the oracles the tests compare against).

- `causal_conv1d_varlen`: the packed batch is laid out once as `[state_0 | x_0 | state_1 | x_1 | ...]` (each
  request's K-1 state columns right before its tokens), so every token's window is K consecutive rows and the conv
  is K shifted multiply-adds over that buffer (no [T, K, D] window gather, no einsum).
  When every request has the same length the buffer is [B, K-1 + L, D] (slice copies, output in token order).
- `conv_state_windows`: gathers only the rows of the states it returns.
- `causal_conv1d_update_slots`: one [B, D, K] window (state | x) gives the taps (`vecdot` with the weight) and the
  shifted state (one copy back), on a view of the pool when the slots are one ascending run (else one gathered copy
  written back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.engine.kernels.cpu_ssd import ascending_run


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    init_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req: torch.Tensor,
) -> torch.Tensor:
    """x [T, D], weight [D, K], bias [D] or None, init_states [B, D, K-1], query_start_loc [B+1], token_req [T]
    -> silu(conv(x) + bias) [T, D] in x's dtype (fp32 accumulation)."""
    T, Dm = x.shape
    K = weight.shape[1]
    B = init_states.shape[0]
    km1 = K - 1
    if B and T % B == 0 and torch.equal(query_start_loc, torch.arange(B + 1, device=x.device) * (T // B)):
        return _conv_equal_lengths(x, weight, bias, init_states)
    n = T + B * km1
    reqs = torch.arange(B, device=x.device)
    # request i's state rows start at query_start_loc[i] + i*(K-1); its token t sits at t + (i+1)*(K-1)
    state_rows = (query_start_loc[:-1] + reqs * km1)[:, None] + torch.arange(km1, device=x.device)[None, :]
    token_rows = torch.arange(T, device=x.device) + (token_req + 1) * km1
    buf = torch.empty(n, Dm, dtype=torch.float32, device=x.device)
    buf[state_rows.flatten()] = init_states.transpose(1, 2).reshape(B * km1, Dm).float()
    buf[token_rows] = x.float()
    w = weight.float()
    m = n - km1  # row r of acc: window buf[r : r + K]
    acc = buf[:m] * w[:, 0]
    for k in range(1, K):
        acc.addcmul_(buf[k : k + m], w[:, k])
    out = acc[token_rows - km1]
    if bias is not None:
        out += bias.float()
    return F.silu(out, inplace=True).to(x.dtype)


def _conv_equal_lengths(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, init_states: torch.Tensor
) -> torch.Tensor:
    """`causal_conv1d_varlen` when all B requests have L = T / B tokens: the buffer is [B, K-1 + L, D] filled by
    two slice copies, and the K multiply-adds write [B, L, D] in token order (no scatter, no gather)."""
    T, Dm = x.shape
    B, K = init_states.shape[0], weight.shape[1]
    km1, L = K - 1, T // B
    buf = torch.empty(B, km1 + L, Dm, dtype=torch.float32, device=x.device)
    buf[:, :km1] = init_states.transpose(1, 2)
    buf[:, km1:] = x.view(B, L, Dm)
    w = weight.float()
    acc = torch.mul(buf[:, :L], w[:, 0]) if bias is None else torch.addcmul(bias.float(), buf[:, :L], w[:, 0])
    for k in range(1, K):
        acc.addcmul_(buf[:, k : k + L], w[:, k])
    return F.silu(acc, inplace=True).view(T, Dm).to(x.dtype)


def conv_state_windows(
    x: torch.Tensor,
    init_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    req_idx: torch.Tensor,
    num_new_tokens: torch.Tensor,
) -> torch.Tensor:
    """`conv1d.conv_state_windows_ref`: the conv state of request req_idx[j] after num_new_tokens[j] of its new
    tokens, [n, D, K-1] in init_states' dtype. Gathers just the n * (K-1) rows it returns (the reference builds the
    whole [state | tokens] buffer first)."""
    km1 = init_states.shape[2]
    m = num_new_tokens[:, None] + torch.arange(km1, device=x.device)[None, :]  # [n, K-1] column of ext
    from_x = m >= km1
    rows = (query_start_loc[req_idx][:, None] + m - km1).clamp_(min=0)
    tokens = x[rows].transpose(1, 2).to(init_states.dtype)  # [n, D, K-1]
    states = init_states[req_idx].gather(2, m.clamp(max=km1 - 1)[:, None, :].expand(-1, init_states.shape[1], -1))
    return torch.where(from_x[:, None, :], tokens, states)


def causal_conv1d_update_slots(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    """x [B, D], weight [D, K], conv_pool [S, D, K-1] updated in place at slot_ids [B] -> silu(conv) [B, D]."""
    Bt = x.shape[0]
    first = ascending_run(slot_ids)
    state = conv_pool[first : first + Bt] if first is not None else conv_pool.index_select(0, slot_ids)
    window = torch.cat([state, x[:, :, None].to(state.dtype)], 2)  # [B, D, K]: the taps, then the shifted state
    out = torch.linalg.vecdot(window.float(), weight.float())
    if bias is not None:
        out += bias.float()
    state.copy_(window[:, :, 1:])
    if first is None:
        conv_pool.index_copy_(0, slot_ids, state)
    return F.silu(out, inplace=True).to(x.dtype)
