"""Chunk-aligned packed (varlen) SSD scan for Mamba-2 prefill, and the decode recurrence.

The contract the prefix cache relies on (docs/design.md: Chunk-aligned SSD): in a packed batch no chunk spans two requests
and chunk ends fall on *absolute* multiples of `chunk_size` C. Request i with `p_i` tokens already
in its state and `l_i` new tokens gets a first chunk of `min(C - p_i % C, l_i)` tokens when
`p_i % C != 0`, then full chunks (the last may be short). The scan returns the state at every chunk
end; the state at absolute position s (a multiple of C, p_i < s <= p_i + l_i) is chunk
`c0_i + s // C - p_i // C - 1` (`snapshot_chunk_indices`).

Pure torch reference (`*_ref`); the Triton kernels in `triton_ssd.py` match these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from service.engine.kernels.transfer import to_device_async


@dataclass(frozen=True)
class ChunkLayout:
    """Chunk decomposition of a packed batch (host-side ints mirrored as device tensors)."""

    chunk_size: int
    chunk_req: torch.Tensor  # [Nc] int64: request index of each chunk
    chunk_start: torch.Tensor  # [Nc] int64: flat token index of the chunk's first token
    chunk_len: torch.Tensor  # [Nc] int64: tokens in the chunk (1..C)
    first_chunk: torch.Tensor  # [B] int64: c0_i, index of request i's first chunk
    num_chunks: torch.Tensor  # [B] int64: chunks of request i
    max_chunks: int  # max over requests of num_chunks
    chunk_lens_host: tuple[int, ...]  # host copy of chunk_len


def build_chunk_layout(
    query_lens: list[int], prefix_lens: list[int], chunk_size: int, device: torch.device | str = "cpu"
) -> ChunkLayout:
    """query_lens[i] = l_i new tokens, prefix_lens[i] = p_i tokens already in request i's state."""
    if len(query_lens) != len(prefix_lens):
        raise ValueError("query_lens and prefix_lens must have the same length")
    c = chunk_size
    chunk_req, chunk_start, chunk_len, first, counts = [], [], [], [], []
    tok = 0
    for i, (l, p) in enumerate(zip(query_lens, prefix_lens)):
        if l < 1:
            raise ValueError(f"request {i} has query_len {l}; every request needs >= 1 new token")
        first.append(len(chunk_req))
        pos, end = p, p + l
        while pos < end:
            n = min(c - pos % c, end - pos)
            chunk_req.append(i)
            chunk_start.append(tok + pos - p)
            chunk_len.append(n)
            pos += n
        counts.append(len(chunk_req) - first[-1])
        tok += l

    def t(x: list[int]) -> torch.Tensor:
        return to_device_async(x, torch.int64, device)

    return ChunkLayout(
        c,
        t(chunk_req),
        t(chunk_start),
        t(chunk_len),
        t(first),
        t(counts),
        max(counts) if counts else 0,
        tuple(chunk_len),
    )


def snapshot_chunk_indices(
    layout: ChunkLayout, req_idx: list[int], positions: list[int], prefix_lens: list[int]
) -> list[int]:
    """Chunk index holding the state at absolute `positions[j]` (a multiple of C) of request req_idx[j]."""
    c = layout.chunk_size
    first = layout.first_chunk.tolist()
    out = []
    for i, s in zip(req_idx, positions):
        if s % c != 0:
            raise ValueError(f"snapshot position {s} is not a multiple of chunk_size {c}")
        out.append(first[i] + s // c - prefix_lens[i] // c - 1)
    return out


def dt_softplus_clamp(dt: torch.Tensor, dt_bias: torch.Tensor, dt_clamp: tuple[float, float]) -> torch.Tensor:
    """dt [T, H] raw -> softplus(dt + dt_bias) clamped to dt_clamp, in fp32."""
    out = F.softplus(dt.float() + dt_bias.float())
    lo, hi = dt_clamp
    if lo > 0.0 or hi != float("inf"):
        out = out.clamp(min=lo, max=hi)
    return out


def _pad_chunks(t: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[T, ...] -> [Nc, C, ...], zero at padded positions."""
    c = layout.chunk_size
    offs = torch.arange(c, device=t.device)
    idx = layout.chunk_start[:, None] + offs[None, :]  # [Nc, C]
    valid = offs[None, :] < layout.chunk_len[:, None]
    out = t[idx.clamp(max=t.shape[0] - 1)]
    return out * valid.view(*valid.shape, *([1] * (t.dim() - 1))).to(out.dtype)


def ssd_varlen_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_states: torch.Tensor,
    layout: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD over a packed batch.

    x [T, H, P], dt [T, H] (already softplus'd and clamped, fp32), A [H] (negative), B/C [T, G, N],
    D [H], initial_states [B, H, P, N] fp32 or bf16 (per request, gathered from slots; bf16 states are rounded to
    bf16 at every chunk end, where a snapshot may store them, so a state restored from a snapshot equals the one a
    scan through the same chunk end carries on).
    Returns y [T, H, P] fp32 and chunk_states [Nc, H, P, N] fp32 (state after each chunk's last token).
    """
    T, H, P = x.shape
    G = B.shape[1]
    if H % G:
        raise ValueError(f"heads {H} not divisible by groups {G}")
    rep = H // G
    Bh = B.float().repeat_interleave(rep, dim=1)  # [T, H, N]
    Ch = C.float().repeat_interleave(rep, dim=1)
    xc, dtc = _pad_chunks(x.float(), layout), _pad_chunks(dt.float(), layout)  # [Nc,C,H,P], [Nc,C,H]
    Bc, Cc = _pad_chunks(Bh, layout), _pad_chunks(Ch, layout)  # [Nc, C, H, N]
    acs = torch.cumsum(dtc * A.float()[None, None, :], dim=1)  # [Nc, C, H]
    # intra-chunk (diagonal blocks)
    seg = acs[:, :, None, :] - acs[:, None, :, :]  # [Nc, l, s, H]
    causal = torch.ones(layout.chunk_size, layout.chunk_size, dtype=torch.bool, device=x.device).tril()
    L = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("clhn,cshn->clsh", Cc, Bc) * L  # [Nc, l, s, H]
    y_diag = torch.einsum("clsh,csh,cshp->clhp", scores, dtc, xc)
    # chunk-local end states and their decay
    decay_to_end = torch.exp(acs[:, -1:, :] - acs)  # [Nc, C, H]
    local_states = torch.einsum("csh,csh,cshp,cshn->chpn", decay_to_end, dtc, xc, Bc)
    chunk_decay = torch.exp(acs[:, -1, :])  # [Nc, H]
    # inter-chunk recurrence, sequential over each request's chunks, vectorised over requests
    prev_states = torch.empty_like(local_states)  # state entering each chunk
    chunk_states = torch.empty_like(local_states)
    carry = initial_states.float()
    for j in range(layout.max_chunks):
        has = layout.num_chunks > j
        reqs = torch.nonzero(has).flatten()
        cidx = layout.first_chunk[reqs] + j
        prev = carry[reqs]
        prev_states[cidx] = prev
        new = chunk_decay[cidx][:, :, None, None] * prev + local_states[cidx]
        new = new.to(initial_states.dtype).float()  # bf16 states: rounded at the chunk end
        chunk_states[cidx] = new
        carry = carry.clone()
        carry[reqs] = new
    y_off = torch.einsum("clhn,chpn->clhp", Cc, prev_states) * torch.exp(acs)[..., None]
    y_chunks = y_diag + y_off  # [Nc, C, H, P]
    # scatter back to flat tokens
    offs = torch.arange(layout.chunk_size, device=x.device)
    valid = offs[None, :] < layout.chunk_len[:, None]
    tok_idx = (layout.chunk_start[:, None] + offs[None, :])[valid]
    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    y[tok_idx] = y_chunks[valid]
    y = y + D.float()[None, :, None] * x.float()
    return y, chunk_states


def final_chunk_indices(layout: ChunkLayout) -> torch.Tensor:
    """[B] index of each request's last chunk."""
    return layout.first_chunk + layout.num_chunks - 1


def selective_state_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step. state [B, H, P, N] fp32, x [B, H, P], dt [B, H] (softplus'd, fp32), A [H],
    B/C [B, G, N], D [H]. Returns (y [B, H, P] fp32, new_state [B, H, P, N] fp32)."""
    H = x.shape[1]
    rep = H // B.shape[1]
    Bh = B.float().repeat_interleave(rep, dim=1)  # [B, H, N]
    Ch = C.float().repeat_interleave(rep, dim=1)
    dA = torch.exp(dt.float() * A.float()[None, :])  # [B, H]
    new = state.float() * dA[:, :, None, None] + (dt.float()[:, :, None] * x.float())[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, Ch) + D.float()[None, :, None] * x.float()
    return y, new


def selective_state_update_slots_ref(
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """One decode step on the pool in place: ssm_pool [S, H, P, N] fp32 (or bf16 / fp16: the state is advanced in
    fp32 and stored rounded to the pool's dtype; y comes from the fp32 state), slot_ids [B] int64 (distinct, except
    that padding rows may all name the scratch slot 0, whose content is then undefined). Rows as in
    `selective_state_update_ref`; ssm_pool[slot_ids] becomes the new state. Returns y [B, H, P] fp32."""
    y, new = selective_state_update_ref(ssm_pool[slot_ids], x, dt, A, B, C, D)
    ssm_pool[slot_ids] = new.to(ssm_pool.dtype)
    return y


def selective_state_update_slots_raw_dt_ref(
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
    """`selective_state_update_slots_ref` from the raw parameters, as the mamba decode step holds them: dt [B, H] is
    in_proj's raw dt (any float dtype, rows may be strided), A_log [H], dt_bias [H]. The step uses
    `dt_softplus_clamp(dt, dt_bias, dt_clamp)` and A = -exp(A_log) in fp32. Returns y [B, H, P] fp32."""
    return selective_state_update_slots_ref(
        ssm_pool, slot_ids, x, dt_softplus_clamp(dt, dt_bias, dt_clamp), -torch.exp(A_log.float()), B, C, D
    )
