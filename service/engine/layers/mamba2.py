"""Mamba-2 mixer on slot-indexed conv/SSM state pools (docs/design.md: The model, Prefix cache), split over
tensor-parallel ranks by heads.

Each rank holds its heads' z, x and dt rows of `in_proj` and the B/C rows of its groups (split when n_groups % tp
== 0, else the one group of its heads, replicated on the tp / n_groups ranks that hold its heads); `conv1d` the same
x, B, C channels; A_log, D, dt_bias and the gated norm weight its heads; `out_proj` row-parallel (one all-reduce).
Its state pools hold its heads only: conv [S, local x + B + C channels, K-1], ssm [S, local heads, P, N].
The gated RMSNorm normalises over the model's groups (mamba_intermediate / n_groups channels): local to each rank
when groups are split; when a group spans ranks its sum of squares is all-reduced first."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from service.engine.config import ModelConfig
from service.engine.distributed.parallel import ParallelContext, RankShapes
from service.engine.kernels import Kernels
from service.engine.kernels.ssd import dt_softplus_clamp, final_chunk_indices
from service.engine.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    Segment,
    add_norm_project,
    gated_norm_project,
    project,
    segment_loader,
    set_loader,
)
from service.engine.layers.meta import MambaMeta
from service.engine.layers.norm import rms_norm_module


class Mamba2Mixer(nn.Module):
    """Parameter names follow the HF checkpoint (`backbone.layers.{i}.mixer.*`)."""

    def __init__(self, cfg: ModelConfig, shapes: RankShapes, parallel: ParallelContext):
        super().__init__()
        self.cfg, self.shapes, self.parallel = cfg, shapes, parallel
        self.num_heads, self.head_dim = shapes.mamba_heads, cfg.mamba_head_dim
        self.di, self.conv_dim = shapes.mamba_intermediate, shapes.conv_dim
        self.n_groups, N = shapes.mamba_groups, cfg.ssm_state_size
        self.gn = self.n_groups * N
        self.norm_group_size = cfg.mamba_intermediate // cfg.n_groups  # the model's groups, on every rank
        heads = Segment(cfg.mamba_num_heads, shapes.mamba_head_start, self.num_heads)
        di = Segment(cfg.mamba_intermediate, shapes.mamba_head_start * self.head_dim, self.di)
        gn = Segment(cfg.n_groups * N, shapes.mamba_group_start * N, self.gn)
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, (di, di, gn, gn, heads), bias=cfg.use_bias)  # z x B C dt
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim, bias=cfg.use_conv_bias
        )
        for p in self.conv1d.parameters():  # x B C
            set_loader(p, segment_loader(0, (di, gn, gn)))
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        for p in (self.dt_bias, self.A_log, self.D):
            set_loader(p, segment_loader(0, (heads,)))
        self.norm = rms_norm_module(self.di)  # gated group RMSNorm weight
        set_loader(self.norm.weight, segment_loader(0, (di,)))
        self.out_proj = RowParallelLinear(di, cfg.hidden_size, bias=cfg.use_bias, rank=parallel.rank)

    def forward(
        self, h: torch.Tensor, meta: MambaMeta, conv_pool: torch.Tensor, ssm_pool: torch.Tensor, k: Kernels
    ) -> torch.Tensor:
        """h [T, hidden] (the layer's normed input); conv_pool [S, conv_dim, K-1]; ssm_pool [S, H, P, N] fp32 or bf16
        (mamba_ssm_cache_dtype), this rank's channels and heads (updated in place). Returns [T, hidden], summed over
        the ranks."""
        return self._mix(project(k, self.in_proj, h), meta, conv_pool, ssm_pool, k)

    def forward_add_norm(
        self,
        out: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        meta: MambaMeta,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        k: Kernels,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer before its residual add + RMSNorm: h = residual + out (the previous layer's output) ->
        (forward(RMSNorm(h) * norm_weight), h), the add and norm fused with in_proj (`Kernels.add_rms_norm_linear`:
        one launch at batch 1 on the Triton bundle)."""
        zxbcdt, h = add_norm_project(k, self.in_proj, out, residual, norm_weight, eps)
        return self._mix(zxbcdt, meta, conv_pool, ssm_pool, k), h

    def _mix(
        self, zxbcdt: torch.Tensor, meta: MambaMeta, conv_pool: torch.Tensor, ssm_pool: torch.Tensor, k: Kernels
    ) -> torch.Tensor:
        """in_proj's output [T, in_proj_dim] (this rank's rows) -> the layer's output [T, hidden], summed over the
        ranks."""
        T = zxbcdt.shape[0]
        z, xbc, dt = zxbcdt.split([self.di, self.conv_dim, self.num_heads], dim=-1)
        split = meta.split
        if split is None:
            y = self._scan(xbc, dt, meta, conv_pool, ssm_pool, k)
        else:  # one-token rows by the decode recurrence, the others by the varlen scan, back in token order
            dec, pre = split.decode_tokens, split.prefill_tokens
            y_dec = self._scan(xbc.index_select(0, dec), dt.index_select(0, dec), split.decode, conv_pool, ssm_pool, k)
            y_pre = self._scan(xbc.index_select(0, pre), dt.index_select(0, pre), split.prefill, conv_pool, ssm_pool, k)
            y = y_dec.new_empty(T, *y_dec.shape[1:]).index_copy_(0, dec, y_dec).index_copy_(0, pre, y_pre)
        y = y.reshape(T, self.di)
        if self.shapes.group_ranks > 1:
            return self.parallel.all_reduce(self._cross_rank_norm_linear(y, z, k))
        # gated group RMSNorm (to out_proj's dtype) + out_proj: one launch at batch 1 on the Triton bundle
        return self.parallel.all_reduce(
            gated_norm_project(
                k, self.out_proj, y, z, self.norm.weight, self.norm_group_size, self.cfg.layer_norm_epsilon
            )
        )

    def _scan(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        meta: MambaMeta,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        k: Kernels,
    ) -> torch.Tensor:
        """The conv and the SSM of meta's rows: xbc [T, conv_dim] (pre-conv x, B, C), raw dt [T, H] -> y [T, H, P]
        fp32; the rows' conv and SSM states advanced in the pools and their snapshots stored."""
        T = xbc.shape[0]
        weight = self.conv1d.weight[:, 0, :]  # [D, K]
        snaps = meta.snapshots
        if meta.decode_only:  # recurrence on the pools in place, by slot id (no gather / scatter)
            xbc = k.conv_update_slots(xbc, weight, self.conv1d.bias, conv_pool, meta.slot_ids)
            x, B, C = self._split(xbc, T)
            # raw dt [T, H] (a strided split): softplus(dt + dt_bias), the clamp and -exp(A_log) happen in the step
            y = k.selective_state_update_slots_raw_dt(
                ssm_pool, meta.slot_ids, x, dt, self.A_log, B, C, self.D, self.dt_bias, self.cfg.dt_clamp
            )
            if not snaps.empty:
                src = meta.slot_ids[snaps.req_idx]
                conv_pool[snaps.dest_slots] = conv_pool[src]
                ssm_pool[snaps.dest_slots] = ssm_pool[src]
            return y
        A = -torch.exp(self.A_log.float())
        dt = dt_softplus_clamp(dt, self.dt_bias, self.cfg.dt_clamp)  # [T, H] fp32
        init_conv = conv_pool[meta.slot_ids]
        query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        all_reqs = torch.arange(init_conv.shape[0], device=xbc.device)
        if not snaps.empty:
            conv_pool[snaps.dest_slots] = k.conv_windows(
                xbc, init_conv, meta.query_start_loc, snaps.req_idx, snaps.num_new_tokens
            )
        conv_pool[meta.slot_ids] = k.conv_windows(xbc, init_conv, meta.query_start_loc, all_reqs, query_lens)
        xbc = k.conv_varlen(xbc, weight, self.conv1d.bias, init_conv, meta.query_start_loc, meta.token_req)
        x, B, C = self._split(xbc, T)
        # states in the pool's dtype (bf16 pools: the scan rounds every chunk-end state to bf16, so the stores
        # below are exact and a snapshot equals the state a longer scan carries through the same chunk end)
        y, chunk_states = k.ssd_varlen(x, dt, A, B, C, self.D, ssm_pool[meta.slot_ids], meta.layout)
        ssm_pool[meta.slot_ids] = chunk_states[final_chunk_indices(meta.layout)].to(ssm_pool.dtype)
        if not snaps.empty:
            ssm_pool[snaps.dest_slots] = chunk_states[snaps.chunk_idx].to(ssm_pool.dtype)
        return y

    def _cross_rank_norm_linear(self, y: torch.Tensor, z: torch.Tensor, k: Kernels) -> torch.Tensor:
        """Gated RMSNorm + out_proj when this rank holds part of one norm group (tp > n_groups): y, z [T, Di_local]
        -> this rank's partial out_proj output [T, hidden]; the group's sum of squares is all-reduced ([T, n_groups]
        fp32, zero outside this rank's group)."""
        g = y.float() * F.silu(z.float())
        sq = torch.zeros(y.shape[0], self.shapes.n_groups, dtype=torch.float32, device=y.device)
        col = self.shapes.mamba_group_start
        sq[:, col] = g.square().sum(-1)
        mean = self.parallel.all_reduce(sq)[:, col : col + 1] / self.norm_group_size
        normed = self.norm.weight.float() * (g * torch.rsqrt(mean + self.cfg.layer_norm_epsilon))
        return project(k, self.out_proj, normed.to(z.dtype))  # the model dtype (out_proj's, unless FP8)

    def _split(self, xbc: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, B, C = xbc.split([self.di, self.gn, self.gn], dim=-1)
        G, N = self.n_groups, self.cfg.ssm_state_size
        return x.reshape(T, self.num_heads, self.head_dim), B.reshape(T, G, N), C.reshape(T, G, N)
