"""GQA attention without positional encoding, on the paged KV pool."""
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
        self.q_proj = nn.Linear(cfg.hidden_size, self.hq * self.dh, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.dh, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.dh, bias=False)
        self.o_proj = nn.Linear(self.hq * self.dh, cfg.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, meta: AttentionMeta, k_cache: torch.Tensor, v_cache: torch.Tensor,
                k: Kernels) -> torch.Tensor:
        """h [T, hidden]; k_cache/v_cache [num_pages * page_size, Hkv, Dh] (new K/V written in place)."""
        T = h.shape[0]
        q = project(k, self.q_proj, h).view(T, self.hq, self.dh)
        k.write_kv(k_cache, v_cache, project(k, self.k_proj, h).view(T, self.hkv, self.dh),
                   project(k, self.v_proj, h).view(T, self.hkv, self.dh), meta.kv_slot_mapping)
        o = k.paged_attention(q, k_cache, v_cache, meta.page_table, meta.query_start_loc, meta.prefix_lens,
                              meta.max_query_len, meta.max_seq_len, meta.page_size, self.scale)
        return project(k, self.o_proj, o.reshape(T, self.hq * self.dh))
