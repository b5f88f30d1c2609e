"""GQA attention without positional encoding, on the paged KV pool.

q, k and v come from ONE projection, `qkv_proj` (weight rows: q [Hq*Dh], then k [Hkv*Dh], then v [Hkv*Dh]), so a
batch-1 decode step launches one GEMV instead of three (k and v alone are tiny, launch-bound GEMVs). Its output is
split by views, no copies: `paged_attention` reads q through its strides and `write_kv` scatters k and v from their
strided views. Checkpoints keep HF's `q_proj`/`k_proj`/`v_proj` names; `checkpoint_rows` tells the loader where
each lands."""
from __future__ import annotations

import torch
from torch import nn

from service.engine.config import ModelConfig
from service.engine.kernels import Kernels
from service.engine.layers.linear import project
from service.engine.layers.meta import AttentionMeta


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hq, self.hkv, self.dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.dh ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.hq + 2 * self.hkv) * self.dh, bias=False)
        self.o_proj = nn.Linear(self.hq * self.dh, cfg.hidden_size, bias=False)

    def checkpoint_rows(self) -> dict[str, tuple[str, int, int]]:
        """HF checkpoint tensor -> (our parameter, first row, end row), names relative to this module."""
        q, kv = self.hq * self.dh, self.hkv * self.dh
        return {"q_proj.weight": ("qkv_proj.weight", 0, q), "k_proj.weight": ("qkv_proj.weight", q, q + kv),
                "v_proj.weight": ("qkv_proj.weight", q + kv, q + 2 * kv)}

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (Hq + 2*Hkv) * Dh] -> views q [T, Hq, Dh], k and v [T, Hkv, Dh] (row stride (Hq + 2*Hkv) * Dh)."""
        T = qkv.shape[0]
        q, kv = self.hq * self.dh, self.hkv * self.dh
        return (qkv[:, :q].view(T, self.hq, self.dh), qkv[:, q:q + kv].view(T, self.hkv, self.dh),
                qkv[:, q + kv:].view(T, self.hkv, self.dh))

    def forward(self, h: torch.Tensor, meta: AttentionMeta, k_cache: torch.Tensor, v_cache: torch.Tensor,
                k: Kernels) -> torch.Tensor:
        """h [T, hidden]; k_cache/v_cache [num_pages * page_size, Hkv, Dh] (new K/V written in place)."""
        q, key, value = self.split_qkv(project(k, self.qkv_proj, h))
        k.write_kv(k_cache, v_cache, key, value, meta.kv_slot_mapping)
        o = k.paged_attention(q, k_cache, v_cache, meta.page_table, meta.query_start_loc, meta.prefix_lens,
                              meta.max_query_len, meta.max_seq_len, meta.page_size, self.scale)
        return project(k, self.o_proj, o.reshape(h.shape[0], self.hq * self.dh))
