"""Dense ReLU² MLP (`-` layers) and the NemotronH MoE (`E` layers)."""
from __future__ import annotations

import torch
from torch import nn

from service.engine.config import ModelConfig
from service.engine.kernels import Kernels
from service.engine.layers.linear import project


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, h: torch.Tensor, k: Kernels) -> torch.Tensor:
        return project(k, self.down_proj, k.relu2(project(k, self.up_proj, h)))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32),
                                                    requires_grad=False)


class Experts(nn.Module):
    """Stacked expert weights; the loader fills them from `experts.{j}.up_proj.weight` etc."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d_in = cfg.moe_latent_size or cfg.hidden_size
        self.up_proj = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.moe_intermediate_size, d_in))
        self.down_proj = nn.Parameter(torch.zeros(cfg.n_routed_experts, d_in, cfg.moe_intermediate_size))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias)
        if cfg.moe_latent_size:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, cfg.moe_latent_size, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(cfg.moe_latent_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, h: torch.Tensor, k: Kernels) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]. Without a latent projection and biases the shared expert goes into the
        routed-experts op (one fp32 sum, one rounding; the Triton bundle folds it into its batch-1/2 launches)."""
        c = self.cfg
        weights, ids = k.moe_route(h, self.gate.weight, self.gate.e_score_correction_bias, c.num_experts_per_tok,
                                   c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        if not c.moe_latent_size and not c.mlp_bias:
            return k.moe_experts(h, self.experts.up_proj, self.experts.down_proj, weights, ids,
                                 shared_up=self.shared_experts.up_proj.weight,
                                 shared_down=self.shared_experts.down_proj.weight)
        x = project(k, self.fc1_latent_proj, h) if c.moe_latent_size else h
        routed = k.moe_experts(x, self.experts.up_proj, self.experts.down_proj, weights, ids)
        if c.moe_latent_size:
            routed = project(k, self.fc2_latent_proj, routed)
        return routed + self.shared_experts(h, k)
