"""Fast pure-torch paged attention for the `torch` bundle (tuned on CPU). Same contract as
`attention.paged_attention_ref` (the oracle the tests compare against).

- K/V are read page by page: the cache viewed as [num_pages, page_size, Hkv, Dh] is indexed by the page table, one
  contiguous block per page (no per-token slot arithmetic), in the cache's dtype, and handed to
  `F.scaled_dot_product_attention` as strided [b, Hkv, L, Dh] views (no transpose copy, no fp32 upcast copy: the CPU
  kernel accumulates in fp32).
- Decode rows (one query) run in one call per group of `DECODE_ROWS` with a length mask; their pages are gathered
  by one `index_select` per cache (small groups: the gathered pages are read back from L2, not memory) (rows of page_size * Hkv * Dh values), and the query heads that share a KV head
  are the query rows of that KV head ([b, Hkv, Hq / Hkv, Dh]), so the kernel runs Hkv heads of several rows each
  instead of Hq heads of one row with the K/V broadcast (about half the time at B=32, context 300).
- Prefill requests with the same (cached prefix, new tokens) run in one call, causal without a mask when nothing is
  cached.
- Scaled caches (an FP8 KV cache with k_scale / v_scale): the gathered pages are dequantized to q's dtype
  (cache * scale) before the call.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from service.engine.kernels.attention import _check_bounds, raw_kv

DECODE_ROWS = 8  # decode rows per call: the gathered K/V ([rows, context, Hkv, Dh] each) stays in the core's L2
#                 cache for the attention that reads it (at B=32, context 300: 1.7 ms per layer vs 4.3 ms in one call)


def _pages(
    cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    length: int,
    page_size: int,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """cache [S, Hkv, Dh] -> [len(rows), Hkv, length, Dh] (a strided view of the gathered pages); with a scale,
    the pages times it in `dtype` (FP8 pages: in `dtype` also without one)."""
    n_pages = -(-length // page_size)
    flat = raw_kv(cache).view(-1, page_size * cache[0].numel())  # one row per page
    pages = flat.index_select(0, page_table[rows, :n_pages].flatten()).view(cache.dtype)
    blocks = pages.view(len(rows), n_pages * page_size, *cache.shape[1:])
    return _dequant(blocks, scale, dtype)[:, :length].transpose(1, 2)


def _dequant(blocks: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor:
    """Gathered pages times scale in `dtype` (FP8 pages: in `dtype` also without one); else blocks as they are."""
    if scale is not None:
        return (blocks.float() * scale).to(dtype)
    if blocks.dtype == torch.float8_e4m3fn:
        return blocks.to(dtype)
    return blocks


def _decode(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    scale: float,
    tokens: list[int],
    ctx: list[int],
    reqs: list[int],
    kv_scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> None:
    """out[tokens[j]] = attention of request reqs[j]'s one query over its ctx[j] keys."""
    dev = q.device
    b, (Hq, Dh), Hkv = len(reqs), q.shape[1:], k_cache.shape[1]
    kmax = max(ctx)
    n_pages = -(-kmax // page_size)
    pages = page_table[torch.tensor(reqs, device=dev), :n_pages].flatten()
    keys, vals = (
        _dequant(raw_kv(c).view(-1, page_size * Hkv * Dh).index_select(0, pages).view(c.dtype), s, q.dtype)
        .view(b, n_pages * page_size, Hkv, Dh)[:, :kmax]
        .transpose(1, 2)  # [b, Hkv, kmax, Dh]
        for c, s in zip((k_cache, v_cache), kv_scales)
    )
    mask = None  # every row sees all kmax keys: no mask (the kernel's unmasked path)
    if min(ctx) < kmax:
        mask = (torch.arange(kmax, device=dev)[None, :] < torch.tensor(ctx, device=dev)[:, None])[:, None, None, :]
    run = tokens == list(range(tokens[0], tokens[0] + b))  # one run of rows: views of q and out
    qt = (q[tokens[0] : tokens[0] + b] if run else q[torch.tensor(tokens, device=dev)]).to(keys.dtype)
    o = F.scaled_dot_product_attention(qt.reshape(b, Hkv, Hq // Hkv, Dh), keys, vals, attn_mask=mask, scale=scale)
    if run:
        out[tokens[0] : tokens[0] + b] = o.reshape(b, Hq, Dh)
    else:
        out[tokens] = o.reshape(b, Hq, Dh).to(out.dtype)


def _prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    scale: float,
    starts: list[int],
    prefix: int,
    n: int,
    reqs: list[int],
    kv_scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> None:
    """Requests reqs (each with `prefix` cached tokens and n new queries at flat rows starts[j] + [0, n))."""
    dev = q.device
    L = prefix + n
    rows = torch.tensor(reqs, device=dev)
    keys = _pages(k_cache, page_table, rows, L, page_size, kv_scales[0], q.dtype)  # [b, Hkv, L, Dh]
    vals = _pages(v_cache, page_table, rows, L, page_size, kv_scales[1], q.dtype)
    run = starts == list(range(starts[0], starts[0] + len(reqs) * n, n))  # one run of rows: views of q and out
    if run:
        tok = slice(starts[0], starts[0] + len(reqs) * n)
    else:
        tok = (torch.tensor(starts, device=dev)[:, None] + torch.arange(n, device=dev)[None, :]).flatten()
    qt = q[tok].to(keys.dtype).view(len(reqs), n, *q.shape[1:]).transpose(1, 2)  # [b, Hq, n, Dh]
    gqa = q.shape[1] != keys.shape[1]
    if prefix == 0:
        o = F.scaled_dot_product_attention(qt, keys, vals, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = torch.arange(L, device=dev)[None, :] <= prefix + torch.arange(n, device=dev)[:, None]
        o = F.scaled_dot_product_attention(qt, keys, vals, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if run:
        out[tok].view(len(reqs), n, *q.shape[1:]).copy_(o.transpose(1, 2))
    else:
        out[tok] = o.transpose(1, 2).flatten(0, 1).to(out.dtype)


def paged_attention(
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
    """`attention.paged_attention_ref`: q [T, Hq, Dh] (any strides), caches [S, Hkv, Dh], page_table [B, pages],
    query_start_loc [B+1], prefix_lens [B] (k_scale, v_scale: fp32 scalars or None) -> [T, Hq, Dh] in q's dtype."""
    qsl, plens = query_start_loc.tolist(), prefix_lens.tolist()
    _check_bounds(qsl, plens, max_query_len, max_seq_len)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decode: list[int] = []
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)  # (prefix, new tokens) -> requests
    for i, p in enumerate(plens):
        n = qsl[i + 1] - qsl[i]
        if n == 1:
            decode.append(i)
        elif n > 1:
            groups[(p, n)].append(i)
    for c in range(0, len(decode), DECODE_ROWS):
        reqs = decode[c : c + DECODE_ROWS]
        _decode(
            out,
            q,
            k_cache,
            v_cache,
            page_table,
            page_size,
            scale,
            [qsl[i] for i in reqs],
            [plens[i] + 1 for i in reqs],
            reqs,
            (k_scale, v_scale),
        )
    for (p, n), reqs in groups.items():
        _prefill(
            out,
            q,
            k_cache,
            v_cache,
            page_table,
            page_size,
            scale,
            [qsl[i] for i in reqs],
            p,
            n,
            reqs,
            (k_scale, v_scale),
        )
    return out
