"""Dense ReLU² MLP (`-` layers) and the NemotronH MoE (`E` layers), split over tensor-parallel ranks.

MLP: up_proj column-parallel, down_proj row-parallel. MoE: the fp32 router on every rank (identical routing);
routed experts intermediate-split over the ranks (ep == 1) or spread whole, E / ep per rank, the picks of other
ranks' experts given weight 0 (ep == tp); the latent projections (fc1/fc2_latent) replicated, fc2 applied to each
rank's partial; the shared expert intermediate-split. Routed and shared partials are summed, then ONE all-reduce."""

from __future__ import annotations

import torch
from torch import nn

from service.engine.config import ModelConfig
from service.engine.distributed.parallel import ParallelContext, RankShapes
from service.engine.kernels import Kernels
from service.engine.kernels.fp8 import Fp8Linear
from service.engine.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    Segment,
    Source,
    copy_into,
    is_fp8_linear,
    project,
    set_loader,
)


class MLP(nn.Module):
    """down(relu(up(h))^2) with the intermediate split: `forward` returns this rank's partial sum; `reduce` sums it
    over the ranks (the dense `-` layer; the MoE's shared expert is summed with the routed experts first)."""

    def __init__(self, hidden: int, intermediate: Segment, bias: bool, parallel: ParallelContext, reduce: bool):
        super().__init__()
        self.parallel, self.reduce = parallel, reduce
        self.up_proj = ColumnParallelLinear(hidden, (intermediate,), bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, rank=parallel.rank)

    def forward(self, h: torch.Tensor, k: Kernels) -> torch.Tensor:
        out = project(k, self.down_proj, k.relu2(project(k, self.up_proj, h)))
        return self.parallel.all_reduce(out) if self.reduce else out


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False
        )


def expert_loader(shapes: RankShapes, split_dim: int):
    """Loader of stacked expert weights [E_local, ...]: the held experts, and of each its intermediate rows
    (split_dim 1 for up_proj [E, I, d_in], 2 for down_proj [E, d_in, I]). part j: the checkpoint's expert j alone
    (skipped, not read, when another rank holds it); part None: the stacked [E, ...] tensor."""
    e0, n, i0, ni = shapes.expert_start, shapes.experts, shapes.moe_intermediate_start, shapes.moe_intermediate

    def load(dst: torch.Tensor, src: Source, part: int | None) -> None:
        full = list(dst.shape)
        full[split_dim] = full[split_dim] * (shapes.tp if shapes.ep == 1 else 1)
        expected = tuple(full[1:]) if part is not None else (full[0] * shapes.ep, *full[1:])
        if src.shape != expected:
            raise ValueError(f"tensor {src.name!r} has shape {src.shape}, the model expects {expected}")
        index = [slice(None)] * 3
        index[split_dim] = slice(i0, i0 + ni)
        if part is None:
            copy_into(dst, src.read((slice(e0, e0 + n), *index[1:])), src)
        elif e0 <= part < e0 + n:
            copy_into(dst[part - e0], src.read(tuple(index[1:])), src)

    return load


class Experts(nn.Module):
    """Stacked weights of this rank's experts; the loader fills them from `experts.{j}.up_proj.weight` etc."""

    def __init__(self, cfg: ModelConfig, shapes: RankShapes):
        super().__init__()
        d_in = cfg.moe_latent_size or cfg.hidden_size
        self.up_proj = nn.Parameter(torch.zeros(shapes.experts, shapes.moe_intermediate, d_in))
        self.down_proj = nn.Parameter(torch.zeros(shapes.experts, d_in, shapes.moe_intermediate))
        set_loader(self.up_proj, expert_loader(shapes, 1))
        set_loader(self.down_proj, expert_loader(shapes, 2))


def local_picks(
    weights: torch.Tensor, ids: torch.Tensor, num_local: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing [T, k] over all experts -> the same over this rank's num_local experts (rank r holds experts
    [r * num_local, (r + 1) * num_local)), shapes kept so every op (and CUDA graph) stays static: a pick of another
    rank's expert becomes weight 0 on local expert 0. Those picks are still computed (the kernels have no skip), all
    on one expert, so at decode they re-read one expert's weights instead of streaming others."""
    local = ids - rank * num_local
    mine = (local >= 0) & (local < num_local)
    return torch.where(mine, weights, torch.zeros_like(weights)), torch.where(mine, local, torch.zeros_like(local))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, shapes: RankShapes, parallel: ParallelContext):
        super().__init__()
        self.cfg, self.shapes, self.parallel = cfg, shapes, parallel
        self.gate = Router(cfg)
        self.experts = Experts(cfg, shapes)
        shared = Segment(
            cfg.moe_shared_expert_intermediate_size,
            parallel.rank * shapes.shared_intermediate,
            shapes.shared_intermediate,
        )
        self.shared_experts = MLP(cfg.hidden_size, shared, cfg.mlp_bias, parallel, reduce=False)
        if cfg.moe_latent_size:
            self.fc1_latent_proj = ReplicatedLinear(cfg.hidden_size, cfg.moe_latent_size, cfg.mlp_bias, parallel.rank)
            self.fc2_latent_proj = ReplicatedLinear(
                cfg.moe_latent_size, cfg.hidden_size, cfg.mlp_bias, parallel.rank, partial_input=True
            )

    def forward(self, h: torch.Tensor, k: Kernels) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden] summed over the ranks. Without a latent projection and biases, when the
        shared expert's linears are of the experts' kind (both FP8 with FP8 experts, both not without), the shared
        expert goes into the routed-experts op (one fp32 sum, one rounding; the Triton bundle folds it into its
        batch-1/2 launches); otherwise it and the latent projections run as separate linears."""
        c = self.cfg
        weights, ids = k.moe_route(
            h,
            self.gate.weight,
            self.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        if self.shapes.ep > 1:
            weights, ids = local_picks(weights, ids, self.shapes.experts, self.parallel.rank)
        sh = self.shared_experts
        same_kind = is_fp8_linear(sh.up_proj) == is_fp8_linear(sh.down_proj) == self._fp8_experts()
        if not c.moe_latent_size and not c.mlp_bias and same_kind:
            shared = dict(shared_up=self._shared_arg(sh.up_proj), shared_down=self._shared_arg(sh.down_proj))
            return self.parallel.all_reduce(self._experts(h, weights, ids, k, **shared))
        x = project(k, self.fc1_latent_proj, h) if c.moe_latent_size else h
        routed = self._experts(x, weights, ids, k)
        if c.moe_latent_size:
            routed = project(k, self.fc2_latent_proj, routed)
        return self.parallel.all_reduce(routed + sh(h, k))

    def _fp8_experts(self) -> bool:
        return self.experts.up_proj.dtype == torch.float8_e4m3fn

    def _shared_arg(self, lin: nn.Module) -> torch.Tensor | Fp8Linear:
        """A shared-expert linear as the experts ops take it: its weight, or (FP8) an `Fp8Linear`."""
        return Fp8Linear(lin.weight, lin.weight_scale, lin.input_scale) if is_fp8_linear(lin) else lin.weight

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, k: Kernels, **shared) -> torch.Tensor:
        """The routed experts (+ the shared expert given as shared_up / shared_down) of this rank: `k.moe_experts`,
        or `k.fp8_moe_experts` with the per-expert weight scales and the static input scales for FP8 experts."""
        e = self.experts
        if not self._fp8_experts():
            return k.moe_experts(x, e.up_proj, e.down_proj, weights, ids, **shared)
        return k.fp8_moe_experts(
            x,
            e.up_proj,
            e.down_proj,
            e.up_proj_weight_scale,
            e.down_proj_weight_scale,
            e.up_proj_input_scale,
            e.down_proj_input_scale,
            weights,
            ids,
            **shared,
        )
