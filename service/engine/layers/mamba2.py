"""Mamba-2 mixer on slot-indexed conv/SSM state pools (DESIGN §2, §3)."""
from __future__ import annotations

import torch
from torch import nn

from service.engine.config import ModelConfig
from service.engine.kernels import Kernels
from service.engine.kernels.ssd import dt_softplus_clamp, final_chunk_indices
from service.engine.layers.linear import project
from service.engine.layers.meta import MambaMeta
from service.engine.layers.norm import rms_norm_module


class Mamba2Mixer(nn.Module):
    """Parameter names follow the HF checkpoint (`backbone.layers.{i}.mixer.*`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.num_heads, self.head_dim = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.di, self.conv_dim = cfg.mamba_intermediate, cfg.conv_dim
        self.gn = cfg.n_groups * cfg.ssm_state_size
        self.in_proj = nn.Linear(cfg.hidden_size, cfg.in_proj_dim, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim,
                                bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = rms_norm_module(self.di)          # gated group RMSNorm weight
        self.out_proj = nn.Linear(self.di, cfg.hidden_size, bias=cfg.use_bias)

    def forward(self, h: torch.Tensor, meta: MambaMeta, conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
                k: Kernels) -> torch.Tensor:
        """h [T, hidden] (the layer's normed input); conv_pool [S, conv_dim, K-1]; ssm_pool [S, H, P, N] fp32
        (updated in place)."""
        return self._mix(project(k, self.in_proj, h), meta, conv_pool, ssm_pool, k)

    def forward_add_norm(self, out: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         meta: MambaMeta, conv_pool: torch.Tensor, ssm_pool: torch.Tensor, k: Kernels
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer before its residual add + RMSNorm: h = residual + out (the previous layer's output) ->
        (forward(RMSNorm(h) * norm_weight), h), the add and norm fused with in_proj (`Kernels.add_rms_norm_linear`:
        one launch at batch 1 on the Triton bundle)."""
        zxbcdt, h = k.add_rms_norm_linear(out, residual, norm_weight, eps, self.in_proj.weight, self.in_proj.bias)
        return self._mix(zxbcdt, meta, conv_pool, ssm_pool, k), h

    def _mix(self, zxbcdt: torch.Tensor, meta: MambaMeta, conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
             k: Kernels) -> torch.Tensor:
        """in_proj's output [T, in_proj_dim] -> the layer's output [T, hidden]."""
        T = zxbcdt.shape[0]
        z, xbc, dt = zxbcdt.split([self.di, self.conv_dim, self.num_heads], dim=-1)
        weight = self.conv1d.weight[:, 0, :]                                     # [D, K]
        snaps = meta.snapshots
        if meta.decode_only:       # recurrence on the pools in place, by slot id (no gather / scatter)
            xbc = k.conv_update_slots(xbc, weight, self.conv1d.bias, conv_pool, meta.slot_ids)
            x, B, C = self._split(xbc, T)
            # raw dt [T, H] (a strided split): softplus(dt + dt_bias), the clamp and -exp(A_log) happen in the step
            y = k.selective_state_update_slots_raw_dt(ssm_pool, meta.slot_ids, x, dt, self.A_log, B, C, self.D,
                                                      self.dt_bias, self.cfg.dt_clamp)
            if not snaps.empty:
                src = meta.slot_ids[snaps.req_idx]
                conv_pool[snaps.dest_slots] = conv_pool[src]
                ssm_pool[snaps.dest_slots] = ssm_pool[src]
        else:
            A = -torch.exp(self.A_log.float())
            dt = dt_softplus_clamp(dt, self.dt_bias, self.cfg.dt_clamp)          # [T, H] fp32
            init_conv = conv_pool[meta.slot_ids]
            query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
            all_reqs = torch.arange(init_conv.shape[0], device=zxbcdt.device)
            if not snaps.empty:
                conv_pool[snaps.dest_slots] = k.conv_windows(xbc, init_conv, meta.query_start_loc,
                                                             snaps.req_idx, snaps.num_new_tokens)
            conv_pool[meta.slot_ids] = k.conv_windows(xbc, init_conv, meta.query_start_loc, all_reqs, query_lens)
            xbc = k.conv_varlen(xbc, weight, self.conv1d.bias, init_conv, meta.query_start_loc, meta.token_req)
            x, B, C = self._split(xbc, T)
            y, chunk_states = k.ssd_varlen(x, dt, A, B, C, self.D, ssm_pool[meta.slot_ids], meta.layout)
            ssm_pool[meta.slot_ids] = chunk_states[final_chunk_indices(meta.layout)]
            if not snaps.empty:
                ssm_pool[snaps.dest_slots] = chunk_states[snaps.chunk_idx]
        # gated group RMSNorm (to out_proj's dtype) + out_proj: one launch at batch 1 on the Triton bundle
        return k.gated_norm_linear(y.reshape(T, self.di), z, self.norm.weight, self.di // self.cfg.n_groups,
                                   self.cfg.layer_norm_epsilon, self.out_proj.weight, self.out_proj.bias)

    def _split(self, xbc: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, B, C = xbc.split([self.di, self.gn, self.gn], dim=-1)
        G, N = self.cfg.n_groups, self.cfg.ssm_state_size
        return x.reshape(T, self.num_heads, self.head_dim), B.reshape(T, G, N), C.reshape(T, G, N)
