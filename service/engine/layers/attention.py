"""GQA attention without positional encoding, on the paged KV pool, split over tensor-parallel ranks by heads.

q, k and v come from ONE projection, `qkv_proj` (weight rows: q [Hq*Dh], then k [Hkv*Dh], then v [Hkv*Dh], each this
rank's heads), so a batch-1 decode step launches one GEMV instead of three (k and v alone are tiny, launch-bound
GEMVs). Its output is split by views, no copies: `paged_attention` reads q through its strides and `write_kv`
scatters k and v from their strided views. Checkpoints keep HF's `q_proj`/`k_proj`/`v_proj` names;
`checkpoint_parts` tells the loader which segment of `qkv_proj` each fills.
Under tp: query heads split; KV heads split too, or (tp > num_key_value_heads) the KV head of this rank's query
heads replicated on the tp / num_key_value_heads ranks that hold them; `o_proj` row-parallel, one all-reduce.
FP8 KV cache (float8_e4m3fn pages): K and V are stored divided by this layer's `k_scale` / `v_scale` (fp32 scalars
from the checkpoint's `k_proj.k_scale` / `v_proj.v_scale`; without them, unit scales) and read back times them."""

from __future__ import annotations

import torch
from torch import nn

from service.engine.config import ModelConfig
from service.engine.distributed.parallel import ParallelContext, RankShapes
from service.engine.kernels import Kernels
from service.engine.layers.linear import ColumnParallelLinear, RowParallelLinear, Segment, project
from service.engine.layers.meta import AttentionMeta


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shapes: RankShapes, parallel: ParallelContext):
        super().__init__()
        self.parallel = parallel
        self.hq, self.hkv, self.dh = shapes.attention_heads, shapes.kv_heads, cfg.head_dim
        self.scale = self.dh**-0.5
        dh = self.dh
        q = Segment(cfg.num_attention_heads * dh, shapes.attention_head_start * dh, self.hq * dh)
        kv = Segment(cfg.num_key_value_heads * dh, shapes.kv_head_start * dh, self.hkv * dh)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, (q, kv, kv), bias=False)
        self.o_proj = RowParallelLinear(q, cfg.hidden_size, bias=False, rank=parallel.rank)

    @staticmethod
    def checkpoint_parts() -> dict[str, tuple[str, int]]:
        """HF checkpoint tensor -> (our parameter, its segment), names relative to this module."""
        return {
            "q_proj.weight": ("qkv_proj.weight", 0),
            "k_proj.weight": ("qkv_proj.weight", 1),
            "v_proj.weight": ("qkv_proj.weight", 2),
        }

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (Hq + 2*Hkv) * Dh] -> views q [T, Hq, Dh], k and v [T, Hkv, Dh] (row stride (Hq + 2*Hkv) * Dh);
        head counts are this rank's."""
        T = qkv.shape[0]
        q, kv = self.hq * self.dh, self.hkv * self.dh
        return (
            qkv[:, :q].view(T, self.hq, self.dh),
            qkv[:, q : q + kv].view(T, self.hkv, self.dh),
            qkv[:, q + kv :].view(T, self.hkv, self.dh),
        )

    def kv_scales(self, k_cache: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) an FP8 cache is read and written with: the checkpoint's (parameters that
        `quant.apply_quantization` adds), else None (unit scales); (None, None) for an unquantized cache."""
        if k_cache.dtype != torch.float8_e4m3fn:
            return None, None
        return getattr(self, "k_scale", None), getattr(self, "v_scale", None)

    def forward(
        self,
        h: torch.Tensor,
        meta: AttentionMeta,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: Kernels,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h [T, hidden]; k_cache/v_cache [num_pages * page_size, Hkv, Dh] of this rank's KV heads (new K/V
        written in place). Returns [T, hidden], summed over the ranks; with rows ([R] int64 flat token indices) the
        K/V of every token is written but only those rows attend (each as one query over its request's keys up to
        itself) and [R, hidden] is returned."""
        q, key, value = self.split_qkv(project(k, self.qkv_proj, h))
        ks, vs = self.kv_scales(k_cache)
        k.write_kv(k_cache, v_cache, key, value, meta.kv_slot_mapping, ks, vs)
        page_table, qsl, prefix_lens, max_query_len = (
            meta.page_table,
            meta.query_start_loc,
            meta.prefix_lens,
            meta.max_query_len,
        )
        if rows is not None:
            q, max_query_len = q[rows], 1
            page_table, qsl, prefix_lens = self._rows_meta(meta, rows)
        o = k.paged_attention(
            q,
            k_cache,
            v_cache,
            page_table,
            qsl,
            prefix_lens,
            max_query_len,
            meta.max_seq_len,
            meta.page_size,
            self.scale,
            ks,
            vs,
        )
        return self.parallel.all_reduce(project(k, self.o_proj, o.reshape(q.shape[0], self.hq * self.dh)))

    @staticmethod
    def _rows_meta(meta: AttentionMeta, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows [R] of the step as R one-query requests: (page_table [R, pages] of each row's request,
        query_start_loc [R+1] = 0..R, prefix_lens [R]: the keys before the row's own)."""
        qsl, rows = meta.query_start_loc, rows.to(meta.query_start_loc.dtype)
        req = torch.searchsorted(qsl[1:], rows, right=True)
        prefix = meta.prefix_lens[req] + rows - qsl[req]
        return meta.page_table[req], torch.arange(rows.shape[0] + 1, device=rows.device, dtype=qsl.dtype), prefix
