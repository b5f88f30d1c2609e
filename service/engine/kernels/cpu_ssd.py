"""Fast pure-torch SSD for the `torch` bundle (tuned on CPU): the chunked scan as batched matmuls, and the decode
recurrence in place on the state pool.

Same contracts as `ssd.ssd_varlen_ref` and `ssd.selective_state_update_slots_raw_dt_ref` (the oracles the tests
compare against). What differs:
- `ssd_varlen`: chunks are laid out head-major ([Nc, H, C, *]) so every contraction is one batched matmul; the B·C
  scores are computed once per group (not per head); when every chunk is full the chunks are views of the packed
  tokens (no gather); padded positions are neutralised by a zero dt alone. The requests run in groups of about
  `SSD_BLOCK_CHUNKS` chunks (consecutive whole requests: the scan of one group needs nothing from another), so the
  [chunks, H, C, C] decays and every other temporary of a group stay in the core's L2 cache.
- `selective_state_update_slots_raw_dt`: the state is updated in place (`mul_` + `addcmul_`), on a view of the pool
  when the slots are one ascending run (no gather / scatter), else on one `index_select` copy written back by
  `index_copy_`.
"""

from __future__ import annotations

import torch

from service.engine.kernels.ssd import ChunkLayout, dt_softplus_clamp

SSD_BLOCK_CHUNKS = 8  # chunks per group of whole requests in the prefill scan (at C=64, H=8: 1 MiB of decays)


def _chunked(t: torch.Tensor, layout: ChunkLayout, full: bool) -> torch.Tensor:
    """[T, ...] -> [Nc, C, ...]: a view when every chunk is full, else one `index_select` of whole rows (padded
    rows repeat a real token; callers zero their dt)."""
    c = layout.chunk_size
    if full:
        return t.view(-1, c, *t.shape[1:])
    idx = layout.chunk_start[:, None] + torch.arange(c, device=t.device)[None, :]
    return t.index_select(0, idx.clamp_(max=t.shape[0] - 1).flatten()).view(*idx.shape, *t.shape[1:])


def _inter_chunk(
    local: torch.Tensor, decay: torch.Tensor, initial: torch.Tensor, layout: ChunkLayout, states: torch.Tensor
) -> torch.Tensor:
    """local [Nc, H, P, N] chunk-local end states, decay [Nc, H] whole-chunk decays, initial [B, H, P, N] fp32 or
    bf16 -> prev [Nc, H, P, N] state entering each chunk; states [Nc, H, P, N] fp32 (written) gets the state after
    each chunk; bf16 initial states: every chunk-end state is rounded to bf16, as the reference does."""
    B = initial.shape[0]
    nch = layout.num_chunks.tolist()
    prev = torch.empty_like(local)
    lossy = initial.dtype != torch.float32
    if B and all(n == nch[0] for n in nch):  # every request has the same chunk count: one pass per chunk index,
        n = nch[0]  # each chunk's end state written straight into states (and read from there as the next carry)
        lv, dv = local.view(B, n, *local.shape[1:]), decay.view(B, n, -1)
        pv, sv = prev.view_as(lv), states.view_as(lv)
        carry = initial
        for j in range(n):
            pv[:, j] = carry
            torch.addcmul(lv[:, j], carry, dv[:, j, :, None, None], out=sv[:, j])
            if lossy:
                sv[:, j] = sv[:, j].to(initial.dtype)
            carry = sv[:, j]
        return prev
    carry = initial.to(torch.float32, copy=True)
    first = layout.first_chunk.tolist()
    for j in range(layout.max_chunks):
        reqs = [i for i in range(B) if nch[i] > j]
        cidx = torch.tensor([first[i] + j for i in reqs], device=local.device)
        rows = torch.tensor(reqs, device=local.device)
        cur = carry.index_select(0, rows)
        prev.index_copy_(0, cidx, cur)
        cur.mul_(decay.index_select(0, cidx)[:, :, None, None]).add_(local.index_select(0, cidx))
        if lossy:
            cur.copy_(cur.to(initial.dtype))
        states.index_copy_(0, cidx, cur)
        carry.index_copy_(0, rows, cur)
    return prev


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
    """`ssd.ssd_varlen_ref`: x [T, H, P], dt [T, H] fp32 (softplus'd), A [H], B/C [T, G, N], D [H],
    initial_states [B, H, P, N] -> (y [T, H, P] fp32, chunk_states [Nc, H, P, N] fp32)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G:
        raise ValueError(f"heads {H} not divisible by groups {G}")
    out = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    states = torch.empty(len(layout.chunk_lens_host), H, P, N, dtype=torch.float32, device=x.device)
    nch = layout.num_chunks.tolist()
    for r0, r1 in _request_groups(nch):
        sub, (t0, t1), (c0, c1) = _sub_layout(layout, nch, r0, r1)
        _ssd_group(x[t0:t1], dt[t0:t1], A, B[t0:t1], C[t0:t1], D, initial_states[r0:r1], sub, out[t0:t1], states[c0:c1])
    return out, states


def _request_groups(num_chunks: list[int]) -> list[tuple[int, int]]:
    """Consecutive requests [r0, r1) grouped while their chunks (num_chunks[i] each) add up to at most
    SSD_BLOCK_CHUNKS (a request with more is a group of its own)."""
    groups, r0, n = [], 0, 0
    for i, k in enumerate(num_chunks):
        if n and n + k > SSD_BLOCK_CHUNKS:
            groups.append((r0, i))
            r0, n = i, 0
        n += k
    if n:
        groups.append((r0, len(num_chunks)))
    return groups


def _sub_layout(
    layout: ChunkLayout, num_chunks: list[int], r0: int, r1: int
) -> tuple[ChunkLayout, tuple[int, int], tuple[int, int]]:
    """Requests [r0, r1) of layout (num_chunks: its num_chunks on the host) as a layout of their own, with their
    token range [t0, t1) and chunk range [c0, c1) in the whole batch (requests and their chunks are in order)."""
    lens = layout.chunk_lens_host
    c0 = sum(num_chunks[:r0])
    c1 = c0 + sum(num_chunks[r0:r1])
    t0 = sum(lens[:c0])
    t1 = t0 + sum(lens[c0:c1])
    if r0 == 0 and r1 == len(num_chunks):
        return layout, (t0, t1), (c0, c1)
    sub = ChunkLayout(
        layout.chunk_size,
        layout.chunk_req[c0:c1] - r0,
        layout.chunk_start[c0:c1] - t0,
        layout.chunk_len[c0:c1],
        layout.first_chunk[r0:r1] - c0,
        layout.num_chunks[r0:r1],
        max(num_chunks[r0:r1]),
        lens[c0:c1],
    )
    return sub, (t0, t1), (c0, c1)


def _ssd_group(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_states: torch.Tensor,
    layout: ChunkLayout,
    out: torch.Tensor,
    chunk_states: torch.Tensor,
) -> None:
    """The scan of one group of whole requests (layout: theirs alone): writes y [T, H, P] into out and the state
    after each chunk [Nc, H, P, N] into chunk_states (both fp32)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    rep, c = H // G, layout.chunk_size
    full = all(n == c for n in layout.chunk_lens_host)
    Nc = len(layout.chunk_lens_host)
    dtc = _chunked(dt.float(), layout, full)  # [Nc, C, H]
    if not full:
        valid = torch.arange(c, device=x.device)[None, :] < layout.chunk_len[:, None]
        dtc = dtc * valid[:, :, None]
    dth = dtc.permute(0, 2, 1).contiguous()  # [Nc, H, C]
    xh = _chunked(x.float(), layout, full).permute(0, 2, 1, 3)  # [Nc, H, C, P] view
    Bg = _chunked(B.float(), layout, full).permute(0, 2, 1, 3).contiguous()  # [Nc, G, C, N]
    Cg = _chunked(C.float(), layout, full).permute(0, 2, 1, 3).contiguous()
    acs = torch.cumsum(dth * A.float()[None, :, None], dim=-1)  # [Nc, H, C]
    xdt = torch.mul(xh, dth[..., None], out=torch.empty(Nc, H, c, P, device=x.device))  # dt_s x_s, head-major
    # intra-chunk: y_diag[l] = sum_{s<=l} (C_l . B_s) exp(acs_l - acs_s) dt_s x_s. acs falls along a chunk, so
    # the entries above the diagonal (s > l) are exp of positive numbers (maybe inf), then zeroed by tril_
    # (a masked_fill to -inf before the exp costs about 3x as much on the CPU)
    decay_ls = (acs[:, :, :, None] - acs[:, :, None, :]).exp_().tril_()  # [Nc, H, C, C]
    scores = torch.matmul(Cg, Bg.transpose(-1, -2))  # [Nc, G, C, C]
    decay_ls.view(Nc, G, rep, c, c).mul_(scores[:, :, None])
    y = torch.matmul(decay_ls, xdt)  # [Nc, H, C, P]
    # chunk-local end states: sum_s exp(acs_end - acs_s) dt_s x_s B_s^T, one matmul per group over its heads' rows
    # (the weighted dt x written P-major, [Nc, H, P, C], so the group's rows are one [rep * P, C] operand: no
    # broadcast copy of B per head)
    decay_end = torch.exp(acs[:, :, -1:] - acs)[:, :, None, :]  # [Nc, H, 1, C]
    xw = torch.mul(xdt.transpose(-1, -2), decay_end, out=torch.empty(Nc, H, P, c, device=x.device))
    local = torch.matmul(xw.view(Nc, G, rep * P, c), Bg).view(Nc, H, P, N)  # [Nc, G, rep * P, C] @ [Nc, G, C, N]
    prev = _inter_chunk(local, torch.exp(acs[:, :, -1]), initial_states, layout, chunk_states)
    # state entering the chunk, read by C and decayed to each position: one matmul per group over its heads'
    # rows ([C, N] @ [N, rep * P]), added to y through a strided view with the decay (one addcmul_)
    y_off = torch.matmul(Cg, prev.view(Nc, G, rep * P, N).transpose(-1, -2))  # [Nc, G, C, rep * P]
    y.view(Nc, G, rep, c, P).addcmul_(y_off.view(Nc, G, c, rep, P).transpose(2, 3), acs.exp().view(Nc, G, rep, c, 1))
    y = y.permute(0, 2, 1, 3)  # [Nc, C, H, P]
    Dx = D.float()[None, None, :, None]
    if full:  # y + D x, written once in token order
        torch.addcmul(y, x.float().view(Nc, c, H, P), Dx, out=out.view(Nc, c, H, P))
        return
    offs = torch.arange(c, device=x.device)
    tok_valid = offs[None, :] < layout.chunk_len[:, None]
    out[(layout.chunk_start[:, None] + offs[None, :])[tok_valid]] = y[tok_valid]
    out.add_(D.float()[None, :, None] * x.float())


def ascending_run(slot_ids: torch.Tensor) -> int | None:
    """First slot when slot_ids [B] is s, s+1, ..., s+B-1 (so pool[s:s+B] is a view of those rows), else None."""
    ids = slot_ids.tolist()
    if ids and ids == list(range(ids[0], ids[0] + len(ids))):
        return ids[0]
    return None


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
) -> torch.Tensor:
    """`ssd.selective_state_update_slots_raw_dt_ref`: ssm_pool [S, H, P, N] fp32 updated in place at slot_ids [Bt]
    (bf16: advanced on an fp32 copy, stored back rounded); x [Bt, H, P], raw dt [Bt, H], A_log/D/dt_bias [H],
    B/C [Bt, G, N]. Returns y [Bt, H, P] fp32."""
    if ssm_pool.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"ssm_pool must be float32 or bfloat16, got {ssm_pool.dtype}")
    if ssm_pool.dtype != torch.float32:
        state = ssm_pool.index_select(0, slot_ids).float()
        y = _ssu_in_place(state, x, dt, A_log, B, C, D, dt_bias, dt_clamp)
        ssm_pool.index_copy_(0, slot_ids, state.to(ssm_pool.dtype))
        return y
    first = ascending_run(slot_ids)
    state = ssm_pool[first : first + x.shape[0]] if first is not None else ssm_pool.index_select(0, slot_ids)
    y = _ssu_in_place(state, x, dt, A_log, B, C, D, dt_bias, dt_clamp)
    if first is None:
        ssm_pool.index_copy_(0, slot_ids, state)
    return y


def _ssu_in_place(state, x, dt, A_log, B, C, D, dt_bias, dt_clamp) -> torch.Tensor:
    """One decode step on state [Bt, H, P, N] fp32 in place; returns y [Bt, H, P] fp32."""
    Bt, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    rep = H // G
    dt = dt_softplus_clamp(dt, dt_bias, dt_clamp)  # [Bt, H] fp32
    dA = torch.exp(dt * -torch.exp(A_log.float()))
    state.mul_(dA[:, :, None, None])
    dtx = (dt[:, :, None] * x.float()).view(Bt, G, rep * P, 1)
    sg = state.view(Bt, G, rep * P, N)
    sg.addcmul_(dtx, B.float().view(Bt, G, 1, N))
    y = torch.matmul(sg, C.float().view(Bt, G, N, 1)).view(Bt, H, P)
    return y.add_(D.float()[None, :, None] * x.float())
