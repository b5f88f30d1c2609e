"""Paged causal attention (GQA, no positional encoding) over a packed batch. Pure torch reference.

KV lives in a flat token-slot cache `[num_pages * page_size, Hkv, Dh]`; token t of request i sits at
`page_table[i, t // page_size] * page_size + t % page_size`.

A cache may hold its values scaled (an FP8 KV cache: float8_e4m3fn with one fp32 scale per layer for K and one
for V): `k_scale` / `v_scale` (fp32 scalar tensors, None = 1) mean the cache stores k / k_scale, and into an FP8
cache clamped to +-448 (saturated, never inf/nan); the attention reads back cache * k_scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX


def kv_stored(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x [..] as a cache of cache_dtype stores it: x / scale (None: x), clamped to +-448 for FP8, cast."""
    if scale is not None:
        x = x.float() / scale
    if cache_dtype == FP8_DTYPE:
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(cache_dtype)


def raw_kv(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as its bytes (a uint8 view: indexing it works on every device), any other cache as is."""
    return cache.view(torch.uint8) if cache.dtype == FP8_DTYPE else cache


def kv_loaded(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache values [..] back as fp32: stored * scale (None: stored)."""
    return stored.float() if scale is None else stored.float() * scale


def write_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k/v [T, Hkv, Dh] written to caches [S, Hkv, Dh] at slot_mapping [T] (`kv_stored`: / k_scale, v_scale)."""
    raw_kv(k_cache)[slot_mapping] = raw_kv(kv_stored(k, k_cache.dtype, k_scale))
    raw_kv(v_cache)[slot_mapping] = raw_kv(kv_stored(v, v_cache.dtype, v_scale))


def _gather_kv(
    cache: torch.Tensor, page_table: torch.Tensor, length: int, page_size: int, rows: torch.Tensor
) -> torch.Tensor:
    """cache [S, Hkv, Dh] -> [len(rows), length, Hkv, Dh] for page_table rows."""
    pos = torch.arange(length, device=cache.device)
    slots = page_table[rows][:, pos // page_size] * page_size + pos % page_size
    return raw_kv(cache)[slots].view(cache.dtype)


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
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """out[tokens] = attention of the one-query requests `reqs` (query at flat row tokens[j], context
    prefix[j] + 1), batched and padded to the longest context."""
    Hq, Hkv = q.shape[1], k_cache.shape[1]
    rows = torch.tensor(reqs, device=q.device)
    ctx = [p + 1 for p in prefix]
    kmax = max(ctx)
    keys = kv_loaded(_gather_kv(k_cache, page_table, kmax, page_size, rows), k_scale)  # [b, L, Hkv, Dh]
    vals = kv_loaded(_gather_kv(v_cache, page_table, kmax, page_size, rows), v_scale)
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, Dh] for the new tokens; keys/values (already written) read from the caches, times k_scale /
    v_scale (fp32 scalar tensors; None = 1) when given.
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
            k_scale,
            v_scale,
        )
    for i in pre:
        s, e, p = query_start_loc[i], query_start_loc[i + 1], prefix_lens[i]
        L = p + (e - s)
        rows = torch.tensor([i], device=q.device)
        keys = kv_loaded(_gather_kv(k_cache, page_table, L, page_size, rows)[0], k_scale)  # [L, Hkv, Dh]
        vals = kv_loaded(_gather_kv(v_cache, page_table, L, page_size, rows)[0], v_scale)
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
