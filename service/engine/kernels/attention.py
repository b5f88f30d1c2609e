"""Paged causal attention (GQA, no positional encoding) over a packed batch. Pure torch reference.

KV lives in a flat token-slot cache `[num_pages * page_size, Hkv, Dh]`; token t of request i sits at
`page_table[i, t // page_size] * page_size + t % page_size`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_ref(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k/v [T, Hkv, Dh] written to caches [S, Hkv, Dh] at slot_mapping [T]."""
    k_cache[slot_mapping] = k.to(k_cache.dtype)
    v_cache[slot_mapping] = v.to(v_cache.dtype)


def _gather_kv(
    cache: torch.Tensor, page_table: torch.Tensor, length: int, page_size: int, rows: torch.Tensor
) -> torch.Tensor:
    """cache [S, Hkv, Dh] -> [len(rows), length, Hkv, Dh] for page_table rows."""
    pos = torch.arange(length, device=cache.device)
    slots = page_table[rows][:, pos // page_size] * page_size + pos % page_size
    return cache[slots]


DECODE_REF_ROWS = 32  # decode rows per batched reference call: bounds its fp32 GQA-expanded K/V copy


def _decode_rows_ref(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    scale: float,
    tokens: list[int],
    prefix: list[int],
    reqs: list[int],
) -> None:
    """out[tokens] = attention of the one-query requests `reqs` (query at flat row tokens[j], context
    prefix[j] + 1), batched and padded to the longest context."""
    Hq, Hkv = q.shape[1], k_cache.shape[1]
    rows = torch.tensor(reqs, device=q.device)
    ctx = [p + 1 for p in prefix]
    kmax = max(ctx)
    keys = _gather_kv(k_cache, page_table, kmax, page_size, rows).float()  # [b, L, Hkv, Dh]
    vals = _gather_kv(v_cache, page_table, kmax, page_size, rows).float()
    mask = torch.arange(kmax, device=q.device)[None, :] < torch.tensor(ctx, device=q.device)[:, None]
    o = F.scaled_dot_product_attention(
        q[tokens].float()[:, :, None, :],
        keys.transpose(1, 2),
        vals.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=Hq != Hkv,
    )
    out[tokens] = o[:, :, 0, :].to(q.dtype)


def _check_bounds(query_start_loc: list[int], prefix_lens: list[int], max_query_len: int, max_seq_len: int) -> None:
    lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(prefix_lens))]
    if lens and max(lens) > max_query_len:
        raise ValueError(f"max_query_len {max_query_len} is below the longest query ({max(lens)})")
    if lens and max(p + l for p, l in zip(prefix_lens, lens)) > max_seq_len:
        raise ValueError(f"max_seq_len {max_seq_len} is below the longest sequence")


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, Dh] for the new tokens; keys/values (already written) read from the caches.
    query_start_loc [B+1] int64 and prefix_lens [B] int64 (p_i) are tensors; max_query_len (max l_i) and
    max_seq_len (upper bound on p_i + l_i) are host ints that a fast kernel sizes its launch from; the reference
    reads the lengths back to the host and checks both bounds.
    Request i's queries sit at absolute positions prefix_lens[i] + [0, l_i) and see keys [0, pos].
    Returns [T, Hq, Dh] in q's dtype (softmax in fp32)."""
    query_start_loc, prefix_lens = query_start_loc.tolist(), prefix_lens.tolist()
    T, Hq, Dh = q.shape
    _check_bounds(query_start_loc, prefix_lens, max_query_len, max_seq_len)
    Hkv = k_cache.shape[1]
    out = torch.empty_like(q)
    lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(prefix_lens))]
    dec = [i for i, l in enumerate(lens) if l == 1]
    pre = [i for i, l in enumerate(lens) if l > 1]
    for c in range(0, len(dec), DECODE_REF_ROWS):  # one query each: batched, padded to the longest context
        _decode_rows_ref(
            out,
            q,
            k_cache,
            v_cache,
            page_table,
            page_size,
            scale,
            [query_start_loc[i] for i in dec[c : c + DECODE_REF_ROWS]],
            [prefix_lens[i] for i in dec[c : c + DECODE_REF_ROWS]],
            dec[c : c + DECODE_REF_ROWS],
        )
    for i in pre:
        s, e, p = query_start_loc[i], query_start_loc[i + 1], prefix_lens[i]
        L = p + (e - s)
        rows = torch.tensor([i], device=q.device)
        keys = _gather_kv(k_cache, page_table, L, page_size, rows)[0].float()  # [L, Hkv, Dh]
        vals = _gather_kv(v_cache, page_table, L, page_size, rows)[0].float()
        qpos = p + torch.arange(e - s, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]  # [l, L]
        o = F.scaled_dot_product_attention(
            q[s:e].float().transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            vals.transpose(0, 1)[None],
            attn_mask=mask[None, None],
            scale=scale,
            enable_gqa=Hq != Hkv,
        )
        out[s:e] = o[0].transpose(0, 1).to(q.dtype)
    return out
