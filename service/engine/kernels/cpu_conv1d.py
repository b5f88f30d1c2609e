"""Fast pure-torch causal depthwise conv1d for the `torch` bundle (tuned on CPU). Same contracts as
`conv1d.causal_conv1d_varlen_ref`, `conv1d.conv_state_windows_ref` and `conv1d.causal_conv1d_update_slots_ref`
(the oracles the tests compare against).

- `causal_conv1d_varlen`: the packed batch is laid out once as `[state_0 | x_0 | state_1 | x_1 | ...]` (each
  request's K-1 state columns right before its tokens), so every token's window is K consecutive rows and the conv
  is K shifted multiply-adds over that buffer (no [T, K, D] window gather, no einsum).
  When every request has the same length the buffer is [B, K-1 + L, D] (slice copies, output in token order).
  The multiply-adds run block by block (`CONV_BLOCK_ROWS` rows: each block's operands stay in the core's L2 cache
  across the K passes and the silu) with the taps as contiguous rows of a [K, D] copy of the weight (a broadcast
  operand with stride K does not vectorize): about half the time of whole-tensor passes at 8192 x 512.
- `conv_state_windows`: gathers only the rows of the states it returns.
- `causal_conv1d_update_slots`: K multiply-adds of [B, D] columns (the state's K-1 and x) with the contiguous taps,
  then the state shifted by one column in place (no [B, D, K] window: a `cat` with a last dimension of K-1 and 1 and
  a `vecdot` over K cost more, 0.27 vs 0.22 ms at B=32, D=512) as one contiguous shift of the flat rows by one
  element (the strided column copies cost about 2.5x as much), on a view of the pool when the slots are one
  ascending run (else one gathered copy written back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.engine.kernels.cpu_ssd import ascending_run

CONV_BLOCK_ROWS = 512  # buffer rows per block of the prefill conv ([rows, D] fp32 operands stay in L2)


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
    taps, b = _taps(weight, bias)
    acc = torch.empty(n - km1, Dm, dtype=torch.float32, device=x.device)  # row r: window buf[r : r + K]
    for r0 in range(0, n - km1, CONV_BLOCK_ROWS):
        r1 = min(n - km1, r0 + CONV_BLOCK_ROWS)
        _conv_block(acc[r0:r1], buf[r0 : r1 + km1], taps, b)
    return acc[token_rows - km1].to(x.dtype)


def _taps(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight [D, K] -> (taps [K, D] fp32 contiguous, bias [D] fp32 or None)."""
    return weight.t().float().contiguous(), None if bias is None else bias.float()


def _conv_block(acc: torch.Tensor, buf: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None) -> None:
    """acc [..., m, D] fp32 = silu(sum_k buf[..., k : k + m, :] * taps[k] + bias), buf [..., m + K - 1, D] fp32."""
    m, K = acc.shape[-2], taps.shape[0]
    if bias is None:
        torch.mul(buf[..., :m, :], taps[0], out=acc)
    else:
        torch.addcmul(bias, buf[..., :m, :], taps[0], out=acc)
    for k in range(1, K):
        acc.addcmul_(buf[..., k : k + m, :], taps[k])
    F.silu(acc, inplace=True)


def _conv_equal_lengths(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, init_states: torch.Tensor
) -> torch.Tensor:
    """`causal_conv1d_varlen` when all B requests have L = T / B tokens: blocks of requests ([b, K-1 + L, D] buffer
    filled by two slice copies), the output written in token order (no scatter, no gather)."""
    T, Dm = x.shape
    B, K = init_states.shape[0], weight.shape[1]
    km1, L = K - 1, T // B
    taps, b = _taps(weight, bias)
    per_block = max(1, CONV_BLOCK_ROWS // (km1 + L))
    buf = torch.empty(min(B, per_block), km1 + L, Dm, dtype=torch.float32, device=x.device)
    out = torch.empty(B, L, Dm, dtype=torch.float32, device=x.device)
    xs = x.view(B, L, Dm)
    for i in range(0, B, per_block):
        j = min(B, i + per_block)
        blk = buf[: j - i]
        blk[:, :km1] = init_states[i:j].transpose(1, 2)
        blk[:, km1:] = xs[i:j]
        _conv_block(out[i:j], blk, taps, b)
    return out.view(T, Dm).to(x.dtype)


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
    taps, b = _taps(weight, bias)
    km1 = taps.shape[0] - 1
    out = torch.mul(x.float(), taps[km1]) if b is None else torch.addcmul(b, x.float(), taps[km1])
    for k in range(km1):
        out.addcmul_(state[:, :, k].float(), taps[k])
    if km1 > 1 and state.is_contiguous():  # shift left by one column: on the flat [B, D * (K-1)] rows, a
        flat = state.view(Bt, -1)  # contiguous shift by one element (each channel's last column takes the next
        flat[:, :-1] = flat[:, 1:].clone()  # channel's first; x overwrites it below): 2-3x faster than strided
    elif km1 > 1:
        state[:, :, :-1] = state[:, :, 1:].clone()
    state[:, :, -1] = x
    if first is None:
        conv_pool.index_copy_(0, slot_ids, state)
    return F.silu(out, inplace=True).to(x.dtype)
